"""Diffusion and flow models as their community writes them (``diffusion_models``), end to
end: the recorder on the training loop, then ``nanreplay --json`` on its bundle. The noise and
the timesteps are drawn inside the step, so the replay must draw the same ones, and name the
samples whose timestep was at the edge of the schedule."""

from __future__ import annotations

import json
from pathlib import Path

import diffusion_models as D
import pytest
import torch
from bundles import invoke_cli

from recorder import FlightRecorder, NonFiniteError

BATCH = 16


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def report(bundle) -> dict:
    """The JSON report of a reproduced event."""
    r = invoke_cli(bundle, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def train_diffusion(out_dir: Path, steps: int = 12, rewind: int | None = None,
                    **kw) -> NonFiniteError:
    torch.manual_seed(0)
    model = D.make_diffusion(**kw)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4)
    data = torch.randn(64, 1, 8, 8)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True)
    with pytest.raises(NonFiniteError) as info, \
            FlightRecorder(model, opt, out_dir=out_dir, factory="diffusion_models:make_diffusion",
                           factory_kwargs=kw, rewind=rewind):
        for _ in range(steps // len(loader)):
            for x0 in loader:
                opt.zero_grad()
                model(x0).backward()
                opt.step()
    return info.value


def first_terminal_timesteps(seed: int) -> tuple[int, list[int]]:
    """The first step whose timesteps, drawn from a generator seeded ``seed`` as the model
    draws them, hold the last one, and the samples that drew it."""
    g = torch.Generator().manual_seed(seed)
    for step in range(100):
        t = torch.randint(0, D.T, (BATCH,), generator=g)
        torch.randn(BATCH, 1, 8, 8, generator=g)
        if (t == D.T - 1).any():
            return step, (t == D.T - 1).nonzero().flatten().tolist()
    raise AssertionError("no terminal timestep drawn")


def test_noise_drawn_from_the_models_own_generator_is_drawn_again(tmp_path):
    """``torch.randint(..., generator=self.gen)`` in the forward: the replay's factory made a
    generator freshly seeded, so without the recorded state it drew other timesteps, ran
    finite and called the step nondeterministic."""
    step, samples = first_terminal_timesteps(1234)
    err = train_diffusion(tmp_path, seed=1234)
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (step, "forward", "")
    rep = report(err.bundle_path)
    assert rep["reproduced"] is True, json.dumps(rep, indent=1)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("", "aten.div", samples, "invalid"), json.dumps(rep, indent=1)


def test_the_rewind_window_draws_each_step_from_the_models_generator(tmp_path):
    """Each step of a rewind window's re-run starts from the generator state its step began
    with: the event comes back at its step, and a lower learning rate does not remove it."""
    step, _ = first_terminal_timesteps(9)
    assert step >= 4  # (past the window's first copy)
    err = train_diffusion(tmp_path, rewind=4, seed=9)
    r = invoke_cli(err.bundle_path, "--json", "--try", "lr=0.1x")
    rep = json.loads(r.stdout)
    win = rep["window"]
    assert win["reproduced"] is True, json.dumps(win, indent=1)
    assert (win["first_non_finite"]["step"], win["first_non_finite"]["phase"]) == \
        (step, "forward"), win
    [t] = rep["what_if"]
    assert (t["finite"], t["origin"]["step"]) == (False, step), t


@torch.no_grad()
def ddim_sample(model, n: int, steps: int = 4) -> torch.Tensor:
    """A deterministic DDIM sampler over the zero terminal SNR schedule: its first step's
    ``x0 = (x - sqrt(1 - ab) * eps) / sqrt(ab)`` divides by 0 at the last timestep."""
    ab_all = D.zero_snr_cosine_alphas_cumprod(D.T)
    ts = torch.linspace(D.T - 1, 0, steps).long()
    model.eval()
    x = torch.randn(n, 1, 8, 8)
    for i, t in enumerate(ts):
        eps = model(x, t.repeat(n))
        ab = ab_all[t]
        x0 = (x - (1 - ab).sqrt() * eps) / ab.sqrt()
        prev = ab_all[ts[i + 1]] if i + 1 < steps else torch.tensor(1.0)
        x = prev.sqrt() * x0 + (1 - prev).sqrt() * eps
    model.train()
    return x


def test_a_sampler_feeding_the_model_an_infinite_tensor_is_not_blamed_on_a_feature(tmp_path):
    """A validation sampler between steps: the sampler's division by sqrt(alpha_bar) = 0 makes
    every value of the next forward's input infinite. The hint said 'a per-feature step of the
    data pipeline made them' (a standardisation by a zero std), as for a few bad columns."""
    torch.manual_seed(0)
    model = D.make_unet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ab_all = D.zero_snr_cosine_alphas_cumprod(D.T)
    with pytest.raises(NonFiniteError) as info, \
            FlightRecorder(model, opt, loss_fn=torch.nn.MSELoss(), out_dir=tmp_path,
                           factory="diffusion_models:make_unet") as rec:
        for _ in range(2):
            x0 = torch.randn(BATCH, 1, 8, 8)
            t = torch.randint(0, D.T - 1, (BATCH,))
            noise = torch.randn_like(x0)
            ab = ab_all[t].view(-1, 1, 1, 1)
            loss = rec.loss_fn(model(ab.sqrt() * x0 + (1 - ab).sqrt() * noise, t), noise)
            opt.zero_grad()
            loss.backward()
            opt.step()
        ddim_sample(model, 4)
    err = info.value
    assert (err.event["phase"], err.event["evaluation"], err.event["tensor"]) == \
        ("input", True, "args[0]"), err.event
    rep = report(err.bundle_path)
    assert (rep["cause"], rep["origin"]["samples"]) == ("input", [0, 1, 2, 3]), rep
    assert "same feature" not in rep["hint"], rep["hint"]
    assert rep["hint"].startswith("the batch itself holds NaN/Inf, and every value of args[0] "
                                  "is +Inf or -Inf: no sample and no feature stands out"), \
        rep["hint"]
    assert "sampling loop" in rep["hint"], rep["hint"]


def train_flow(out_dir: Path, init_first: bool) -> NonFiniteError:
    """A flow trained at too large a learning rate, its ActNorms initialised by a pass over a
    first batch, run before the recorder attached (``init_first``) or inside it."""
    torch.manual_seed(0)
    model = D.make_flow()
    opt = torch.optim.Adam(model.parameters(), lr=0.2)
    data = torch.randn(512, 8) * torch.linspace(0.1, 3, 8)
    loader = torch.utils.data.DataLoader(data, batch_size=64, shuffle=True)

    def init_pass():
        with torch.no_grad():
            model(data[:256])

    if init_first:
        init_pass()
    with pytest.raises(NonFiniteError) as info, \
            FlightRecorder(model, opt, loss_fn=D.flow_nll, out_dir=out_dir,
                           factory="diffusion_models:make_flow") as rec:
        if not init_first:
            init_pass()
        for _ in range(2):
            for x in loader:
                opt.zero_grad()
                rec.loss_fn(*model(x)).backward()
                opt.step()
    return info.value


def test_a_flag_an_init_pass_set_before_attach_is_named_by_the_fidelity_check(tmp_path):
    """ActNorm's ``initialized`` set by a data-dependent init pass before the recorder
    attached: the factory builds it False, so the re-run initialised the layers again from the
    event's batch. The fidelity line blamed an in-place write between the forward and the loss
    (the re-run's own init, written into the bundle's weights); it must name the flags."""
    err = train_flow(tmp_path, init_first=True)
    assert (err.event["phase"], err.event["module"]) == ("forward", "layers.3"), err.event
    r = invoke_cli(err.bundle_path, "--json")
    rep = json.loads(r.stdout)
    fid = rep["fidelity"]
    assert (fid["matches"], rep["reproduced"]) == (False, False), json.dumps(rep, indent=1)
    assert fid["built_otherwise"] == [f"layers.{i}.initialized = False (the run had True)"
                                      for i in (0, 2, 4, 6)], fid
    assert "attach the recorder before setting them" in invoke_cli(err.bundle_path).stdout


def test_a_flow_initialised_under_the_recorder_replays_its_overflow(tmp_path):
    """The same run with the init pass inside the recorder: the flags are bundled, set again,
    and the replay names the coupling's ``xb * exp(s)``. Its hint said only to rescale the
    product's inputs or compute in float64: the huge factor is the unbounded exponential's,
    so it must say to bound the exponent (tanh), as it does when the exp itself overflows."""
    err = train_flow(tmp_path, init_first=False)
    rep = report(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], rep["cause"]) == \
        (True, "layers.3", "aten.mul", "overflow"), json.dumps(rep, indent=1)
    assert "bound a learned exponent (s.clamp(max=...), or scale * tanh(s)" in rep["hint"], \
        rep["hint"]


def test_the_float64_rerun_draws_the_noise_and_times_the_step_drew(tmp_path):
    """Flow matching draws its noise with ``randn_like``, then the times: at t = 1 the
    velocity is x/0, a pole. The float64 re-run drew the noise in float64, which takes other
    words from the generator, so the times after it were others: the denominator was finite
    there, and the cause came out 'precision' (rounding across the domain edge)."""
    torch.manual_seed(0)
    model = D.make_x_prediction_flow()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x1 = torch.randn(32, 1, 8, 8)
    crit = torch.nn.MSELoss()
    with pytest.raises(NonFiniteError) as info, \
            FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                           factory="diffusion_models:make_x_prediction_flow"):
        for _ in range(10):
            before = torch.get_rng_state()  # (the event step's, at the end)
            opt.zero_grad()
            crit(*model(x1)).backward()
            opt.step()
    torch.set_rng_state(before)
    torch.randn_like(x1)
    at_one = (torch.randint(0, D.K + 1, (32,)) == D.K).nonzero().flatten().tolist()
    assert at_one, "no time drawn at t = 1"
    rep = report(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("", "aten.div", at_one, "invalid"), json.dumps(rep, indent=1)

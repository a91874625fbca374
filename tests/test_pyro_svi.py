"""End to end: Pyro SVI (pyro-ppl 1.9.2) in the PyTorch-style loop Pyro documents,
``loss = Trace_ELBO().differentiable_loss(model, guide, x, y); loss.backward();
optimizer.step()``, with the model and guide held by one module whose ``forward`` is that ELBO
(``pyro_svi_models.ELBOModule``) given to ``FlightRecorder`` with a ``torch.optim`` optimizer
over its parameters (the guide's, and the model's ``PyroParam``s). Planted: a NaN observation
(with Pyro's validation and without), a Poisson rate ``exp`` underflowed to 0, a guide scale
learned raw and stepped below 0, a learning rate too large for a learned noise, a VAE decoder's
``softplus`` scale rounded to 0, a prior too tight for float32; each replayed with the CLI."""

from __future__ import annotations

import json

import pytest

pyro = pytest.importorskip("pyro")

import pyro_svi_models as M  # noqa: E402
import torch  # noqa: E402
from bundles import invoke_cli, source_line  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from recorder import FlightRecorder, NonFiniteError  # noqa: E402

pytestmark = [pytest.mark.usefixtures("in_tests_dir"),
              pytest.mark.filterwarnings("ignore:Encountered NaN:UserWarning")]

# Trace_ELBO's own warn_if_nan, which the re-run of a NaN step sets off as training did
PYRO_WARNING = ("UserWarning: Encountered NaN: loss", "warn_if_nan(surrogate_loss")


def replay(bundle) -> dict:
    """``nanreplay BUNDLE --json``: the report; stderr holds Pyro's NaN warning at most."""
    r = invoke_cli(bundle, "--json")
    assert r.exit_code == 0, (r.exit_code, r.stdout[-2000:], r.stderr)
    assert all(any(w in line for w in PYRO_WARNING) for line in r.stderr.splitlines()
               if line.strip()), r.stderr
    return json.loads(r.stdout)


def train(mod, opt, loader, steps: int, bad: dict | None = None, clip: float | None = None):
    """The PyTorch-style SVI loop over ``loader`` (``bad``: step -> the batch that step gets)."""
    it = iter(loader)
    for step in range(steps):
        batch = (bad or {}).get(step) or next(it)
        opt.zero_grad()
        loss = mod(*batch)  # Trace_ELBO().differentiable_loss(model, guide, *batch)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(mod.parameters(), clip)
        opt.step()


def fire(tmp_path, mod, opt, loader, factory, steps=6, kwargs=None, raises=NonFiniteError,
         rec=None, **kw):
    """``train`` under the recorder until the event; (the JSON report, the raised error)."""
    with pytest.raises(raises) as info:
        with FlightRecorder(mod, opt, out_dir=tmp_path / "b",
                            factory=f"pyro_svi_models:{factory}", factory_kwargs=kwargs or {},
                            **(rec or {})):
            train(mod, opt, loader, steps, **kw)
    err = info.value
    if isinstance(err, NonFiniteError):
        return replay(err.bundle_path), err
    notes = "\n".join(getattr(err, "__notes__", []))
    return replay(notes.split("Bundle: ")[1].split(";")[0]), err


def origin(rep):
    o = rep["origin"]
    return rep["event"]["step"], o["phase"], o["module"], o["op"], rep["cause"]


def regression_loader(n=8, bad_row=None):
    x, y = M.regression_data(n)
    if bad_row is not None:
        y[bad_row] = float("nan")
    return DataLoader(TensorDataset(x, y), batch_size=n)


def healthy(record: bool, tmp_path, auto: str):
    torch.manual_seed(0)
    mod = M.make_regression(auto=auto)
    opt = torch.optim.Adam(mod.parameters(), lr=0.02)
    x, y = M.regression_data(32)
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    if record:
        with FlightRecorder(mod, opt, out_dir=tmp_path / "b",
                            factory="pyro_svi_models:make_regression",
                            factory_kwargs={"auto": auto}):
            train(mod, opt, _cycle(loader), 8, clip=10.0)
    else:
        train(mod, opt, _cycle(loader), 8, clip=10.0)
    return {k: v.detach().clone() for k, v in mod.state_dict().items()}


def _cycle(loader):
    while True:
        yield from loader


@pytest.mark.parametrize("auto", ["normal", "diagonal"])
def test_healthy_svi_raises_nothing_and_trains_bit_identically(tmp_path, auto):
    plain = healthy(False, tmp_path, auto)
    recorded = healthy(True, tmp_path, auto)
    assert not list((tmp_path / "b").glob("*.nan"))
    assert plain.keys() == recorded.keys() and len(plain) >= 2
    for k in plain:
        assert torch.equal(plain[k], recorded[k]), k


def test_nan_observation_without_validation_is_the_batch(tmp_path):
    mod = M.make_regression()
    opt = torch.optim.Adam(mod.parameters(), lr=0.01)
    bad = next(iter(regression_loader(bad_row=5)))
    with pyro.validation_enabled(False):
        rep, _ = fire(tmp_path, mod, opt, _cycle(regression_loader()), "make_regression",
                      bad={3: bad})
    assert origin(rep) == (3, "input", None, None, "input"), rep
    assert (rep["origin"]["tensor"], rep["origin"]["arg"], rep["origin"]["samples"]) == (
        "args[1]", "y", [5])


def test_nan_observation_pyro_refuses_is_the_batch(tmp_path):
    """Pyro's validation (on by default) refuses the NaN ``obs`` inside ``compute_log_prob``:
    a ValueError the recorder notes its bundle on, before the ELBO module returns."""
    mod = M.make_regression()
    opt = torch.optim.Adam(mod.parameters(), lr=0.01)
    bad = next(iter(regression_loader(bad_row=5)))
    rep, err = fire(tmp_path, mod, opt, _cycle(regression_loader()), "make_regression",
                    bad={3: bad}, raises=ValueError)
    assert "site 'obs'" in str(err)
    assert origin(rep) == (3, "input", None, None, "input"), rep
    assert (rep["origin"]["arg"], rep["origin"]["samples"]) == ("y", [5])
    ev = rep["event"]
    assert (ev["phase"], ev["tensor"], ev["samples"]) == ("input", "args[1]", [5]), ev
    assert ev["detail"] == "non-finite value in the model's input args[1]", ev


def test_poisson_rate_underflowed_to_zero(tmp_path):
    mod = M.make_count()
    opt = torch.optim.Adam(mod.parameters(), lr=0.01)
    x, y = M.count_data(8)
    x[2], y[2] = torch.tensor([-1200.0, 0.0, 0.0]), 1.0  # exp(-120): 0 in float32
    loader = DataLoader(TensorDataset(*M.count_data(8)), batch_size=8)
    rep, _ = fire(tmp_path, mod, opt, _cycle(loader), "make_count", bad={2: (x, y)})
    assert origin(rep) == (2, "backward", "", "XlogyBackward0", "underflow"), rep
    assert rep["origin"]["samples"] == [2], rep["origin"]
    assert "underflowed to 0" in rep["hint"]


def test_raw_guide_scale_stepped_below_zero(tmp_path):
    """A hand-written guide's scale learned without ``constraint=positive``: SGD takes it
    below 0 and the guide's ``Normal.log_prob`` takes its log (validation off, as users turn
    it off for speed)."""
    mod = M.make_scale(positive=False)
    opt = torch.optim.SGD(mod.parameters(), lr=0.05)
    x, _ = M.regression_data(8)
    loader = DataLoader(TensorDataset(x), batch_size=8)
    with pyro.validation_enabled(False):
        rep, err = fire(tmp_path, mod, opt, _cycle(loader), "make_scale",
                        steps=12, kwargs={"positive": False})
    assert origin(rep) == (6, "forward", "", "aten.log", "invalid"), rep
    assert "guide.scale" in rep["hint"], rep["hint"]
    # the op's line is Pyro's (it takes the log-probabilities after the model returned); the
    # report also names the line of the training code that called into Pyro
    o = rep["origin"]
    assert "/pyro/" in o["source"], o
    caller = source_line("pyro_svi_models.py", "self.elbo.differentiable_loss(")
    assert o["called_from"] == caller, o
    text = invoke_cli(err.bundle_path).stdout
    assert f"  source     {o['source']}" in text and f"(called from {caller})" in text, text


def test_learning_rate_too_large_for_the_noise_scale(tmp_path):
    mod = M.make_regression()
    opt = torch.optim.SGD(mod.parameters(), lr=5.0)
    rep, _ = fire(tmp_path, mod, opt, _cycle(regression_loader()), "make_regression")
    assert origin(rep) == (1, "forward", "model", "aten.exp", "overflow"), rep
    assert "model.sigma_unconstrained" in rep["hint"] and "learning rate" in rep["hint"]


def test_update_past_float32_is_the_optimizer_re_run_on_the_pyro_params(tmp_path):
    """SGD's update with a learning rate of 1e38 makes the guide's loc and the model's noise
    +inf; guarded, the replay re-runs that update on the bundle's copies (PyroModule reads its
    PyroParams through Pyro's global ParamStore, which holds the bundle's after the load)."""
    mod = M.make_regression()
    opt = torch.optim.SGD(mod.parameters(), lr=1e38)
    rep, _ = fire(tmp_path, mod, opt, _cycle(regression_loader()), "make_regression",
                  rec={"guard_optimizer": True})
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["op"], rep["cause"], rep["reproduced"]) == (
        0, "optimizer", "aten.add_", "optimizer", True), rep
    assert rep["event"]["params"] == ["model.sigma_unconstrained",
                                      "guide.locs.linear.weight_unconstrained"]


def test_vae_decoder_scale_rounded_to_zero_is_refused_and_named(tmp_path):
    mod = M.make_vae()
    with torch.no_grad():
        mod.vae.decoder[2].bias[6:] = -150.0  # softplus(-150) is 0 in float32
    opt = torch.optim.Adam(mod.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(M.vae_data(8)), batch_size=8)
    rep, err = fire(tmp_path, mod, opt, _cycle(loader), "make_vae", raises=ValueError)
    assert "Expected parameter scale" in str(err)
    assert origin(rep) == (0, "forward", "", "aten.softplus", "underflow"), rep
    assert rep["origin"]["source"] == source_line("pyro_svi_models.py", "scale = F.softplus(s)")
    assert rep["origin"]["samples"] == list(range(8))


def test_prior_too_tight_for_float32(tmp_path):
    mod = M.make_regression(prior_scale=1e-30, meanfield=True)
    opt = torch.optim.Adam(mod.parameters(), lr=0.01)
    rep, _ = fire(tmp_path, mod, opt, _cycle(regression_loader()), "make_regression",
                  kwargs={"prior_scale": 1e-30, "meanfield": True})
    assert origin(rep) == (0, "forward", "", "aten.div", "underflow"), rep


def test_pyro_optim_is_refused_in_one_line():
    mod = M.make_regression()
    with pytest.raises(TypeError) as info:
        FlightRecorder(mod, pyro.optim.Adam({"lr": 0.01}))
    msg = str(info.value)
    assert "\n" not in msg and "differentiable_loss" in msg and "torch.optim" in msg, msg

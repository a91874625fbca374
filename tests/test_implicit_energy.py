"""Energy-based models and implicit layers trained as their repositories train them
(``implicit_energy_models``): contrastive divergence with short-run Langevin dynamics inside
the step (every sampling step a forward of the energy network, differentiated w.r.t. its
input), denoising score matching over a sigma schedule, and a deep-equilibrium layer whose
fixed point is solved under no_grad and differentiated implicitly by a gradient hook. The
recorder on the loop, then ``nanreplay`` on the bundle."""

from __future__ import annotations

import json
from pathlib import Path

import implicit_energy_models as M
import pytest
import torch
from bundles import nanreplay_json

from recorder import FlightRecorder, NonFiniteError

HERE = Path(__file__).parent


@pytest.fixture(autouse=True)
def _from_tests_dir(monkeypatch):
    monkeypatch.chdir(HERE)  # where implicit_energy_models.py, the factory's module, lives


def train_ebm(out_dir: Path, steps: int = 2, k: int = 10, step_size: float = 0.01,
              prior: float = 0.0, clamp: bool = True, **langevin):
    """IGEBM's loop: negatives from the replay buffer, k Langevin steps (k forwards of the
    recorded model), then one forward of positives and negatives and the CD loss."""
    model = M.make_ebm(prior)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.0, 0.999))
    buf, g = M.ReplayBuffer(), torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    with FlightRecorder(model, opt, loss_fn=M.cd_loss, out_dir=out_dir,
                        factory="implicit_energy_models:make_ebm",
                        factory_kwargs={"prior": prior}) as rec:
        for _ in range(steps):
            x_pos = M.ebm_data(g)
            x_neg, idx = buf.sample(16)
            x_neg = M.langevin(model, x_neg, k, step_size, clamp=clamp, **langevin)
            buf.push(idx, x_neg)
            opt.zero_grad()
            e_pos, e_neg = model(torch.cat([x_pos, x_neg])).chunk(2)
            rec.loss_fn(e_pos, e_neg).backward()
            opt.step()


def _first_non_finite_sampler_input(k, step_size, prior, **langevin) -> int:
    """The first forward of step 0's sampler, run again without the recorder, whose input
    holds a NaN/Inf."""
    model = M.make_ebm(prior)
    finite = []
    model.register_forward_pre_hook(lambda m, a: finite.append(bool(a[0].isfinite().all())))
    buf, g = M.ReplayBuffer(), torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    M.ebm_data(g)
    M.langevin(model, buf.sample(16)[0], k, step_size, **langevin)
    return finite.index(False)


def test_a_diverging_langevin_chain_is_named_as_the_samplers_overflow(tmp_path):
    """A Gaussian base energy (curvature 20) sampled with step 1 and no clamp to the data
    range: each Langevin step multiplies the samples by 1 - 10 = -9, and the 42nd forward's
    batch overflows to ±inf (the recorder's event, micro-batch 41). The report named the
    43rd forward's batch, whose inf - inf is NaN ("every value of batch is NaN ... a division
    by a scalar that is 0"): a micro-batch after the event's, and the wrong story. Now the
    event's own batch, made by the loop's Langevin step from micro-batch 40's input, and the
    growth that overflowed."""
    with pytest.raises(NonFiniteError) as info:
        train_ebm(tmp_path, steps=1, k=60, step_size=1.0, prior=20.0, clamp=False)
    ev = info.value.event
    first = _first_non_finite_sampler_input(k=60, step_size=1.0, prior=20.0, clamp=False)
    assert (ev["step"], ev["phase"], ev["tensor"], ev["micro_batch"]) == (
        0, "input", "batch", first), (ev, first)
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["phase"], o["tensor"], o["micro_batch"], o["samples"]) == (
        "input", "input", "batch", ev["micro_batch"], list(range(16))), json.dumps(rep, indent=1)
    assert o["made"] in ("+inf", "-inf"), o
    hint = rep["hint"]
    assert f"from the input of micro-batch {ev['micro_batch'] - 1}" in hint, hint
    assert "x9 per forward" in hint and "overflowed float32" in hint, hint
    assert "Langevin" in hint and "division by a scalar" not in hint, hint

"""End to end on full-waveform inversion (``waveform_inversion_models``): a sigmoid-bounded
velocity model simulated by a finite-difference acoustic wave equation (conv2d Laplacian,
Cerjan sponge, Ricker source), fitted to shot gathers by L2, normalized cross-correlation,
envelope and standardised-trace misfits, with illumination preconditioning of the gradient.
Each planted bug of the domain fires under the recorder and is replayed with the CLI; the
healthy setup trains without an event, bit-identically with and without the recorder."""

from __future__ import annotations

import re

import pytest
import torch
import waveform_inversion_models as M
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

FACTORY = "waveform_inversion_models:"

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("waveform_inversion_models.py", text)


def train(out_dir, factory="make_fwi", loss_fn=None, obs_edit=None, mute=False, steps=2,
          precondition=False, eps=None, clip=None, record=True, amp=None):
    """Adam on the velocity model over the 8 shots in batches of 4 (a DataLoader), the mute
    mask passed into forward and applied to the observed traces too; ``precondition``:
    the gradient divided by the illumination between backward and step; ``amp``: the
    simulation run under CPU autocast of that type, the misfit outside it."""
    torch.manual_seed(0)
    model = getattr(M, factory)()
    src, obs = M.observed()
    if obs_edit is not None:
        obs = obs_edit(obs.clone())
    extra = (M.near_offset_mute(src),) if mute else ()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    loss_fn = loss_fn if loss_fn is not None else torch.nn.MSELoss()
    rec = FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir,
                         factory=FACTORY + factory) if record else None
    losses = []
    with rec if rec is not None else torch.enable_grad():
        for _ in range(steps):
            for s, o, *m in M.shot_loader(src, obs, *extra):
                mask = m[0] if m else None
                with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
                    pred = model(s, mask)
                loss = (rec.loss_fn if rec is not None else loss_fn)(
                    pred, o if mask is None else o * mask)
                opt.zero_grad()
                loss.backward()
                if precondition:
                    M.illumination_precondition(model, eps)
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                opt.step()
                losses.append(loss.item())
    return losses, model


def fire(tmp_path, code=0, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(tmp_path, **kw)
    return info.value.event, nanreplay_json(info.value.bundle_path, code=code)


def test_healthy_inversion_raises_nothing_and_trains_bit_identically(tmp_path):
    """Every misfit with its eps, the two-pass standardisation, a float32 illumination with a
    floor, a Tikhonov wrapper and gradient clipping: no event, no bundle, and the recorder
    changes neither the losses nor the velocity model."""
    for kw in ({"loss_fn": M.NCCLoss(eps=1e-12)},
               {"loss_fn": M.EnvelopeLoss(eps=1e-20), "mute": True},
               {"loss_fn": M.StandardisedTraceLoss(two_pass=True),
                "obs_edit": lambda o: o + 3e3}):
        train(tmp_path, **kw)
    model = M.make_fwi()
    a = train(tmp_path, loss_fn=M.Regularised(torch.nn.MSELoss(), model), precondition=True,
              eps=1e-3, clip=1.0)
    b = train(tmp_path, loss_fn=M.Regularised(torch.nn.MSELoss(), model), precondition=True,
              eps=1e-3, clip=1.0, record=False)
    assert a[0] == b[0] and torch.equal(a[1].theta, b[1].theta)
    assert not list(tmp_path.glob("*.nan"))


def test_a_dead_receiver_under_normalized_cross_correlation_names_its_trace(tmp_path):
    """Shot 5's receiver 10 recorded nothing (a dead geophone): NCC divides each observed
    trace by its norm, 0/0 there, in the second batch (row 1). The report named the div, the
    shot and 'add an eps'; now it also names the dead channel of the loss's target."""
    def dead(obs):
        obs[5, :, 10] = 0
        return obs
    ev, rep = fire(tmp_path, loss_fn=M.NCCLoss(), obs_edit=dead)
    assert (ev["step"], ev["phase"]) == (1, "loss")
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "invalid", "<loss>", "aten.div", "nan", [1]), rep
    assert o["source"] == line_of("on = obs / (obs.norm(dim=1, keepdim=True) + self.eps)"), o
    assert "channel(s) 10 (dim 2) of loss_args[1]" in rep["hint"] \
        and "dead receiver" in rep["hint"], rep["hint"]


def test_an_envelope_of_muted_traces_is_a_backward_only_nan_at_sqrt(tmp_path):
    """The envelope misfit's |analytic signal| written as sqrt(re² + im²): the muted
    near-offset traces are exactly 0, the forward is finite, sqrt's backward is 0/0 there in
    every shot. The report names SqrtBackward0 on the envelope line and the complex abs."""
    ev, rep = fire(tmp_path, loss_fn=M.EnvelopeLoss(), mute=True)
    assert (ev["step"], ev["phase"]) == (0, "backward")
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["phase"], o["module"], o["op"], o["samples"]) \
        == (True, "invalid", "backward", "<loss>", "SqrtBackward0", [0, 1, 2, 3]), rep
    assert o["source"] == line_of("return torch.sqrt(a.real ** 2 + a.imag ** 2 + eps)"), o
    assert "torch.complex(re, im).abs()" in rep["hint"], rep["hint"]


def test_a_dc_offset_shot_cancels_the_one_pass_variance_to_precision(tmp_path):
    """Shot 2 kept its recorder's DC offset (3000 on a signal of 0.1): E[d²] - E[d]² cancels
    below 0 in float32, sqrt is NaN on that shot alone; float64 keeps it positive."""
    def dc(obs):
        obs[2] += 3e3
        return obs
    ev, rep = fire(tmp_path, loss_fn=M.StandardisedTraceLoss(), obs_edit=dc)
    assert (ev["step"], ev["phase"]) == (0, "loss")
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "precision", "<loss>", "aten.sqrt", "nan", [2]), rep
    assert o["source"] == line_of("std = torch.sqrt((d * d).mean(1, keepdim=True) - m * m)"), o
    assert "E[x²] − E[x]²" in rep["hint"] and "torch.var" in rep["hint"], rep["hint"]


def test_a_time_step_above_the_cfl_limit_names_the_simulation_not_the_misfit(tmp_path):
    """dt = 5 ms (the field data's sample interval): v dt / dx = 1.3 > 1/√2, the wavefield
    grows about 5x a step, the traces reach 7.6e36 and mse_loss squares them past float32.
    The report said to rescale the loss's inputs (row max before exp) or use float64; now it
    says the model's output was already out of scale, first in ``prop``, and names the CFL
    bound."""
    ev, rep = fire(tmp_path, factory="make_fwi_field_dt_5ms")
    assert (ev["step"], ev["phase"]) == (0, "loss")
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "overflow", "<loss>", "aten.mse_loss", "+inf", [0, 1, 2, 3]), rep
    hint = rep["hint"]
    assert "the model's output it took already held values up to" in hint \
        and "prop's output (call 0) was the first to hold them" in hint \
        and "CFL" in hint, hint
    assert "row max" not in hint, hint


def test_a_time_step_far_above_the_cfl_limit_overflows_in_the_time_loop(tmp_path):
    """dt = 8 ms: the wavefield itself overflows in forward, first in the illumination's
    square of a snapshot; the report names that line in ``prop``, the loop's growth run
    after run, and the CFL limit among the remedies, saying once that a wider type only
    postpones it (the op's growth and the line's loop each said it)."""
    ev, rep = fire(tmp_path, factory="make_fwi_field_dt_8ms")
    assert (ev["step"], ev["phase"]) == (0, "forward")
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "overflow", "prop", "aten.pow", "+inf", [0, 1, 2, 3]), rep
    assert o["source"] == line_of("illum = illum + (snap ** 2).sum((0, 1)).float()"), o
    hint = rep["hint"]
    assert "loop running that line was diverging" in hint and "CFL" in hint, hint
    assert hint.count("which a wider type only postpones") == 1, hint  # (said once)
    assert any("run after run" in p for p in rep["problems"]), rep["problems"]


def test_an_illumination_of_float16_snapshots_names_the_preconditioner_divisor(tmp_path):
    """Snapshots kept in float16: the squares of the weak wavefield underflow to 0 in half the
    cells, and the loop's ``grad /= illum`` is 0/0 or x/0 there. The report said only that
    the loop wrote the gradients ('e.g. a division by a norm that is 0'); now it says the
    gradient was rescaled entry by entry with a divisor of 0 at those entries."""
    ev, rep = fire(tmp_path, code=1, factory="make_fwi_half_snapshots",
                   precondition=True)
    assert (ev["step"], ev["phase"]) == (0, "backward")
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["phase"], o["param"]) == (
        False, "not_reproduced", "backward", "theta"), rep
    hint = rep["hint"]
    assert "rescaled theta's gradient entry by entry" in hint \
        and "divisor is 0 there" in hint and "floor the divisor" in hint, hint


def test_a_float16_autocast_simulation_flushes_far_traces_to_zero_an_underflow(tmp_path):
    """The propagator run under float16 autocast to save time: conv2d's Laplacian is float16,
    the weak wavefield ahead of the front (1e-29 at the far receivers) flushes to 0, those
    traces are exactly 0 and NCC's trace / norm is 0/0 on shots 0 and 1. The float64 re-run
    holds -2.4e-29 there; the report said ``precision`` (cancellation: use torch.var) since
    the loss's own ops are float32. Now the forward's autocast type counts as a type the
    loss's inputs went through: ``underflow``, compute in float32 where the value is made."""
    ev, rep = fire(tmp_path, loss_fn=M.NCCLoss(), amp=torch.float16)
    assert (ev["step"], ev["phase"]) == (0, "loss")
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "underflow", "<loss>", "aten.div", "nan", [0, 1]), rep
    assert o["source"] == line_of("pn = pred / (pred.norm(dim=1, keepdim=True) + self.eps)"), o
    hint = rep["hint"]
    assert "below float16's smallest subnormal" in hint and "outside autocast" in hint, hint
    assert "cancellation" not in hint, hint


def test_an_unbounded_squared_slowness_stepped_below_zero_names_the_update(tmp_path):
    """The model as squared slowness m = 1/v², an unbounded parameter, with Adam's lr too
    large for its scale (1e-7 on values of 2e-7): at step 3 an update takes one cell below 0
    and rsqrt is NaN there, in every shot. The report names rsqrt at the root, the parameter
    and the update that crossed the edge, with the entry written as plain indices (it read
    ``m[tensor(6), tensor(8)]``)."""
    def run():
        torch.manual_seed(0)
        model = M.make_fwi_slowness()
        src, obs = M.observed()
        opt = torch.optim.Adam(model.parameters(), lr=1e-7)
        with FlightRecorder(model, opt, loss_fn=torch.nn.MSELoss(), out_dir=tmp_path,
                            factory=FACTORY + "make_fwi_slowness") as rec:
            for _ in range(3):
                for s, o in M.shot_loader(src, obs):
                    loss = rec.loss_fn(model(s), o)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
    with pytest.raises(NonFiniteError) as info:
        run()
    assert (info.value.event["step"], info.value.event["phase"]) == (3, "forward")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "invalid", "", "aten.rsqrt", "nan", [0, 1, 2, 3]), rep
    assert o["source"] == line_of("return self.m.rsqrt()"), o
    hint = rep["hint"]
    assert re.search(r"moved m\[\d+, \d+\] there from", hint) and "tensor(" not in hint, hint
    assert "a step of the optimizer crossed the domain's edge" in hint, hint

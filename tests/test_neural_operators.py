"""End to end on neural operators for PDEs (``neural_operators_models``): a 2-D Fourier Neural
Operator on Darcy flow (``rfftn``/``irfftn``, complex ``cfloat`` spectral weights on the lowest
modes) under neuraloperator's relative L2 loss (as a function and as its ``LpLoss`` callable
object), with a per grid point ``UnitGaussianNormalizer`` and a per-sample field norm, a
PINO-style total-variation physics term from finite differences of the output, autoregressive
rollout training with the pushforward trick under fp16/bf16 autocast from a DataLoader, and a
DeepONet with a normalised radial-basis trunk. Each planted failure of the domain fires under
the recorder and is replayed with the CLI; the healthy versions raise no event and train
bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import neural_operators_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("neural_operators_models.py", text)


def train(make: str, crit, out_dir, bad: dict | None = None, steps: int = 3,
          record: bool = True, deeponet: bool = False, adam: dict | None = None,
          y_normalizer=None, **rec_kw):
    """Adam with gradient clipping, as the FNO scripts train; the data condition ``bad``
    (keywords of ``darcy_batch``) is planted in the last step's batch; ``y_normalizer``
    encodes the targets in the loop."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), **(adam or {"lr": 1e-3}))
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"neural_operators_models:{make}", **rec_kw) if record else None
    forcing = make.startswith("make_fno_normalised")
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step in range(steps):
            planted = bad if bad and step == steps - 1 else {}
            *inputs, u = M.darcy_batch(g, forcing=forcing, deeponet=deeponet, **planted)
            if y_normalizer is not None:
                u = y_normalizer(u)
            if make == "make_fno_half":
                inputs, u = [x.half() for x in inputs], u.half()
            loss = loss_fn(model(*inputs), u)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    return model


def fire(make: str, crit, tmp_path, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(make, crit, tmp_path, **kw)
    return info.value.event, info.value.bundle_path


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("crit", [M.rel_l2, M.LpLoss()], ids=["function", "LpLoss"])
def test_sample_with_an_all_zero_solution_names_the_relative_l2_division(tmp_path, crit):
    """A failed solve the data generator wrote as all 0 (sample 5): ``||u_pred - u|| / ||u||``
    divides by 0. The replay names the division on the loss's line, sample 5, and the record
    as degenerate (drop it), not an eps. With neuraloperator's ``LpLoss``, a plain callable
    object, the loss was not re-run before ("cannot be imported by its name"): the bundle now
    describes such an instance by its class and attributes, and the replay rebuilds it."""
    ev, bundle = fire("make_fno", crit, tmp_path, bad={"zero_target": 5})
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (2, "loss", "<loss>", "+inf")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "<loss>", "aten.div", "+inf", [5]), o
    text = "return (diff / y_norm).mean()" if crit is M.rel_l2 else \
        "return torch.mean(diff_norms / y_norms)"
    assert o["source"] == line_of(text), o
    assert rep["cause"] == "invalid" and "degenerate" in rep["hint"], rep["hint"]
    assert not rep["problems"], rep["problems"]


def test_coefficient_file_with_a_nan_patch_names_the_input_sample(tmp_path):
    """A coefficient field with a NaN patch (sample 2): an input event naming that sample."""
    ev, bundle = fire("make_fno", M.rel_l2, tmp_path, bad={"nan_input": 2})
    assert (ev["step"], ev["phase"], ev["samples"]) == (2, "input", [2]), ev
    rep = nanreplay_json(bundle)
    assert (rep["cause"], rep["origin"]["samples"]) == ("input", [2]), rep["origin"]
    assert "data pipeline" in rep["hint"], rep["hint"]


def test_normaliser_with_eps_zero_over_a_constant_forcing_names_its_division(tmp_path):
    """Inputs ``[a, f]`` with the forcing ``f = 1`` everywhere: the per grid point normaliser
    fitted on the training set has std 0 in that channel, and ``eps = 0`` gives 0/0 in every
    sample at the first step. The replay names the division in ``normalizer`` and the zero
    eps."""
    ev, bundle = fire("make_fno_normalised", M.rel_l2, tmp_path)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "forward", "normalizer",
                                                                   "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "normalizer", "aten.div", "nan", list(range(8))), o
    assert o["source"] == line_of("return (x - self.mean) / (self.std + self.eps)"), o
    assert rep["cause"] == "invalid" and "eps added to that input is exactly 0" in rep["hint"]


def test_targets_normalised_with_eps_zero_name_the_boundary_positions_not_a_record(tmp_path):
    """The solutions standardised per grid point by the training set's statistics with
    ``eps = 0``: they are 0 on the Dirichlet boundary in every sample, so their std is 0 there
    and the encoded targets hold NaN on the boundary of every sample. The replay names the
    loss argument, those positions in every sample and a zero std of a value every sample
    shares (it said only 'every row holds NaN', a statistic of the batch, and called the
    targets a network's output or bad data)."""
    ev, bundle = fire("make_fno", torch.nn.MSELoss(), tmp_path,
                      y_normalizer=M.target_normalizer(eps=0.0))
    assert (ev["step"], ev["phase"], ev["tensor"]) == (0, "input", "loss_args[1]"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["cause"], o["tensor"], o["samples"]) == ("input", "loss_args[1]",
                                                          list(range(8))), o
    hint = rep["hint"]
    assert "in the same feature(s) of every sample (position(s) [0, 0], [0, 1]" in hint, hint
    assert "(+52) of each sample's (16, 16)) and nowhere else" in hint, hint
    assert "a Dirichlet boundary" in hint and "every row holds" not in hint, hint


def test_normaliser_fitted_on_a_nan_file_names_its_buffers(tmp_path):
    """The normaliser fitted on a training set one of whose coefficient files holds a NaN
    patch: its mean and std are NaN at those grid points from the start. The replay names the
    buffers as built so, not a sample of the batch."""
    ev, bundle = fire("make_fno_fitted_on_nan", M.rel_l2, tmp_path)
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "forward", "normalizer"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["cause"], o["phase"], o["module"], o["tensor"]) == (
        "weights", "weights", "normalizer", "buffer"), o
    assert "normalizer.mean, normalizer.std non-finite" in rep["hint"], rep["hint"]
    assert "a NaN record among those it averages" in rep["hint"], rep["hint"]


def test_pure_fp16_training_with_adams_default_eps_names_the_eps_lost_in_float16(tmp_path):
    """``model.half()`` with Adam's default ``eps = 1e-8``, which is 0 in float16: an element
    whose gradient squared rounds to 0 is updated by 0/0. The replay names Adam's update of
    ``lift.weight`` and the eps lost in the weights' type."""
    ev, bundle = fire("make_fno_half", M.rel_l2, tmp_path, guard_optimizer=True)
    assert (ev["step"], ev["phase"]) == (0, "optimizer"), ev
    rep = nanreplay_json(bundle)
    assert (rep["reproduced"], rep["cause"]) == (True, "optimizer"), rep["origin"]
    assert "lift.weight" in rep["hint"] and "eps=1e-08 is 0 in float16" in rep["hint"]


def test_adam_with_eps_zero_names_the_spectral_weights_dc_mode(tmp_path):
    """Adam with ``eps = 0``: the imaginary part of the spectral weight on the (0, 0) mode gets
    a gradient of exactly 0 (``irfftn`` drops the imaginary part of the DC bin), so its update
    is 0/0. The replay names Adam's ``addcdiv_`` in ``spectral.0.weights1`` and the eps."""
    ev, bundle = fire("make_fno", M.rel_l2, tmp_path, adam={"lr": 1e-3, "eps": 0.0},
                      guard_optimizer=True)
    assert (ev["step"], ev["phase"]) == (0, "optimizer"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["op"], o["made"]) == (True, "aten.addcdiv_", "nan"), o
    assert rep["cause"] == "optimizer" and "spectral.0.weights1" in rep["hint"], rep["hint"]
    assert "set eps > 0" in rep["hint"], rep["hint"]


def test_one_pass_variance_of_an_offset_field_names_the_cancellation(tmp_path):
    """A field far from 0 (an offset of 3e4, a temperature in the wrong reference): the field
    norm's ``E[x^2] - E[x]^2`` rounds below 0 in some samples and the sqrt is NaN. The replay
    names the sqrt in ``field_norm``, those samples, and precision (a stable variance)."""
    ev, bundle = fire("make_fno_field_norm", M.rel_l2, tmp_path, bad={"offset": 3e4})
    assert (ev["step"], ev["phase"], ev["module"]) == (2, "forward", "field_norm"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "field_norm", "aten.sqrt", "nan", [0, 1, 4, 5, 6]), o
    assert o["source"] == line_of("return (x - mean) / torch.sqrt(var)"), o
    assert rep["cause"] == "precision" and "torch.var" in rep["hint"], rep["hint"]


def test_total_variation_term_with_eps_zero_names_the_sqrt_backward(tmp_path):
    """The PINO loss's ``sqrt(u_x^2 + u_y^2 + eps)`` with ``eps = 0`` over a ReLU'd output that
    is flat (0) in places: a finite forward, and sqrt's derivative infinite there. The replay
    names ``SqrtBackward0`` in the loss on its line and the zero eps."""
    ev, bundle = fire("make_fno_positive", M.PINOLoss(eps=0.0), tmp_path)
    assert (ev["step"], ev["phase"]) == (0, "backward"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"]) == (
        True, "<loss>", "SqrtBackward0", "+inf"), o
    assert o["source"] == line_of("tv = torch.sqrt(ux ** 2 + uy ** 2 + self.eps).mean()"), o
    assert rep["cause"] == "invalid" and "exactly 0" in rep["hint"], rep["hint"]


def test_deeponet_queries_in_grid_units_underflow_the_rbf_trunk(tmp_path):
    """Sample 3's query points in grid units (0..15) rather than the unit square: every
    Gaussian of the trunk's normalised radial basis underflows and ``phi / phi.sum()`` is 0/0.
    The replay names the division, sample 3, underflow, and that sample's data out of scale."""
    ev, bundle = fire("make_deeponet", torch.nn.MSELoss(), tmp_path, deeponet=True,
                      bad={"far_query": 3})
    assert (ev["step"], ev["phase"], ev["samples"]) == (2, "forward", [3]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.div", "nan", [3]), o
    assert o["source"] == line_of("phi = phi / phi.sum(-1, keepdim=True)"), o
    assert rep["cause"] == "underflow" and "out of scale" in rep["hint"], rep["hint"]


def test_deeponet_shared_query_grid_in_grid_units_names_its_rows_out_of_scale(tmp_path):
    """One query grid ``(P, 2)`` for the whole batch, its point 3 in grid units: every
    sample's output is NaN, and the replay names underflow and row 3 of the grid as out of
    scale, an input beside the batch to fix where it is made (it named only the rows, in a
    note, and gave the hand-written softmax's advice alone)."""
    ev, bundle = fire("make_deeponet", torch.nn.MSELoss(), tmp_path, deeponet=True,
                      bad={"far_query": 3, "shared_grid": True})
    assert (ev["step"], ev["phase"], ev["samples"]) == (2, "forward", list(range(8))), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["made"], o["input_rows"]) == (
        "aten.div", "nan", {"tensor": "args[1]", "rows": [3]}), o
    assert o["source"] == line_of("phi = phi / phi.sum(-1, keepdim=True)"), o
    hint = rep["hint"]
    assert rep["cause"] == "underflow" and "row(s) 3 of args[1], an input beside" in hint, hint
    assert "out of scale" in hint and "fix them where args[1] is made" in hint, hint


def rollout(out_dir, pascal: int | None = None, amp=torch.float16, record: bool = True):
    """Autoregressive training with the pushforward trick: one step unrolled without gradient,
    the next trained against the trajectory two steps on, under autocast; AdamW."""
    model = M.make_fno()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
    loader = torch.utils.data.DataLoader(M.Trajectories(pascal=pascal), batch_size=4,
                                         shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    rec = FlightRecorder(model, opt, loss_fn=M.rel_l2, out_dir=out_dir,
                         factory="neural_operators_models:make_fno") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else M.rel_l2
        for traj in loader:
            with torch.autocast("cpu", dtype=amp):
                with torch.no_grad():
                    u = model(traj[:, 0].unsqueeze(-1))
                pred = model(u.unsqueeze(-1))
            loss = loss_fn(pred.float(), traj[:, 2])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model


def test_trajectory_in_pascal_overflows_the_fp16_lift_in_the_pushforward(tmp_path):
    """One trajectory stored in Pa (about 1e5) among normalised ones: under fp16 autocast the
    lift's cast of its input overflows in the pushforward call. The replay names the cast in
    ``lift``, that trajectory's row, overflow, and its data out of scale (a wrong unit)."""
    with pytest.raises(NonFiniteError) as info:
        rollout(tmp_path, pascal=5)
    first = next(iter(torch.utils.data.DataLoader(
        M.Trajectories(pascal=5), batch_size=4, shuffle=True,
        generator=torch.Generator().manual_seed(0))))
    row = int(first[:, 0].abs().amax((1, 2)).argmax())
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (0, "forward", "lift",
                                                                      [row]), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"], o["call"]) == (
        True, "lift", "aten._to_copy", "+inf", [row], 0), o
    assert rep["cause"] == "overflow" and "a wrong unit" in rep["hint"], rep["hint"]


def test_zero_solution_in_the_second_accumulated_batch_names_its_micro_batch(tmp_path):
    """bf16 autocast and two accumulated batches per update: the all-zero solution at row 6
    of the second batch of the second update. The replay names micro-batch 1, the division
    of the relative L2 and row 6."""
    model = M.make_fno()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.rel_l2, out_dir=tmp_path,
                            factory="neural_operators_models:make_fno") as rec:
            for i in range(4):
                x, u = M.darcy_batch(g, zero_target=6 if i == 3 else None)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    pred = model(x)
                (rec.loss_fn(pred.float(), u) / 2).backward()
                if i % 2 == 1:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                    opt.zero_grad()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["micro_batch"]) == (1, "loss", 1), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["micro_batch"], o["op"], o["made"], o["samples"]) == (1, "aten.div", "+inf",
                                                                    [6]), o
    assert o["source"] == line_of("return (diff / y_norm).mean()"), o
    assert rep["cause"] == "invalid" and "degenerate" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("amp", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_healthy_rollout_raises_nothing_and_trains_the_same(tmp_path, amp):
    recorded = rollout(tmp_path, amp=amp)
    plain = rollout(tmp_path, amp=amp, record=False)
    assert not list(tmp_path.glob("*.nan"))
    same_weights(recorded, plain)


@pytest.mark.parametrize("make,crit,deeponet,kw", [
    ("make_fno", M.rel_l2, False, {}), ("make_fno_normalised_eps", M.LpLoss(), False, {}),
    ("make_fno_positive", M.PINOLoss(), False, {}),
    ("make_fno", torch.nn.MSELoss(), False, {"y_normalizer": M.target_normalizer()}),
    ("make_fno_half", M.rel_l2, False, {"adam": {"lr": 1e-3, "eps": 1e-4}}),
    ("make_deeponet", torch.nn.MSELoss(), True, {})],
    ids=["fno", "normalised", "pino", "target-normaliser", "fp16", "deeponet"])
def test_healthy_training_raises_nothing_and_trains_the_same(tmp_path, make, crit, deeponet,
                                                             kw):
    """The same models with the eps in place and clean data: no event, and the weights are
    bit-identical with and without the recorder."""
    recorded = train(make, crit, tmp_path, deeponet=deeponet, **kw)
    plain = train(make, crit, tmp_path, deeponet=deeponet, record=False, **kw)
    assert not list(tmp_path.glob("*.nan"))
    same_weights(recorded, plain)

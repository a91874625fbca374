"""Energy-based models and implicit layers trained as their repositories train them
(``implicit_energy_models``): contrastive divergence with short-run Langevin dynamics inside
the step (every sampling step a forward of the energy network, differentiated w.r.t. its
input, or one tensor stepped in place through ``.data``), and a deep-equilibrium layer whose
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

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def train_ebm(out_dir: Path, steps: int = 2, k: int = 10, step_size: float = 0.01,
              clamp: bool = True, restart: tuple[int, int] | None = None, **kw):
    """IGEBM's loop: negatives from the replay buffer, k Langevin steps (k forwards of the
    recorded model), then one forward of positives and negatives and the CD loss. ``kw``:
    the model's; ``restart``: (step, row) of a chain the buffer restarted from zeros."""
    model = M.make_ebm(**kw)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.0, 0.999))
    buf, g = M.ReplayBuffer(), torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    with FlightRecorder(model, opt, loss_fn=M.cd_loss, out_dir=out_dir,
                        factory="implicit_energy_models:make_ebm", factory_kwargs=kw) as rec:
        for step in range(steps):
            x_pos = M.ebm_data(g)
            x_neg, idx = buf.sample(16)
            if restart is not None and step == restart[0]:
                x_neg[restart[1]] = 0.0
            x_neg = M.langevin(model, x_neg, k, step_size, clamp=clamp)
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
        train_ebm(tmp_path, steps=1, k=60, step_size=1.0, clamp=False, prior=20.0)
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


def train_deq(out_dir: Path, steps: int = 2, blank: tuple[int, int] | None = None, **kw):
    """A DEQ classifier; ``blank``: (step, row) of a record of zeros."""
    model = M.make_deq(**kw)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    crit, g = torch.nn.CrossEntropyLoss(), torch.Generator().manual_seed(1)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                        factory="implicit_energy_models:make_deq", factory_kwargs=kw):
        for step in range(steps):
            x, y = M.deq_data(g)
            if blank is not None and step == blank[0]:
                x[blank[1]] = 0.0
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()


def test_anderson_without_its_ridge_is_named_at_the_singular_solve_of_the_blank_record(
        tmp_path):
    """Pins the linalg path for a solve inside a no_grad fixed-point solver: Anderson
    acceleration with lam = 0, and a record of zeros (row 5 of step 1), for which z = 0 is
    the exact fixed point: its residuals are all 0, its Gram matrix too, and the batched
    torch.linalg.solve raises for that batch element. Named at aten._linalg_solve_ex in the
    root's forward, on that sample, invalid as float64 makes it singular too, with the ridge
    as the fix."""
    with pytest.raises(torch.linalg.LinAlgError):
        train_deq(tmp_path, blank=(1, 5), lam=0.0)
    [bundle] = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["event"]["step"], rep["cause"], o["phase"], o["module"], o["op"], o["made"],
            o["samples"]) == (1, "invalid", "forward", "", "aten._linalg_solve_ex",
                              "LinAlgError", [5]), json.dumps(rep, indent=1)
    assert "eps * I" in rep["hint"], rep["hint"]


def test_a_diverging_implicit_backward_is_named_as_the_hooks_diverging_iteration(tmp_path):
    """An expansive cell (W scaled by 3, a weak input injection): the forward's Anderson solve
    settles near an unstable fixed point, where the spectral radius of ∂f/∂z is about 2, so
    the backward hook's iteration g = Jᵀg + grad grows twofold per iteration and overflows
    after ~110 of its 120. The hook and its aten.mm were named, but the cause said to rescale
    the inputs or compute in float64; now it says the calls grew call after call, a
    diverging fixed-point iteration, and what makes it converge."""
    kw = {"scale": 3.0, "inj": 0.01, "b_iter": 120}
    with pytest.raises(NonFiniteError) as info:
        train_deq(tmp_path, **kw)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["params"]) == (0, "backward", ["f.W.weight",
                                                                       "f.U.weight"]), ev
    # the rows of the gradient the hook hands on that are non-finite, without the recorder
    model, seen = M.make_deq(**kw), []
    model.head.register_forward_pre_hook(lambda m, a: [a[0].register_hook(seen.append)] and None)
    x, y = M.deq_data(torch.Generator().manual_seed(1))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    rows = (~seen[0].isfinite()).any(1).nonzero().flatten().tolist()
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["phase"], o["module"], o["op"], o["node"], o["samples"]) == (
        "overflow", "backward", "f", "aten.mm", "a gradient hook", rows), json.dumps(rep, indent=1)
    src = M.DEQ.forward.__code__
    assert o["source"] == f"implicit_energy_models.py:{_line(src, 'torch.autograd.grad')}", o
    hint = rep["hint"]
    assert "earlier calls here grew" in hint and "spectral radius" in hint, hint


def _line(code, text: str) -> int:
    """The line of ``code``'s function holding ``text``."""
    import inspect
    lines, first = inspect.getsourcelines(code)
    return first + next(i for i, s in enumerate(lines) if text in s)


def test_a_nan_input_gradient_of_the_sampler_is_named_at_the_models_backward_node(tmp_path):
    """A Laplace base measure, + 0.5 * sqrt(‖x‖²), and a chain the buffer restarted from
    zeros (row 3 of step 1): the energy is finite at x = 0, but its gradient x / ‖x‖ is
    0/0, so the Langevin step feeds the next forward a NaN row (an input event, micro-batch
    1). The report said the loop's step "made the NaN/Inf", although the update's arithmetic
    only carried on the gradient the model's backward made. Now the re-run backpropagates
    micro-batch 0's recorded output gradient into its input, which required grad, and names
    SqrtBackward0 there, on row 3, invalid (a pole)."""
    with pytest.raises(NonFiniteError) as info:
        train_ebm(tmp_path, restart=(1, 3), laplace=0.5)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["micro_batch"], ev["samples"]) == (1, "input", 1, [3])
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["phase"], o["module"], o["op"], o["micro_batch"],
            o["samples"]) == (True, "invalid", "backward", "", "SqrtBackward0", 0, [3]), \
        json.dumps(rep, indent=1)
    assert o["source"] == f"implicit_energy_models.py:{_line(M.EnergyMLP.forward, 'sqrt()')}"
    notes = " ".join(rep["problems"])
    assert "the model's backward made that gradient non-finite" in notes, notes


@pytest.mark.parametrize("step", [0, 1])
def test_a_nan_gradient_of_jems_in_place_sgld_is_named_or_said_unreplayable(tmp_path, step):
    """JEM's SGLD steps one tensor in place (x.data += ...), the Laplace energy's gradient at
    a chain restarted from zeros (row 3) is 0/0, and the next forward's batch holds a NaN
    row (an input event, micro-batch 1). In step 0 the bundle holds the stepped tensor as
    its last write left it (the recorder sees it taken again only at micro-batch 1): the
    report said the batch itself holds NaN ("check the data pipeline"); now it says the loop
    stepped that tensor in place and the gradient cannot be re-run. From step 1 on the
    recorder holds copies, and the replay names SqrtBackward0 in micro-batch 0, row 3."""
    model = M.make_ebm(laplace=0.5)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.0, 0.999))
    buf, g = M.ReplayBuffer(), torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.cd_loss, out_dir=tmp_path,
                            factory="implicit_energy_models:make_ebm",
                            factory_kwargs={"laplace": 0.5}) as rec:
            for k in range(2):
                x_pos, (x_neg, idx) = M.ebm_data(g), buf.sample(16)
                if k == step:
                    x_neg[3] = 0.0
                x_neg = M.sample_jem(model, x_neg, step_size=0.01)
                buf.push(idx, x_neg)
                opt.zero_grad()
                e_pos, e_neg = model(torch.cat([x_pos, x_neg])).chunk(2)
                rec.loss_fn(e_pos, e_neg).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["micro_batch"], ev["samples"]) == (step, "input", 1, [3])
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    if step == 0:
        assert (rep["cause"], o["phase"], o["micro_batch"], o["samples"]) == (
            "input", "input", 1, [3]), json.dumps(rep, indent=1)
        assert "the loop stepped that very tensor in place" in rep["hint"], rep["hint"]
    else:
        assert (rep["cause"], o["phase"], o["module"], o["op"], o["micro_batch"],
                o["samples"]) == ("invalid", "backward", "", "SqrtBackward0", 0, [3]), \
            json.dumps(rep, indent=1)


def train_in_place(out_dir: Path, at: tuple[str, int, int]):
    """The tutorial's loop: its sampler steps one tensor in place through ``.data`` over 20
    forwards (no version counter moves), then one training forward. ``at``: (``"pos"`` or
    ``"neg"``, step, row) of a constant record (0/0 in the energy's standardisation), among
    the positives or in the buffer (a sample of 5.0 clamped to the data range, all 1.0)."""
    model = M.make_ebm(standardise=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.0, 0.999))
    buf, g = M.ReplayBuffer(), torch.Generator().manual_seed(1)
    with FlightRecorder(model, opt, loss_fn=M.cd_loss, out_dir=out_dir,
                        factory="implicit_energy_models:make_ebm",
                        factory_kwargs={"standardise": True}) as rec:
        for step in range(2):
            x_pos, x_neg = M.ebm_data(g), buf.sample(16)[0]
            if step == at[1]:
                (x_pos if at[0] == "pos" else x_neg)[at[2]] = 0.5 if at[0] == "pos" else 5.0
            x_neg = M.sample_in_place(model, x_neg)
            e_pos, e_neg = model(torch.cat([x_pos, x_neg])).chunk(2)
            opt.zero_grad()
            rec.loss_fn(e_pos, e_neg).backward()
            opt.step()


def test_a_sampler_writing_through_data_leaves_the_event_forward_replayable(tmp_path):
    """A constant record among the positives of step 0 (row 3 of the training forward,
    micro-batch 20). The sampler's first forward holds the tensor it steps in place, so the
    bundle had its last values there: the fidelity check failed at micro-batch 0 and blamed
    the factory ("builds a different model"), cause unknown. Now the recorder marks that
    forward (its input taken again by the next) and copies the inputs from then on, and the
    replay re-runs from the event's forward, names aten.div on row 3 and says why micro-batch
    0 differs."""
    with pytest.raises(NonFiniteError) as info:
        train_in_place(tmp_path, ("pos", 0, 3))
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["micro_batch"], ev["samples"]) == (0, "forward", 20, [3])
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["micro_batch"],
            o["samples"]) == (True, "invalid", "", "aten.div", 20, [3]), json.dumps(rep, indent=1)
    notes = " ".join(rep["problems"])
    assert "micro-batch 0 differs in the re-run" in notes, notes
    assert "without moving its version counter" in notes, notes


@pytest.mark.parametrize("step", [0, 1])
def test_a_nan_the_in_place_sampler_carried_on_is_not_blamed_on_the_data(tmp_path, step):
    """A buffer sample clamped to all 1.0 (row 5): the sampler's first forward makes 0/0.
    The loop's in-place steps carried the NaN into the very tensor the bundle held for that
    forward, and the report blamed the data ("the batch itself holds NaN/Inf"). Now: in step
    0, where the recorder first sees the tensor taken again, the event is reported as
    recorded and the hint says the sampler's in-place step carried the NaN; in step 1 the
    recorder held a copy, and the replay names aten.div on row 5."""
    with pytest.raises(NonFiniteError) as info:
        train_in_place(tmp_path, ("neg", step, 5))
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["micro_batch"], ev["samples"]) == (step, "forward", 0, [5])
    rep = nanreplay_json(info.value.bundle_path, code=None)
    o = rep["origin"]
    if step == 0:
        assert (rep["not_rerun"], rep["cause"], o["phase"], o["module"], o["samples"]) == (
            "input written after the forward", None, "forward", "", [5]), rep
        assert "stepped in place through .data" in rep["hint"], rep["hint"]
    else:
        assert (rep["reproduced"], rep["cause"], o["phase"], o["module"], o["op"],
                o["micro_batch"], o["samples"]) == (
            True, "invalid", "forward", "", "aten.div", 0, [5]), json.dumps(rep, indent=1)
        assert rep["fidelity"]["matches"] is True, rep["fidelity"]


@pytest.mark.parametrize("f_iter", [100, 60])
def test_a_diverging_fixed_point_solve_is_named_as_diverging_iterates(tmp_path, f_iter):
    """A ReLU cell with W scaled by 10 (no weight normalisation): the naive forward solve from
    z = 0 grows about threefold per iteration. With 100 iterations f.W's 84th call overflows
    in the forward; with 60 the forward stays finite and the weight gradient g zᵀ overflows
    in backward. The overflow was named, but not that f.W's calls had been diverging: the
    check measured growth from the first call, whose output (W·0) is 0. And the backward
    origin named "samples" [3, 4, 15]: rows of linear's 16 x 16 weight gradient, through
    its TBackward0, read as samples because the hidden size equals the batch size."""
    kw = {"scale": 10.0, "solver": "naive", "act": "relu", "f_iter": f_iter}
    with pytest.raises(NonFiniteError) as info:
        train_deq(tmp_path, **kw)
    # f.W's calls without the recorder: the first non-finite one and its rows
    model, outs = M.make_deq(**kw), []
    model.f.W.register_forward_hook(lambda m, a, out: outs.append(out.detach().clone()))
    model(M.deq_data(torch.Generator().manual_seed(1))[0])
    bad = [i for i, o in enumerate(outs) if not o.isfinite().all()]
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    if bad:  # (the forward overflowed)
        rows = (~outs[bad[0]].isfinite()).any(1).nonzero().flatten().tolist()
        assert (rep["cause"], o["phase"], o["module"], o["call"], o["op"], o["samples"]) == (
            "overflow", "forward", "f.W", bad[0], "aten.mm", rows), json.dumps(rep, indent=1)
    else:
        assert f_iter == 60 and info.value.event["phase"] == "backward"
        assert (rep["cause"], o["phase"], o["module"], o["op"], o["samples"]) == (
            "overflow", "backward", "f.W", "MmBackward0", []), json.dumps(rep, indent=1)
    assert "the iterates of f.W were diverging" in rep["hint"], rep["hint"]
    notes = " ".join(rep["problems"])
    assert "f.W's output grew from" in notes and "fixed-point solver" in notes, notes


def test_points_a_loss_differentiates_by_are_not_copied_when_a_second_forward_takes_them(
        tmp_path):
    """The guard of the copies a sampler's in-place chain turns on: a PINN runs its
    collocation points (requiring grad) through two forwards of a step, the first one's loss
    differentiating by them. Copying the second forward's input (as for a sampler) cut the
    loss's points from the bundled inputs: 'features' did not run in the re-run and the
    factory was blamed. The points the loss took are not copied, and the replay names
    SqrtBackward0 at the origin of the grid (row 24)."""
    import sciml_models as SM
    model = SM.make_model()
    opt, g = torch.optim.Adam(model.parameters(), lr=1e-3), torch.Generator().manual_seed(1)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=SM.pde_residual_loss, out_dir=tmp_path,
                            factory="sciml_models:make_model") as rec:
            for step in range(6):
                xy = SM.collocation(step, g, 3)
                opt.zero_grad()
                (rec.loss_fn(model(xy), xy) + 0.0 * model(xy).pow(2).mean()).backward()
                opt.step()
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["module"], o["op"], o["samples"]) == (
        True, "loss", "features", "SqrtBackward0", [24]), json.dumps(rep, indent=1)

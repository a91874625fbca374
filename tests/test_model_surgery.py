"""End to end: training loops that change the model or its optimizer while they train
(``model_surgery_models``): global magnitude pruning with ``torch.nn.utils.prune`` mid-run,
lottery-ticket rewinding, ``prune.remove``, RigL's drop-and-regrow under ``no_grad`` between
``backward()`` and ``step()``, dead ReLU units re-initialised in place, layers unfrozen into
a new parameter group, weight-norm and orthogonal parametrizations. Healthy runs raise no
event and train bit-identically with and without the recorder; planted bugs are named with
their step, parameter (under its name after pruning: ``weight_orig``), rows and cause."""

from __future__ import annotations

import model_surgery_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch import nn
from torch.nn.utils import prune

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle
from recorder.target import REPLACED_WARNING

pytestmark = pytest.mark.usefixtures("in_tests_dir")

MODELS = "model_surgery_models.py"
FACTORY = "model_surgery_models:make_mlp"


def _healthy(kind: str, record: bool, out_dir) -> dict[str, torch.Tensor]:
    """Train a loop of ``kind`` (with the recorder when ``record``); the final weights."""
    model = M.make_paramnet() if kind == "parametrized" else M.make_mlp()
    crit = nn.CrossEntropyLoss()
    if kind == "unfreeze":  # a pretrained body frozen, the head trained first
        model.fc1.requires_grad_(False)
        model.fc2.requires_grad_(False)
        opt = torch.optim.AdamW(model.fc3.parameters(), lr=1e-2)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 5, 0.5)
    mask = torch.ones_like(model.fc2.weight) if kind == "rigl" else None
    acts: dict[str, torch.Tensor] = {}
    if kind == "rigl":
        model.fc1.register_forward_hook(lambda m, i, o: acts.__setitem__("fc1", o.detach()))
    early = None
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, factory=FACTORY,
                         rewind=4, guard_optimizer=kind in ("prune", "rigl")) \
        if record else None
    if rec is not None:
        rec.attach()
    for step, (x, y) in enumerate(M.batches(14)):
        if kind == "prune":
            if step == 1:
                early = {n: p.detach().clone() for n, p in model.named_parameters()}
            if step == 4:  # prune half the weights, rewind the survivors to step 1
                M.global_magnitude_prune(model, 0.5)
                M.rewind(model, early)
            if step == 10:
                M.make_permanent(model)
        if kind == "unfreeze" and step in (4, 8):
            layer = model.fc2 if step == 4 else model.fc1
            layer.requires_grad_(True)
            opt.add_param_group({"params": layer.parameters(), "lr": 1e-3})
        opt.zero_grad()
        crit(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if kind == "rigl" and step % 4 == 3:
            M.rigl_update(model.fc2, mask, opt, 0.2)
        elif kind == "rigl":
            model.fc2.weight.grad.mul_(mask)
        opt.step()
        sched.step()
        if kind == "rigl" and step % 5 == 4:  # units killed by a bad step, re-initialised
            with torch.no_grad():
                model.fc1.bias[:3] = -50.0
                model(x)
            assert M.reinit_dead(model.fc1, model.fc2, acts["fc1"]) == 3
    if rec is not None:
        rec.detach()
        assert rec.event is None and rec.bundle_path is None
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["prune", "rigl", "unfreeze", "parametrized"])
def test_surgery_without_a_bug_raises_no_event_and_trains_bit_identically(tmp_path, kind):
    """Weights written outside ``optimizer.step()`` on purpose (a pruning mask, a rewind, a
    regrowth, a re-init), parameters renamed (``weight_orig``) and groups added mid-run are
    no event, and the recorder changes no weight."""
    plain = _healthy(kind, False, tmp_path)
    recorded = _healthy(kind, True, tmp_path)
    assert list(plain) == list(recorded)
    assert all(torch.equal(plain[n], recorded[n]) for n in plain)
    assert not list(tmp_path.glob("*.nan"))


def _rigl(out_dir, pruned: bool, guard: bool, rewind: int | None = None, at: int = 3):
    """A sparse fc2 (10% dense) trained with RigL's drop-and-regrow every 4 steps from step
    ``at``: a row whose every surviving weight is dropped gives its regrown entries the
    scale 0/0 (NaN), written between backward() and step(). ``pruned``: the mask is
    ``torch.nn.utils.prune``'s (global pruning at step 1), the trained tensor ``weight_orig``."""
    model = M.make_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    crit = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(1)
    mask = (torch.rand(32, 32, generator=g) < 0.1).float()
    if not pruned:
        with torch.no_grad():
            model.fc2.weight.mul_(mask)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, factory=FACTORY,
                            guard_optimizer=guard, rewind=rewind):
            for step, (x, y) in enumerate(M.batches(20)):
                if pruned and step == 1:
                    M.global_magnitude_prune(model, 0.9)
                opt.zero_grad()
                crit(model(x), y).backward()
                if step % 4 == at % 4 and step >= at:
                    if pruned:
                        M.rigl_update_pruned(model.fc2, opt, 0.5)
                    else:
                        M.rigl_update(model.fc2, mask, opt, 0.5)
                elif not pruned:
                    model.fc2.weight.grad.mul_(mask)
                opt.step()
                if not pruned:
                    with torch.no_grad():
                        model.fc2.weight.mul_(mask)
    name = "fc2.weight_orig" if pruned else "fc2.weight"
    w = dict(model.named_parameters())[name]
    rows = torch.isnan(w).any(1).nonzero().flatten().tolist()
    assert rows  # (the planted 0/0 fired)
    return info.value, name, rows


@pytest.mark.parametrize("pruned", [False, True], ids=["own-mask", "torch-prune"])
def test_rigl_regrowth_nan_is_the_loops_write_not_the_update(tmp_path, pruned):
    """The recorder checks an update's weights at the next step, whose forward and backward
    ran on the NaN: the bundle's gradients are NaN there too. The report was 'optimizer —
    finite gradients became non-finite weights in optimizer.step(): check the learning rate',
    not reproduced: Adam's finite state after the update and the ring's finite gradient norm
    of that step show the weight was NaN before it."""
    err, name, rows = _rigl(tmp_path, pruned, guard=False)
    assert (err.event["step"], err.event["phase"], err.event["params"]) == (3, "optimizer", [name])
    rep = nanreplay_json(err.bundle_path, code=1)
    o = rep["origin"]
    assert (rep["cause"], rep["reproduced"], o["phase"], o["param"]) == \
        ("weights", False, "weights", name)
    assert o["rows"] == rows and o["rows_of"] == 32
    assert f"{name} was NaN in rows {rows[:8]} before the update at step 3" in rep["hint"]
    assert "between backward() and optimizer.step()" in rep["hint"]
    assert any("the bundle's gradients are of a later step" in p for p in rep["problems"])


@pytest.mark.parametrize("pruned", [False, True], ids=["own-mask", "torch-prune"])
def test_guarded_rigl_regrowth_is_a_weights_event_written_before_the_update(tmp_path, pruned):
    """With guard_optimizer=True the recorder said 'optimizer.step() made 1 parameter(s)
    non-finite' though its own pre-update copy held the NaN, and the replay re-ran the forward
    on that copy: 'read by aten.addmm in fc2 ... the weights were already non-finite when the
    step began', all 16 samples, for a step whose forward had run on finite weights."""
    err, name, rows = _rigl(tmp_path, pruned, guard=True)
    ev = err.event
    assert (ev["step"], ev["phase"], ev["params"], ev["before_update"]) == \
        (3, "weights", [name], True)
    assert ev["written_after_forward"] == [name]
    rep = nanreplay_json(err.bundle_path, code=1)
    o = rep["origin"]
    assert (rep["cause"], rep["reproduced"], rep["not_rerun"]) == \
        ("weights", False, "weights written after its forward")
    assert (o["param"], o["rows"], o["op"], o["module"], o["samples"]) == \
        (name, rows, None, None, [])
    assert "between step 3's backward() and its optimizer.step()" in rep["hint"]
    assert not any("SAM" in p for p in rep["problems"])  # (no forward ran on the write)


def test_the_rewind_copy_of_a_pruned_weight_is_bundled_under_its_name_now(tmp_path):
    """The window's copy (taken at step 6, after ``prune`` renamed ``fc2.weight`` to
    ``fc2.weight_orig``) was bundled under the old name: the window found no copy of the
    pruned weights, re-ran from the bundle's NaN ones and reported 'first non-finite at step
    6, in the forward, fc2', a step that ran finite."""
    err, name, rows = _rigl(tmp_path, pruned=True, guard=False, rewind=2, at=7)
    assert (err.event["step"], err.event["params"]) == (7, [name])
    meta, tensors = read_bundle(err.bundle_path)
    assert "rewind/weights/fc2.weight_orig" in tensors
    assert "rewind/optim/fc2.weight_orig/exp_avg" in tensors
    assert not any(k.startswith("rewind/weights/fc2.weight") and k.endswith("weight")
                   for k in tensors)
    assert bool(torch.isfinite(tensors["rewind/weights/fc2.weight_orig"]).all())
    rep = nanreplay_json(err.bundle_path, code=1)
    win = rep["window"]
    assert (win["copy_step"], win["reproduced"], win["first_non_finite"]) == (6, False, None)
    assert (rep["cause"], rep["origin"]["param"], rep["origin"]["rows"]) == \
        ("weights", name, rows)


def test_dead_units_reinitialised_with_the_std_of_one_live_unit(tmp_path):
    """ReDo-style re-init after ``optimizer.step()``: the new incoming weights' std per input
    is taken over the live units, of which one is left (``std`` of one value: NaN). The
    next step's forward reads them: a weights event of step 8, written since step 7's update."""
    model = M.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    crit = nn.CrossEntropyLoss()
    acts: dict[str, torch.Tensor] = {}
    model.fc1.register_forward_hook(lambda m, i, o: acts.__setitem__("fc1", o.detach()))
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path, factory=FACTORY):
            for step, (x, y) in enumerate(M.batches(20)):
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
                if step == 6:  # a bad step leaves one live unit
                    with torch.no_grad():
                        model.fc1.bias[:-1] -= 100
                if step == 7:  # (torch warns, the loop goes on)
                    with pytest.warns(UserWarning, match="degrees of freedom"):
                        M.reinit_dead(model.fc1, model.fc2, acts["fc1"])
    err = info.value
    rows = torch.isnan(model.fc1.weight).any(1).nonzero().flatten().tolist()
    assert rows == list(range(31))
    assert (err.event["step"], err.event["phase"], err.event["params"]) == \
        (8, "weights", ["fc1.weight"])
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], rep["reproduced"], o["param"], o["rows"]) == \
        ("weights", True, "fc1.weight", rows)
    assert (o["module"], o["op"], o["source"]) == \
        ("fc1", "aten.addmm", source_line(MODELS, "h = F.relu(self.fc1(x))"))
    assert o["last_update_step"] == 7
    assert "between that update and step 8" in rep["hint"]
    assert "dead units re-initialised, with a std or norm over one value or none" in rep["hint"]


@pytest.mark.parametrize("rewind", [None, 3])
def test_structured_pruning_of_a_cosine_head_names_the_masks_zero_rows(tmp_path, rewind):
    """``prune.ln_structured(dim=0)`` at step 4 zeroes a class row of a cosine classifier,
    whose forward divides each row by its norm: 0/0 in that very step. The hint was 'a
    parametrisation reached the op's pole ... (a rate -relu(a) at 0, a scale trained to 0)';
    with a rewind window copied before the pruning, the window's departure was put down to
    load_state_dict, EWC's Fisher or plain attributes, not the pruning after its copy."""
    model = M.make_cosine_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path, rewind=rewind,
                            factory="model_surgery_models:make_cosine_net"):
            for step, (x, y) in enumerate(M.batches(12)):
                if step == 4:
                    for m in model.modules():
                        if isinstance(m, (nn.Linear, M.CosineHead)):
                            prune.ln_structured(m, "weight", amount=0.25, n=2, dim=0)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    err = info.value
    zero = (model.head.weight_mask == 0).all(1).nonzero().flatten().tolist()
    assert len(zero) == 1
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (4, "forward", "head")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], rep["reproduced"], o["op"], o["module"], o["samples"]) == \
        ("invalid", True, "aten.div", "head", list(range(16)))
    assert o["source"] == source_line(MODELS, "w = self.weight / self.weight.norm(dim=1")
    assert f"(head.weight_mask, torch.nn.utils.prune) zeroes whole rows {zero} of 4" \
        in rep["hint"]
    departed = [p for p in rep["problems"] if "window's re-run of it is not the step" in p]
    if rewind is None:
        assert rep["window"] is None and not departed
    else:
        assert rep["window"]["copy_step"] == 0 and len(departed) == 1
        assert "the loop pruned the model (torch.nn.utils.prune) after the recorder " \
               "attached and the window's copy holds none of its masks (body.0.weight_mask, " \
               "body.2.weight_mask, head.weight_mask)" in departed[0]


def _unfreeze(rec_kwargs: dict | None):
    """Gradual unfreezing: the head trains alone, then the body joins at step 5 in a group of
    its own whose learning rate (0.1) is 10x the head's; the regression diverges until the
    squared error overflows. Without ``rec_kwargs`` the plain loop's first non-finite loss's
    step and batch; with them, the error and the live model and batch at the event."""
    model = M.make_regressor()
    model.body.requires_grad_(False)
    opt = torch.optim.SGD(model.head.parameters(), lr=0.01, momentum=0.9)
    crit = nn.MSELoss()
    rec = FlightRecorder(model, opt, loss_fn=crit, **rec_kwargs) if rec_kwargs else None
    try:
        if rec is not None:
            rec.attach()
        for step, (x, y) in enumerate(M.regression_batches(60)):
            if step == 5:
                model.body.requires_grad_(True)
                opt.add_param_group({"params": model.body.parameters(), "lr": 0.1})
            opt.zero_grad()
            loss = crit(model(x), y)
            if rec is None and not torch.isfinite(loss):
                return step, None, model, x, y
            loss.backward()
            opt.step()
    except NonFiniteError as e:
        return e.event["step"], e, model, x, y
    finally:
        if rec is not None:
            rec.detach()
    raise AssertionError("the unfrozen body did not diverge")


def test_a_body_unfrozen_with_a_10x_learning_rate_diverges_and_the_new_group_is_blamed(
        tmp_path):
    at, _, _, _, _ = _unfreeze(None)
    step, err, model, x, y = _unfreeze({"out_dir": tmp_path, "rewind": 4,
                                        "factory": "model_surgery_models:make_regressor"})
    assert step == at and err is not None
    assert (err.event["phase"], err.event["module"], err.event["kind"]) == \
        ("loss", "<loss>", "+inf")
    with torch.no_grad():  # the rows whose squared error is beyond float32
        rows = torch.isinf((model(x) - y) ** 2).nonzero().flatten().tolist()
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["op"], o["module"], o["samples"]) == \
        ("overflow", "aten.mse_loss", "<loss>", rows)
    assert "the run was diverging" in rep["hint"] and "--try lr=0.1x" in rep["hint"]
    first = rep["precursors"][0]
    assert (first["step"], first["kind"]) == (5, "lr_jump")
    assert first["detail"].startswith("learning rate (group 1) 0.1, of a group added at step "
                                      "5, is 10x the other groups' 0.01")


def _widened(out_dir, fixed: bool, record: bool = True):
    """Net2WiderNet on fc2 (32 -> 48) at step 5 of one recorded run: fc2 and fc3 replaced by
    new ``nn.Linear``s under the same names, their parameters given to the optimizer with
    ``add_param_group`` (the old ones stay in group 0, without gradients from then on).
    ``fixed=False``: old units never copied get a count of 0, and fc3's weights divided by
    it hold +-inf (or NaN) as the loop puts them in."""
    model = M.make_mlp()
    crit = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, factory=FACTORY) \
        if record else None
    try:
        if rec is not None:
            rec.attach()
        for step, (x, y) in enumerate(M.batches(10)):
            if step == 5:
                M.net2wider(model, 48, g, fixed=fixed)
                opt.add_param_group({"params": [*model.fc2.parameters(),
                                                *model.fc3.parameters()]})
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()
    finally:
        if rec is not None:
            rec.detach()
    return model, rec


def test_a_widened_layer_is_followed_by_name_and_its_replacement_is_warned_about(
        tmp_path, caplog):
    """The new group's parameters were called 'parameters the model did not have when the
    recorder attached ... neither checked nor bundled, and a bundle of the model cannot be
    replayed', though they replace fc2's and fc3's under the same names (and the bundle
    replays); what is really lost, the new modules' calls, went unsaid. Healthy, the run
    trains as without the recorder."""
    plain, _ = _widened(tmp_path, fixed=True, record=False)
    recorded, rec = _widened(tmp_path, fixed=True)
    assert rec.event is None
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), recorded.parameters()))
    said = [r.getMessage() for r in caplog.records]
    assert not any("did not have when the recorder attached" in m for m in said)
    assert said.count(REPLACED_WARNING.format(names="fc2, fc3")) == 1
    with pytest.raises(NonFiniteError) as info:
        _widened(tmp_path, fixed=False)
    err = info.value
    assert (err.event["step"], err.event["phase"], err.event["params"]) == \
        (5, "weights", ["fc3.weight"])
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["param"], o["module"], o["op"]) == \
        ("weights", "fc3.weight", "fc3", "aten.addmm")
    assert "replaced fc3.weight with a new parameter" in rep["hint"]
    assert "a division by a count of 0" in rep["hint"]
    assert any("fc2.weight [48, 32] (the factory's [32, 32])" in p for p in rep["problems"])

"""End to end: loops that change the model, its optimizer or its loss while the recorder is
attached (``changed_mid_run_models``): a backbone unfrozen into a new param group, a block
appended to a ``ModuleList``, ``weight_norm`` registered mid-run, a checkpoint resumed
(model, optimizer, scheduler), a cast to bfloat16, the loss object swapped for another. Healthy,
each trains bit-identically under the recorder; planted, the report names what changed."""

from __future__ import annotations

import logging
import warnings

import changed_mid_run_models as M
import pytest
import torch
from bundles import invoke_cli, nanreplay_json
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

from recorder import FlightRecorder, NonFiniteError
from recorder.target import UNKNOWN_WARNING

pytestmark = pytest.mark.usefixtures("in_tests_dir")

AT, STEPS = 3, 8  # the step the loop changes things at; the run's length
GAINS_PARAMS = ("grow", "weight_norm")  # changes that give the optimizer parameters


def _change(kind: str, model, opt, sched, state: dict, ckpt) -> None:
    """The loop's change at step AT."""
    if kind == "unfreeze":
        model.backbone.requires_grad_(True)
        opt.add_param_group({"params": model.backbone.parameters(), "lr": 0.01})
    elif kind == "grow":
        model.blocks.append(nn.Linear(16, 16))
        opt.add_param_group({"params": model.blocks[-1].parameters()})
    elif kind == "weight_norm":  # (new tensors original0, original1 replace weight)
        weight_norm(model.backbone[2])
        opt.add_param_group({"params": model.backbone[2].parametrizations.parameters()})
    elif kind == "old_weight_norm":  # (hook-based: weight_g, weight_v; deprecated by torch)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            nn.utils.weight_norm(model.backbone[2])
        opt.add_param_group({"params": [model.backbone[2].weight_g, model.backbone[2].weight_v]})
    elif kind == "resume":
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
    elif kind == "bf16":
        model.to(torch.bfloat16)
    elif kind == "swap_loss":
        state["crit"] = M.NaiveFocal()


def _checkpoint() -> dict:
    """A run of AT steps on other batches, saved as a loop saves one."""
    model = M.make_net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    for x, y in M.batches(AT, seed=1):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()
    return {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}


def _train(kind: str, out_dir=None, plant=None, ckpt=None):
    """The loop (recorded when ``out_dir``); ``plant(step, model, x)`` may edit the model or
    the batch. Returns the losses and the model, or the NonFiniteError and the model."""
    model = M.make_grown() if kind == "grow" else M.make_net()
    if kind == "unfreeze":
        model.backbone.requires_grad_(False)
    # (AdamW's float32 state cannot take bfloat16 gradients: a bf16 cast goes with SGD)
    opt = (torch.optim.SGD if kind == "bf16" else torch.optim.AdamW)(
        model.head.parameters() if kind == "unfreeze" else model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    state = {"crit": nn.CrossEntropyLoss()}
    ckpt = ckpt or (_checkpoint() if kind == "resume" else None)
    rec = None if out_dir is None else FlightRecorder(
        model, opt, loss_fn=state["crit"], out_dir=out_dir,
        factory=f"changed_mid_run_models:{'make_grown' if kind == 'grow' else 'make_net'}")
    losses = []
    try:
        if rec is not None:
            rec.attach()
        for step, (x, y) in enumerate(M.batches(STEPS)):
            if step == AT:
                _change(kind, model, opt, sched, state, ckpt)
            if plant is not None:
                x = plant(step, model, x)
            if kind == "bf16" and step >= AT:
                x = x.to(torch.bfloat16)
            opt.zero_grad()
            loss = state["crit"](model(x), y)
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
    except NonFiniteError as e:
        return e, model
    finally:
        if rec is not None:
            rec.detach()
    return losses, model


KINDS = ["unfreeze", "grow", "weight_norm", "resume", "bf16", "swap_loss"]


@pytest.mark.parametrize("kind", KINDS)
def test_healthy_changes_train_bit_identically_with_no_event(tmp_path, caplog, kind):
    """Only parameters the optimizer gained that the model did not have at attach are warned
    about (once: they are not recorded); nothing else is said."""
    plain, _ = _train(kind)
    with caplog.at_level(logging.WARNING, logger="nanreplay"):
        recorded, _ = _train(kind, tmp_path)
    assert recorded == plain
    said = [r.getMessage() for r in caplog.records]
    if kind in GAINS_PARAMS:
        assert said == [UNKNOWN_WARNING.format(n=2)]
    else:
        assert said == []


def _added(kind: str, out_dir, plant) -> tuple[NonFiniteError, list[str], list[str]]:
    """The event of a run with ``plant``, and the names the model gained and lost since."""
    before = [n for n, _ in (M.make_grown() if kind == "grow" else M.make_net())
              .named_parameters()]
    err, model = _train(kind, out_dir, plant)
    assert isinstance(err, NonFiniteError), err
    now = [n for n, _ in model.named_parameters()]
    return err, [n for n in now if n not in before], [n for n in before if n not in now]


@pytest.mark.parametrize("kind, step, module", [("grow", 6, ""), ("weight_norm", 5, "backbone.2")])
def test_nan_in_parameters_added_after_attach_is_said_to_be_unrecorded(tmp_path, kind, step,
                                                                      module):
    """A NaN put in a block appended after attach (whose module no hook sees: the root is
    blamed), or a zero row of weight_norm's direction ``original1`` registered after attach
    (0/0 in that Linear). The report said 'the factory builds a different model ... pass
    factory_kwargs' (growing), that the weight was 'written outside optimizer.step() during
    the step' (weight_norm), or, for the hook-based weight_norm, a MAML inner loop; it now names
    the parameters the model gained (and lost) since attach, which the bundle does not hold."""
    def plant(k, model, x):
        if k == step:
            with torch.no_grad():
                if kind == "grow":
                    model.blocks[-1].weight[2, 3] = float("nan")
                else:
                    model.backbone[2].parametrizations.weight.original1[4].zero_()
        return x

    err, added, gone = _added(kind, tmp_path, plant)
    assert (err.event["step"], err.event["phase"], err.event["module"]) == \
        (step, "forward", module)
    rep = nanreplay_json(err.bundle_path, code=1)
    assert (rep["reproduced"], rep["cause"]) == (False, None)
    assert rep["fidelity"]["added"] == {"added": added, **({"gone": gone} if gone else {})}
    assert rep["hint"].startswith("the model gained parameters after the recorder attached")
    text = invoke_cli(err.bundle_path).stdout
    assert f"the model that ran had parameters the recorder did not hold ({', '.join(added)})" \
        in text
    assert (f"and no longer had {', '.join(gone)}" in text) == bool(gone)
    assert "rec.detach() then rec.attach()" in text
    assert "factory builds a different model" not in text


def test_a_loss_swapped_mid_run_is_named_with_the_step_it_stopped_being_called(tmp_path):
    """From step AT the loop computes its loss with a NaiveFocal the recorder was not given;
    row ROW of step K's batch is scaled by 1e4, so its p underflows and log(p) is -inf, and the
    gradient into the model's output is NaN there. The report said only that the given loss
    'was not called in this step' and to compute the loss with it."""
    k, row = 6, 5

    def plant(step, model, x):
        if step == k:
            x = x.clone()
            x[row] *= 1e4
        return x

    err, _ = _train("swap_loss", tmp_path, plant)
    assert isinstance(err, NonFiniteError), err
    assert (err.event["step"], err.event["phase"]) == (k, "backward")
    rep = nanreplay_json(err.bundle_path)
    assert rep["origin"]["samples"] == [row]
    assert rep["hint"].startswith(
        f"the loop stopped calling the loss module given as loss_fn after step {AT - 1}")
    assert any(f"it was called up to step {AT - 1} and in none of the steps since ({AT} to "
               f"{k})" in p for p in rep["problems"])


def test_nan_under_a_hook_based_weight_norm_registered_after_attach(tmp_path):
    """torch.nn.utils.weight_norm at step AT (weight_g, weight_v replace weight), a zero row of
    the direction weight_v at step K: the re-run on the bundle's stale weight is finite, and
    the report blamed weights 'passed in by torch.func.functional_call (a MAML inner loop)';
    it now names the parameters gained and lost since attach."""
    k = 5

    def plant(step, model, x):
        if step == k:
            with torch.no_grad():
                model.backbone[2].weight_v[4].zero_()
        return x

    err, added, gone = _added("old_weight_norm", tmp_path, plant)
    assert (err.event["step"], err.event["phase"], err.event["module"]) == \
        (k, "forward", "backbone.2")
    rep = nanreplay_json(err.bundle_path, code=1)
    assert (rep["reproduced"], rep["cause"]) == (False, None)
    assert "functional_call" not in rep["hint"] + " ".join(rep["problems"])
    assert rep["hint"].startswith("the model that ran is not the one the recorder was attached")
    assert [p for p in rep["problems"] if p.startswith(
        f"the model that ran had parameters the recorder did not hold ({', '.join(added)})")
        and f"and no longer had {', '.join(gone)}" in p]


def test_resumed_adam_state_with_its_moments_swapped_is_the_update_not_an_earlier_write(
        tmp_path):
    """A checkpoint converter that wrote exp_avg as exp_avg_sq and back: the first update
    after the resume takes sqrt of the negative entries, NaN. The report said the weight 'was
    NaN before the update, not made by it' (the state it checked is finite); it is the
    update's, and the NaN entries are where the loaded exp_avg_sq is negative."""
    ckpt = _checkpoint()
    for st in ckpt["opt"]["state"].values():
        st["exp_avg"], st["exp_avg_sq"] = st["exp_avg_sq"], st["exp_avg"]
    names = [n for n, _ in M.make_net().named_parameters()]
    negative = [n for i, n in enumerate(names)
                if bool((ckpt["opt"]["state"][i]["exp_avg_sq"] < 0).any())]
    err, _ = _train("resume", tmp_path, ckpt=ckpt)
    assert isinstance(err, NonFiniteError), err
    assert (err.event["step"], err.event["phase"], err.event["params"]) == \
        (AT, "optimizer", negative)
    rep = nanreplay_json(err.bundle_path, code=None)
    assert (rep["cause"], rep["origin"]["param"]) == ("optimizer", negative[0])
    assert not any("NaN before the update" in p for p in rep["problems"])

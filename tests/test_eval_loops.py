"""Validation and sampling inside the training loop with the recorder attached, as scripts
write it: every few steps ``model.eval()``, a validation loop under ``torch.no_grad()`` or
``torch.inference_mode()`` (or with neither: a loop that forgot it), an EMA copy evaluated,
``model.train()`` (or not: a loop that forgot it). The recorder must not change what training
computes, and an event must name the batch that made it: a validation batch as one."""

from __future__ import annotations

import contextlib
import copy

import eval_loops_models as E
import pytest
import torch
from models import check_event, identical
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle
from replay import replay

pytestmark = pytest.mark.usefixtures("in_tests_dir")

EVERY = 2  # validation after every second step
VAL = 3  # validation batches


def train(model, opt, crit, steps, *, grad_off=torch.no_grad, back_to_train=True, ema=None,
          val_empty=None, train_batch=E.batch):
    """The loop; ``val_empty = (step, i, row)``: that validation batch's row has no valid
    token. Returns the training losses and the validation losses."""
    losses, vals = [], []
    for step in range(steps):
        x, m, y = train_batch(step)
        opt.zero_grad()
        loss = crit(model(x, m), y)
        loss.backward()
        opt.step()
        if ema is not None:
            with torch.no_grad():
                torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 0.1)
        losses.append(loss.item())
        if step % EVERY == EVERY - 1:
            for net in (model, ema) if ema is not None else (model,):
                net.eval()
                val = 0.0
                with grad_off():
                    for i in range(VAL):
                        empty = val_empty[2] if val_empty and val_empty[:2] == (step, i) else None
                        xb, mb, yb = E.batch(100 + i, empty=empty)
                        val += crit(net(xb, mb), yb).item()
                vals.append(val)
            if back_to_train:
                model.train()
    return losses, vals


def run(record, tmp_path, steps=6, **kw):
    torch.manual_seed(0)
    model, crit = E.Pooled(), nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    if kw.pop("with_ema", False):
        kw["ema"] = copy.deepcopy(model).requires_grad_(False)
    if not record:
        return train(model, opt, crit, steps, **kw)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                        factory="eval_loops_models:Pooled") as rec:
        out = train(model, opt, crit, steps, **kw)
    # (a validation with gradients on opens a step; the last, which no backward followed, is
    # checked as an evaluation as the recorder exits, not counted as a step)
    assert rec.step == steps
    return out


@pytest.mark.parametrize("grad_off, back_to_train, with_ema", [
    (torch.no_grad, True, True), (torch.inference_mode, True, False),
    (torch.no_grad, False, False), (contextlib.nullcontext, True, False)])
def test_validation_between_steps_changes_nothing(tmp_path, grad_off, back_to_train, with_ema):
    """No event, no warning, the same losses bit for bit: validation under no_grad (with an
    EMA copy evaluated too), under inference_mode, a loop that forgot model.train(), and one
    that forgot no_grad."""
    kw = dict(grad_off=grad_off, back_to_train=back_to_train, with_ema=with_ema)
    assert run(True, tmp_path, **kw) == run(False, tmp_path, **kw)


@pytest.mark.parametrize("grad_off", [torch.no_grad, torch.inference_mode])
def test_training_event_after_validations_keeps_its_step_and_batch(tmp_path, grad_off):
    """A NaN in training step K after several validations: step K, its own batch (the NaN
    row's pooled features enter BatchNorm's batch mean: every output row is NaN, and the
    replay names the row)."""
    k, row = 4, 6

    def train_batch(step):
        return E.batch(step, empty=row if step == k else None)

    with pytest.raises(NonFiniteError) as info:
        run(True, tmp_path, grad_off=grad_off, train_batch=train_batch)
    check_event(info.value.event, step=k, phase="forward", micro_batch=0)
    assert not info.value.event.get("evaluation")
    meta, tensors = read_bundle(info.value.bundle_path)
    (mb,) = meta["micro_batches"]
    assert mb["grad_enabled"] is True and mb["training"] is True
    x, m, _ = train_batch(k)
    assert identical(tensors["batch/0/0"], x) and identical(tensors["batch/0/1"], m)
    rep = replay(info.value.bundle_path)
    assert rep["reproduced"] is True and rep["event"]["step"] == k
    assert (rep["origin"]["op"], rep["origin"]["samples"]) == ("aten.div", [row])


def test_last_validation_without_no_grad_is_checked_as_an_evaluation_at_exit(tmp_path):
    """The same forgotten no_grad after the last step: no step follows those forwards, so the
    recorder's exit checks them as an evaluation (before, it counted them as one more training
    step, exchanged with the other ranks under torchrun): an evaluation event before step 6
    that says no backward followed, and the replay re-runs validation batch i to the
    division in row ``row``."""
    steps, i, row = 6, 2, 1
    with pytest.raises(NonFiniteError) as info:
        run(True, tmp_path, steps=steps, grad_off=contextlib.nullcontext,
            val_empty=(steps - 1, i, row))
    err = info.value
    check_event(err.event, step=steps, phase="forward", module="", micro_batch=i,
                samples=[row])
    assert err.event["evaluation"] is True and err.event["no_backward"] is True
    assert "with gradients on that no backward followed" in str(err)
    assert "validation forward run without torch.no_grad()" not in str(err)
    rep = replay(err.bundle_path)
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    assert rep["event"]["evaluation"] is True and rep["event"]["no_backward"] is True
    o = rep["origin"]
    assert (o["op"], o["micro_batch"], o["samples"]) == ("aten.div", i, [row])


def test_validation_batch_without_no_grad_is_named_as_one(tmp_path):
    """Validation with model.eval() but no torch.no_grad(): its forwards open the next training
    step, so a sequence with no valid token in validation batch i is found at that step's
    optimizer.step(), as its micro-batch i. The message and the report say it is a validation
    batch run with gradients on (not a skipped training batch), and the replay re-runs that
    batch in eval mode to the division."""
    at, i, row = 3, 1, 2  # after training step 3, validation batch 1, row 2
    with pytest.raises(NonFiniteError) as info:
        run(True, tmp_path, grad_off=contextlib.nullcontext, val_empty=(at, i, row))
    err = info.value
    check_event(err.event, step=at + 1, phase="forward", module="", micro_batch=i,
                samples=[row])
    assert "validation forward run without torch.no_grad()" in str(err)
    assert "skipped that batch" not in str(err)
    meta, tensors = read_bundle(err.bundle_path)
    assert meta["micro_batches"][i]["training"] is False
    x, m, _ = E.batch(100 + i, empty=row)
    assert identical(tensors[f"batch/{i}/0"], x) and identical(tensors[f"batch/{i}/1"], m)
    rep = replay(err.bundle_path)
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    o = rep["origin"]
    assert (o["op"], o["micro_batch"], o["samples"]) == ("aten.div", i, [row])
    assert any(f"micro-batch {i} of step {at + 1} ran with the model in eval mode" in p
               for p in rep["problems"]), rep["problems"]


def test_step_after_validation_without_train_replays_in_eval_mode(tmp_path):
    """model.train() forgotten after validation: the next steps train in eval mode, where the
    head normalises exp by hand; a sample scaled out of range overflows exp (inf/inf). The
    replay re-runs the step in eval mode, as it ran, and finds the exp."""
    k, row = 3, 6

    def xy(step):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, E.D, generator=g)
        if step == k:
            x[row] *= 1e4
        return x, torch.randint(0, E.C, (8,), generator=g)

    torch.manual_seed(0)
    model, crit = E.prob_mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="eval_loops_models:prob_mlp"):
            for step in range(6):
                x, y = xy(step)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
                if step == 1:
                    model.eval()
                    with torch.no_grad():
                        crit(model(xy(100)[0]), xy(100)[1])
    check_event(info.value.event, step=k, phase="forward", module="5", samples=[row])
    meta, _ = read_bundle(info.value.bundle_path)
    assert meta["micro_batches"][0]["training"] is False
    rep = replay(info.value.bundle_path)
    assert rep["reproduced"] is True and rep["cause"] == "overflow"
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"]) == ("5", "aten.exp", [row])


def test_nan_ema_weights_swapped_in_for_validation(tmp_path):
    """A hand EMA (a shadow state_dict, parameters and BatchNorm buffers) loaded into the live
    model for validation and restored after, as many scripts do; its decay is NaN at step K
    (a schedule's 0/0). The validation's forward is checked on weights no update wrote: a
    weights event of that evaluation, whose hint names the parameters (not the buffers loaded
    beside them) and the loop's write between steps, an EMA copied in among its examples."""
    k = 3
    torch.manual_seed(0)
    model, crit = E.Pooled(), nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    shadow = {n: t.detach().clone() for n, t in model.state_dict().items()
              if t.is_floating_point()}
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="eval_loops_models:Pooled"):
            for step in range(6):
                x, m, y = E.batch(step)
                opt.zero_grad()
                crit(model(x, m), y).backward()
                opt.step()
                decay = float("nan") if step == k else 0.9
                with torch.no_grad():
                    for n, t in model.state_dict().items():
                        if n in shadow:
                            shadow[n].lerp_(t, 1 - decay)
                backup = copy.deepcopy(model.state_dict())
                model.load_state_dict(shadow, strict=False)
                model.eval()
                with torch.no_grad():
                    xb, mb, yb = E.batch(100)
                    crit(model(xb, mb), yb)
                model.load_state_dict(backup)
                model.train()
    params = [n for n, _ in model.named_parameters()]
    check_event(info.value.event, step=k + 1, phase="weights", evaluation=True, params=params)
    rep = replay(info.value.bundle_path)
    assert rep["reproduced"] is True and rep["cause"] == "weights"
    names = f"{params[0]}, {params[1]} (+{len(params) - 2} more)"
    assert rep["hint"].startswith(f"{names} train and the recorded optimizer holds them, and its "
                                  f"update of step {k} left them finite"), rep["hint"]
    assert "an EMA or SWA average copied in" in rep["hint"]

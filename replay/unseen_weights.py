"""A forward event the re-run does not make at a module holding weights of its own, which took
finite inputs in training and made the non-finite value there, while the re-run's same call,
on the bundle's weights, is finite: that call ran with weights the bundle does not hold, made
by code the recorder does not see. MAML written with ``torch.func``: the inner loop's forwards
run under ``torch.func.grad`` (left out by the recorder), and the query forward runs the model
through ``functional_call`` on the adapted ``p - lr * g``; an inner step too large for a task's
loss scale makes those weights overflow. The recorded origin is kept (not reproduced, no cause
guessed) and the hint names the code that made the weights instead of state outside the model.
An earlier micro-batch the loop differentiated itself (``autograd.grad``) is
:mod:`replay.second_order`'s ``report_made_weights``; weights moved in place between forwards
(SAM) :mod:`replay.moved_weights`'s, which calls this one last. A forward with gradients off
(a mean teacher's ``functional_call`` on its EMA copy) names that copy's update instead.
"""

from __future__ import annotations

from typing import Any

from . import added_layers as added
from .findings import finish, origin_fields
from .load import Step
from .rerun import Runner

__all__ = ["other_weights_report", "report_unseen_weights"]


def report_unseen_weights(report, step: Step, runner: Runner) -> dict[str, Any] | None:
    """The report of such an event, else None."""
    ev = step.event
    m, name, k = ev.get("micro_batch"), ev.get("module"), ev.get("call")
    if ev.get("phase") != "forward" or not ev.get("inputs_finite") or not isinstance(m, int) \
            or not isinstance(name, str) or not isinstance(k, int):
        return None
    own = [p for p in step.meta.get("params", ()) if p.rpartition(".")[0] == name]
    if not own or step.built_otherwise:
        return None  # (no weights of its own: what else it read is not known; attributes
        # the factory builds otherwise are said instead)
    try:
        run = runner.run(backward=False)
    except Exception:  # (a re-run that fails: no claim)
        return None
    finally:
        runner.reset()
    again = next((c for c in run.calls if (c.module, c.micro_batch, c.call) == (name, m, k)),
                 None)
    if run.error is not None or again is None or not again.outputs_finite:
        return None
    label = name or "<root>"
    if after := added.after_attach(step):  # (what it ran with: the tensors added since)
        report["problems"] = [p for p in report["problems"] if p != added.text(after)]
        return other_weights_report(report, ev, added.text(after), added.HINT)
    no_grad = _without_grad(step, m)
    return other_weights_report(report, ev, (
        f"'{label}' took finite inputs and made {ev.get('kind')} in training, but re-run on "
        "the bundle's weights it is finite: that forward most likely ran with weights the "
        f"bundle does not hold ({', '.join(own[:2])}), passed in by "
        "torch.func.functional_call (" + (_TEACHER if no_grad else _MAML) + ") or edited and "
        "put back within the step"), _TEACHER_HINT.format(label=label) if no_grad
        else _MAML_HINT.format(label=label))


_MAML = ("a MAML inner loop's p - lr * g, its own forwards run under torch.func.grad, which "
         "are not recorded")
_TEACHER = ("its forward ran with gradients off: a mean teacher's or EMA model's copy of the "
            "weights, a target network's")
_MAML_HINT = (
    "the weights '{label}' ran with were most likely not the model's own, and they were "
    "non-finite or large enough to overflow it: check the loop's code that made them at "
    "this step (an inner learning rate too large for this task's loss scale, an "
    "unnormalised task, too many inner steps, a learned per-parameter rate whose exp "
    "overflows: bound it, clip the inner gradient); the replay cannot re-run code outside "
    "the recorded forward")
_TEACHER_HINT = (
    "the weights '{label}' ran with in this forward without gradients were most likely a "
    "copy the loop keeps and passes in (a mean teacher's or EMA model's), and non-finite: "
    "check the loop's update of that copy (t.mul_(m).add_(s, alpha=1 - m), "
    "torch._foreach_lerp_(t, s, 1 - m)) for a non-finite decay m from its schedule, guard it "
    "(math.isfinite(m)), and check the copy as it is made (torch.isfinite(t).all()); the "
    "replay cannot re-run code outside the recorded forward")


def _without_grad(step: Step, m: int) -> bool:
    """Whether micro-batch ``m``'s forward ran with gradients off (a teacher's, under
    ``torch.no_grad()``)."""
    mbs = step.meta.get("micro_batches") or ()
    return 0 <= m < len(mbs) and mbs[m].get("grad_enabled") is False


def other_weights_report(report, ev: dict[str, Any], note: str, hint: str) -> dict[str, Any]:
    """The report of forward event ``ev`` whose call ran with weights the bundle does not
    hold: the recorder's origin, not reproduced, no cause; ``note`` why, ``hint`` where."""
    report["problems"].append(note)
    report = finish(report, origin_fields(
        phase="forward", module=ev.get("module"), call=ev.get("call"),
        micro_batch=ev.get("micro_batch"), inputs_finite=True, made=ev.get("kind"),
        samples=ev.get("samples", [])), None, reproduced=False)
    report["hint"] = hint
    return report

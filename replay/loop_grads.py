"""A backward event whose gradients no backward through the recorded forward made: the loop
wrote them (per-sample gradients under torch.func, a hand-written clip, gradient surgery,
Reptile's weight difference from a copy it trained), in code the replay cannot re-run."""

from __future__ import annotations

from typing import Any

from . import outside
from .cause_text import NO_FORWARD
from .comm_hook import comm_hook_gradient
from .findings import finish, origin_fields
from .kept_terms import kept_terms_text
from .load import Step
from .module_hooks import backward_missing_text
from .nan_skips import nan_skips_text
from .rescaled_grads import entrywise_divisor_text
from .shared_factor import shared_factor_text
from .unreached_calls import unreached_calls_text
from .user_grad_hooks import hooked_gradient
from .zero_grad import normalised_zero_gradient
from .zero_rows import empty_batch_text, zero_gradient_rows, zero_rows_text
from .zero_tasks import zero_outputs_text

# NO_FORWARD where the bundle says why: the loop called a compiled forward of its own
# (recorder.compiled.forward_compiled_alone)
COMPILED_FORWARD = ("the step ran no recorded forward: the loop calls the model's forward "
                    "compiled on its own (torch.compile(model.forward)(x)), which skips "
                    "nn.Module.__call__ and so the recorder's hooks; only the gradients and "
                    "the update were checked")
COMPILED_FORWARD_HINT = ("compile the model instead of its forward, torch.compile(model) or "
                         "model.compile() (the same graph): each step's forward is then "
                         "recorded and nanreplay re-runs it and names the op")
# NO_FORWARD, and the hint's opening, where the step's forwards ran under torch.func only
# (recorder.guard: such an update is a step of its own)
TRANSFORMED_FORWARD = ("the step ran the model only under torch.func transforms (jvp, vmap, "
                       "grad), which are not recorded: only its gradients and the update were "
                       "checked")
TRANSFORMED_GRADS = (" came from forwards of the model under torch.func transforms (jvp, vmap, "
                     "grad), which the recorder cannot record nor nanreplay re-run, and the "
                     "loop's code around them: a jvp's tangent through an op whose derivative "
                     "is infinite where its input is 0 (sqrt(t) or t ** 0.5 at t = 0: clamp it, "
                     "or use a feature smooth there), per-sample gradients and their clip or "
                     "noise (a division by a per-sample norm that is 0); check that code at "
                     "this step, and call the model once outside the transforms in each step "
                     "(the loss you log) so that its forward is recorded and re-run")


def no_backward_reached_the_output(step: Step) -> bool:
    """No gradient reached the output of any forward of the step that ran with gradients on
    (the recorder keeps each one that does), while the re-run's backward, which found every
    gradient finite, reaches it."""
    return all(mb.get("grad_enabled", True) and not mb.get("output_grads")  # (or no forward)
               for mb in step.micro_batches)


def finite_gradients_reached_the_output(step: Step) -> bool:
    """Gradients reached the model's output in this step, all of them finite (a loop's
    ``torch.autograd.grad`` per task leaves them too), and the re-run's backward made every
    parameter's gradient finite: the non-finite ones recorded came from elsewhere."""
    grads = outside.recorded_output_grads(step)
    return any(grads.values()) and not outside.non_finite_entries(grads)


def gradients_from_the_loop(report, step: Step, reached: bool = False,
                            runner=None) -> dict[str, Any]:
    """A backward event of a step whose gradients no backward through the recorded forward
    made (``reached``: none from the finite gradients that reached its output): the loop
    wrote them (per-sample gradients under torch.func, a hand-written clip or noise,
    gradient surgery's ``p.grad = ...`` after ``autograd.grad`` per task), in code the replay
    cannot re-run. With ``runner``, values the forward keeps on its modules (a regulariser's
    activations) are named as where the loop's term came from (:mod:`replay.kept_terms`)."""
    params = step.event.get("params") or []
    zero = zero_gradient_rows(step)
    transformed = step.meta.get("forward_transformed_alone")
    report["problems"].append(
        "the gradients that reached the model's output were finite, and the re-run's backward "
        "from there makes every parameter's gradient finite" if reached else
        (COMPILED_FORWARD if step.meta.get("forward_compiled_alone") else TRANSFORMED_FORWARD
         if transformed else NO_FORWARD)
        if not step.micro_batches else
        "no backward ran through the recorded forward in this step (no gradient reached the "
        "model's output), and the re-run's backward makes every gradient finite")
    report = finish(report, origin_fields(phase="backward", params=params,
                                          param=(params or [None])[0],
                                          made=step.event.get("kind")),
                    "not_reproduced", reproduced=False)
    used = f" ({', '.join(params)})" if params else ""
    report["hint"] = ((backward_missing_text(step, params) or unreached_calls_text(step) + (
        f"the gradients the update was about to use{used}"
        + (TRANSFORMED_GRADS if transformed else
           " were written by the loop's own code, not by backward through the model: per-sample "
        "gradients (torch.func.vmap/grad), a hand-written clip or noise, gradients set or "
        "averaged by hand (gradient surgery: torch.autograd.grad per task, then p.grad = ...), "
        "a loss term on the weights themselves added in the loop (a FedProx or EWC penalty: "
        "computed in loss_fn instead, given the model, loss_fn(out, y, model), it is re-run "
        "and its op named), a difference of weights "
        "(Reptile's p - fast_p from a copy the loop trained); check that code at this "
        "step, e.g. a division by a norm that is 0"))) + shared_factor_text(step, params)
        + zero_rows_text(zero)
        + empty_batch_text(step) + zero_outputs_text(step, runner)
        + nan_skips_text(step))
    if step.meta.get("forward_compiled_alone"):
        report["hint"] = COMPILED_FORWARD_HINT
    elif reached and comm_hook_gradient(report, step, runner):
        pass  # (DDP's communication hook made the gradients: a float16 sum's overflow)
    elif reached and hooked_gradient(report, step, runner, params):
        pass  # (a tensor hook the script registered on the parameter: named with its line)
    elif reached and runner is not None and (kept := kept_terms_text(runner)):
        report["hint"] = kept
    elif reached and (normed := normalised_zero_gradient(step, runner, params)):
        report["cause"], report["hint"] = "invalid", normed  # (the loop's 0/0, shown)
    elif reached and (scaled := entrywise_divisor_text(step, runner, params)):
        report["hint"] = scaled  # (the loop's code is not re-run: its divisor is inferred)
    if zero:  # (the first micro-batch's: the origin names one)
        report["origin"]["micro_batch"], report["origin"]["samples"] = next(iter(zero.items()))
    return report

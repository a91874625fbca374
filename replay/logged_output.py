"""A loss argument that is the log of a model output the loop took: ``q.log()`` of a softmax.

pt-dec's and IDEC's loops take ``output.log()`` themselves and give it to ``F.kl_div`` with the
target ``p``. Where a soft assignment underflowed to exactly 0 (a softmax of far clusters'
distances), the log is -inf and the target there is 0 too, so ``kl_div``'s ``target * (log
target - input)`` is 0 * inf, NaN. The loss re-run sees the argument only as the tensor the
loop gave it, so its -inf read as a mask's, put in on purpose; the re-run's model output it
is the log of says otherwise. :func:`logged_output_cause` names it, ``underflow`` when that
output came from exp, softmax, sigmoid or softplus (positive in exact arithmetic).
"""

from __future__ import annotations

import torch

from recorder.capture import loss_path

from .cause_result import Cause
from .load import Step
from .positive import made_sign

LOGGED_OUTPUT = (
    "{tensor} is the log of model output {k}, taken by the loop (q.log()), and it holds -inf "
    "where that output is exactly 0{why}; then {op} made NaN of the -inf (F.kl_div's target "
    "* (log target - input) with a target of 0 there: 0 * inf). Take the log in log space: "
    "have the model return log_softmax (log q = logits.log_softmax(-1); for a Student-t "
    "kernel, -(alpha + 1) / 2 * log1p(d / alpha) normalised with logsumexp) and give that to "
    "the loss, or clamp the output first (q.clamp_min(1e-10).log())")
POSITIVE = (": that output is made by exp, softmax, sigmoid or softplus, positive in exact "
            "arithmetic, and underflowed to 0 (a far cluster's assignment)")


def logged_output_cause(cause: Cause, step: Step, mb: int, outputs: list, op: str) -> Cause:
    """``cause`` of a loss op ``op`` that made NaN of infinities only its arguments held, or
    the cause above when one argument is the log of one of micro-batch ``mb``'s re-run model
    ``outputs`` (``log(out)`` equal to it, -inf where out is 0)."""
    for key, raw in step.micro_batches[mb].get("loss_paths", {}).items():
        t = step.tensors.get(key)
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() \
                or not bool(torch.isneginf(t).any()):
            continue
        for k, out in enumerate(outputs):
            if isinstance(out, torch.Tensor) and _is_log_of(t, out):
                why = POSITIVE if made_sign(out.grad_fn) > 0 else ""
                return Cause("underflow" if why else "invalid", LOGGED_OUTPUT.format(
                    tensor=loss_path(raw), k=k, why=why, op=op))
    return cause


def _is_log_of(t: torch.Tensor, out: torch.Tensor) -> bool:
    if out.shape != t.shape or not out.is_floating_point():
        return False
    with torch.no_grad():
        logged = out.detach().to(t.device, t.dtype).log()
        return bool(torch.isclose(logged, t, rtol=1e-5, atol=1e-6, equal_nan=False).all())

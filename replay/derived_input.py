"""An input event on a batch the loop made between the step's forwards from an earlier
forward's input, which it differentiated: an adversarial attack's inner loop (PGD, FGSM)
feeds the model ``x + alpha * g / ‖g‖`` with ``g`` the gradient of the loss w.r.t. that
earlier input; an EBM's short-run Langevin sampler feeds it ``x - step / 2 * g + noise``, one
forward per sampling step. No record of the data is bad then; the loop's step made the NaN/Inf:
most often 0/0 where a sample's input gradient was exactly 0 (a sample the attack no longer
attacks, a loss that is 0 there), which the output gradient the recorder kept shows; or an
overflow of a chain whose values grew forward after forward (a sampler that diverges), which
the earlier micro-batches' inputs show."""

from __future__ import annotations

from typing import Any

import torch

from recorder.loss_forwards import ran_in_loss

from .load import Step
from .recorded import origin_key
from .zero_rows import _spans, zero_mask

DERIVED_INPUT = (
    "{tensor} of micro-batch {i} is no data: the {maker} made it between the step's forwards "
    "from the input of micro-batch {j}, which was finite and which the {maker} differentiated "
    "(torch.autograd.grad w.r.t. the input: an adversarial attack's step, x + alpha * "
    "g.sign() or x + alpha * g / ‖g‖; VAT's r_adv = eps * g / ‖g‖; a Langevin sampler's "
    "x - step / 2 * g + noise), so that code made the NaN/Inf, not a record{zero}")
ZERO_INPUT_GRAD = (
    "; sample(s) {rows} sent back a gradient of exactly 0 into the model's output in "
    "micro-batch {j}, so their input gradient is 0 too and a step normalised by its norm "
    "(g / ‖g‖) makes 0/0 there: clamp the norm from below (g / g.norm().clamp_min(1e-12)), "
    "as advertorch's normalize_by_pnorm does, or leave those samples out of the step")


IN_PLACE = (
    "; the loop stepped that very tensor in place (x.data += ...), so the bundle holds it as "
    "its last write left it and the gradient that made the NaN/Inf cannot be re-run: step "
    "out of place (x = x - step * g) to have it replayed (the recorder copies such inputs "
    "from the next forward on, so a later step's event is)")
GROWING_CHAIN = (
    "; its largest |value| grew forward after forward from micro-batch {a} to {j} (x{rate} "
    "per forward, to {top}), so the loop's next step overflowed {dtype}: the iteration "
    "diverges (a Langevin step too large for the energy's curvature, a gradient step without "
    "a bound): clamp the samples to the data range (x.clamp(-1, 1)) or the gradient "
    "(g.clamp(-c, c)) in each step, or take smaller steps")


def derived_input_hint(step: Step, origin: dict[str, Any]) -> str | None:
    """The hint of an input event on ``origin``'s batch tensor when an earlier micro-batch of
    the step took a finite tensor of its shape at the same place and the loop asked for its
    gradient; None otherwise."""
    found = derived_from(step, origin)
    if found is None:
        return None
    j, rows, grew = found
    zero = ZERO_INPUT_GRAD.format(rows=_spans(rows), j=j) if rows else grew
    return DERIVED_INPUT.format(tensor=origin.get("tensor"), i=origin["micro_batch"], j=j,
                                zero=zero, maker=maker(step, origin["micro_batch"]))


def maker(step: Step, i: int) -> str:
    """Whose code made micro-batch ``i``'s input: the loss's, when the loss called the model
    on it itself (VAT's x + r_adv), else the loop's."""
    return "loss" if ran_in_loss(step.micro_batches, step.meta.get("loss"), i) else "loop"


def derived_from(step: Step, origin: dict[str, Any]) -> tuple[int, list[int], str] | None:
    """``(j, rows, more)`` when ``origin``'s batch tensor is one the loop made from micro-batch
    ``j``'s input, which it differentiated: ``rows`` those of the named samples whose output
    gradient there was exactly 0; ``more`` GROWING_CHAIN's text, IN_PLACE's (micro-batch
    ``j``'s tensor ``taken_again``, stepped in place: its bundled values are the last
    write's), or ""; None otherwise."""
    i = origin.get("micro_batch") or 0
    key, raw = origin_key(step, origin)
    bad = step.tensors.get(key)
    if not i or bad is None or not bad.is_floating_point():
        return None
    for j in range(i - 1, -1, -1):
        mb = step.micro_batches[j]
        k = next((k for k, r in mb.get("paths", {}).items() if r == raw), None)
        t = step.tensors.get(k) if k else None
        if mb.get("taken_again") and k in mb.get("grad_inputs", ()):
            return j, [], IN_PLACE  # (bundled as the loop's last write left it: no values)
        if t is None or t.shape != bad.shape or not bool(torch.isfinite(t).all()):
            return None
        if k in mb.get("grad_inputs", ()):
            named = origin.get("samples") or []
            rows = [r for r in _zero_rows(step, j) if r in set(named)]
            grew = _growing(step, j, raw, bad)
            if not (_near(bad, t) or grew or (rows and len(rows) == len(named))):
                return None  # another batch (micro-batches of other data), no attack's step
            return j, rows, grew
    return None


def _near(made: torch.Tensor, before: torch.Tensor) -> bool:
    """Whether the finite values of ``made`` lie within a small step of ``before``'s (a mean
    distance under half their spread: an attack moves each value by at most its eps, where
    other data of the same kind is as far apart as the spread); False when none is finite."""
    ok = torch.isfinite(made)
    if not bool(ok.any()):
        return False
    a, b = made[ok].double(), before[ok].double()
    return float((a - b).abs().mean()) < 0.5 * float(before.double().std())


def _zero_rows(step: Step, j: int) -> list[int]:
    """The samples of micro-batch ``j`` whose recorded output gradients are all exactly 0."""
    zero = zero_mask(step, j)
    return [] if zero is None else zero.nonzero().flatten().tolist()


def _growing(step: Step, j: int, raw: str, bad: torch.Tensor) -> str:
    """GROWING_CHAIN when the largest |value| at ``raw`` grew in every differentiated
    micro-batch of a run of at least 3 ending at ``j``, at a rate that takes the next one past
    ``bad``'s type's largest value (the loop's step overflowed); "" otherwise."""
    tops: list[float] = []
    for mb in step.micro_batches[j::-1]:
        k = next((k for k, r in mb.get("paths", {}).items() if r == raw), None)
        t = step.tensors.get(k) if k else None
        if t is None or t.shape != bad.shape or k not in mb.get("grad_inputs", ()) \
                or not bool(torch.isfinite(t).all()) or (tops and t.abs().max() >= tops[-1]):
            break
        tops.append(float(t.double().abs().max()))
    if len(tops) < 3 or tops[-1] == 0:
        return ""
    rate = (tops[0] / tops[-1]) ** (1 / (len(tops) - 1))
    if tops[0] * rate < torch.finfo(bad.dtype).max:
        return ""
    return GROWING_CHAIN.format(a=j - len(tops) + 1, j=j, rate=f"{rate:.3g}",
                                top=f"{tops[0]:.3g}", dtype=str(bad.dtype).removeprefix("torch."))

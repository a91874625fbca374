"""The report of a decomposition that failed inside ``optimizer.step()`` (the recorder's
``optimizer`` event of reason ``linalg``, :mod:`recorder.update_linalg`): Shampoo's or SOAP's
``eigh``, ``cholesky`` or ``inv`` of a preconditioner.

The update is re-run from the bundle's weights, gradients and optimizer state under the op
finder and a watch of which parameter's tensors each op read, its error caught. The first
non-finite op of the update (``grad @ grad.T`` overflowing float32) is the origin; where every
value was finite, the decomposition failed on a finite matrix that is singular or not
positive-definite (``precision`` where float64 factors it).
"""

from __future__ import annotations

from typing import Any

import torch

from recorder.finite import finite
from recorder.inner_optim import put_state, state_items
from recorder.linalg import linalg_reason
from recorder.seq_state import cloned

from .compat import OP_ERROR, TorchDispatchMode, tree_leaves
from .findings import finish, origin_fields
from .load import Step
from .ops import OpFinder
from .source import user_source
from .storages import storage_of

_CHECK = "_linalg_check_errors"  # raises for the op dispatched just before it
_PARTLY = ("no copy from before the update was kept (guard_optimizer=False): the bundle holds "
           "the weights and optimizer state as the failed update left them, possibly partly "
           "updated, and the update was re-run from there; record with guard_optimizer=True "
           "to re-run it from the state before it")
_FIX = ("add damping to the preconditioner's diagonal before the decomposition (L + eps * I, "
        "eps > 0 relative to its scale), lower the learning rate, or clip the gradients "
        "(torch.nn.utils.clip_grad_norm_) before they enter the preconditioner")


class _Watch(TorchDispatchMode):
    """Which parameter's weight, gradient or state each op read (by storage), the
    decomposition whose check raised, its matrix and where it was called."""

    def __init__(self, owners: dict[int, str]):
        super().__init__()
        self.owners, self.current = owners, None
        self.last: tuple[str, torch.Tensor | None, str | None, str | None] | None = None
        self.failed: tuple[str, torch.Tensor | None, str | None, str | None] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        for t in ins:
            if (owner := self.owners.get(storage_of(t))) is not None:
                self.current = owner
        mats = [t for t in ins if t.is_floating_point() and t.dim() >= 2]
        try:  # (not run_op: a frame of it would end the op finder's walk to the user's line)
            out = func(*args, **kwargs)
        except Exception as e:
            setattr(e, OP_ERROR, True)  # (the update's own op failing, as run_op marks it)
            if self.failed is None and linalg_reason(e):
                self.failed = self.last if name == _CHECK and self.last is not None else (
                    name, mats[0].detach().clone() if mats else None, user_source(),
                    self.current)
            raise
        if name != _CHECK:  # (a decomposition's matrix kept, for its check's error after it)
            kept = mats and ("linalg" in name or "cholesky" in name)
            self.last = (name, mats[0].detach().clone() if kept else None, user_source(),
                         self.current)
        return out


def report_update_linalg(report, step: Step) -> dict[str, Any] | None:
    """The report of an ``optimizer`` event of reason ``linalg``; None for any other."""
    ev = step.event
    if ev.get("reason") != "linalg" or ev.get("phase") != "optimizer":
        return None
    if ev.get("partly_updated"):
        report["problems"].append(_PARTLY)
    if step.model is None or step.optimizer is None:
        report["not_rerun"] = "model or optimizer not rebuilt"
        return finish(report, origin_fields(phase="optimizer", detail=ev.get("detail")),
                      "not_reproduced", reproduced=False, hint=(
                          "nothing was re-run: replay the full bundle where its factory (the "
                          "model and the optimizer) can be imported to name the op"))
    owners = _prepare(step)
    finder, watch = OpFinder(), _Watch(owners)
    error = None
    try:
        with finder, watch:
            step.optimizer.step()
    except Exception as e:
        if not linalg_reason(e):
            raise
        error = e
    return _judge(report, step, finder, watch, error)


def _prepare(step: Step) -> dict[int, str]:
    """Give every parameter its bundle gradient and copies of its own (the rebuilt model shares
    the bundle's tensors); the storages of each one's weight, gradient and state, by name."""
    names = {id(p): n for n, p in step.model.named_parameters()}
    with torch.no_grad():
        for n, p in step.model.named_parameters():
            p.data = p.data.clone()
            g = step.tensors.get(f"grads/{n}")
            p.grad = None if g is None else g.to(device=p.device, dtype=p.dtype).clone()
    owners = {}
    for p, st in state_items(step.optimizer):
        put_state(step.optimizer, p, {k: cloned(v) for k, v in st.items()})
    for p, st in state_items(step.optimizer):
        if (n := names.get(id(p))) is None:
            continue
        for t in [p, p.grad, *st.values()]:
            if isinstance(t, torch.Tensor) and (s := storage_of(t)) is not None:
                owners[s] = n
    return owners


def _judge(report, step: Step, finder: OpFinder, watch: _Watch, error) -> dict[str, Any]:
    cls = ((step.meta.get("optimizer") or {}).get("class") or "the optimizer").rpartition(".")[2]
    at = step.event.get("step")
    if error is None or watch.failed is None:
        report["problems"].append(f"the re-run of {cls}.step() from the bundle raised no "
                                  "decomposition error")
        return finish(report, origin_fields(phase="optimizer"), "not_reproduced",
                      reproduced=False, hint=(
                          "the update did not fail again from the bundle's state: what made it "
                          "fail is not in the bundle (state the optimizer keeps outside its "
                          "state dict) or it was transient"))
    op, matrix, source, param = watch.failed
    params = [param] if param else []
    hit = finder.origin()
    if hit is not None:  # a value went non-finite in the update before the decomposition
        cause = "overflow" if hit.made != "nan" and hit.inputs_finite else "invalid"
        origin = origin_fields(phase="optimizer", op=hit.op, source=hit.source, made=hit.made,
                               params=params, param=param, inputs_finite=hit.inputs_finite,
                               chain=finder.chain())
        what = "overflowed float32 to" if cause == "overflow" else "made"
        hint = (f"{hit.op} in {cls}'s update at step {at} {what} {hit.made} from finite "
                f"values{' at ' + hit.source if hit.source else ''}"
                f"{', in the preconditioner of ' + param if param else ''}"
                f"{_largest_grad(step, param)}; then aten.{op} raised on the non-finite "
                f"matrix: clip the gradients (torch.nn.utils.clip_grad_norm_) before they enter "
                "the preconditioner, lower the learning rate, or scale the gradient before "
                "forming G G^T (accumulate in float64)")
        return finish(report, origin, cause, reproduced=True, hint=hint)
    spd = matrix is not None and finite(matrix) and _spd_in_float64(op, matrix)
    cause = "precision" if spd else "invalid"
    own = f" of {param}'s state" if param else ""
    origin = origin_fields(phase="optimizer", op=f"aten.{op}", source=source, params=params,
                           param=param, inputs_finite=True, detail=(
                               f"aten.{op} in {cls}.step() failed on a finite matrix{own} "
                               f"({str(error).splitlines()[0].rstrip('.')})"))
    hint = (f"aten.{op} in {cls}'s update at step {at} failed on a finite matrix{own}"
            f"{_spectrum(matrix)}, "
            + ("positive-definite in float64 only, float32's rounding made it fail: "
               if spd else "singular or not positive-definite (a preconditioner accumulated "
               "without damping from gradients of lower rank, an input feature that is always "
               "0): ") + _FIX)
    return finish(report, origin, cause, reproduced=True, hint=hint)


def _spd_in_float64(op: str, matrix: torch.Tensor) -> bool:
    """Whether float64 factors the matrix a ``cholesky`` op refused (other ops: False)."""
    if "cholesky" not in op:
        return False
    return bool((torch.linalg.cholesky_ex(matrix.double()).info == 0).all())


def _spectrum(matrix: torch.Tensor | None) -> str:
    """Its extreme eigenvalues in float64, and the rows that are exactly 0 (a feature or unit
    whose gradient was always 0), as text; "" for no square matrix."""
    if matrix is None or matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1] \
            or not finite(matrix):
        return ""
    m = matrix.double()
    lam = torch.linalg.eigvalsh((m + m.T) / 2)
    zero = (m == 0).all(1).nonzero().flatten().tolist()
    rows = (f"; its row{'s' if len(zero) > 1 else ''} {zero[:8]} exactly 0, as if a feature or "
            "unit had a gradient of 0 at every step" if zero else "")
    return (f" ({m.shape[0]}x{m.shape[0]}, eigenvalues from {float(lam[0]):.3g} to "
            f"{float(lam[-1]):.3g} in float64{rows})")


def _largest_grad(step: Step, param: str | None) -> str:
    g = step.tensors.get(f"grads/{param}") if param else None
    return "" if g is None or not g.numel() else (
        f" (its gradient's largest magnitude {float(g.abs().max()):.3g})")

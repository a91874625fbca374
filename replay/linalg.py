"""A step whose decomposition failed (the recorder's ``"linalg"`` event, see
:mod:`recorder.linalg`): the op that raised, the module call running it, and why.

The step is re-run with :class:`_Failing` active: the aten op whose failure ended the run is
named (``aten.linalg_cholesky_ex``: its ``_linalg_check_errors`` raises just after it) with its
matrix. Then:

- a matrix holding NaN/Inf: the value came from an earlier op of that module call, found and
  classified as any forward origin (:func:`replay.forward.find_op_in_call`,
  :func:`replay.cause.classify`);
- a finite matrix: the step is re-run in float64 up to that same op call. Singular (or not
  positive-definite) there too, by its eigenvalues or singular values against float64's
  rounding, or the float64 op failing as well: ``invalid`` (duplicated or constant rows, a
  dead feature, fewer samples than features; a clearly negative eigenvalue: an indefinite
  matrix, :mod:`replay.indefinite`). Positive-definite (invertible) in float64: float32's
  rounding made it fail, ``precision``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from recorder.finite import finite
from recorder.linalg import linalg_reason
from recorder.scripted import hookable_modules

from .buffer_divisor import buffer_divisor_hint
from .cause import classify
from .compat import TorchDispatchMode, running_node, tree_leaves
from .dispatch import run_op
from .errors import StopRun
from .failed_samples import all_zero_hint, failed_matrices
from .few_samples import few_samples_note
from .findings import finish, origin_fields
from .float64_step import in_float64
from .forward import find_op_in_call
from .held_divisor import held_divisor_hint
from .indefinite import indefinite_hint
from .kept_divisor import kept_divisor_hint
from .learned import Learned
from .load import Step
from .loss_maker import made_in_loss
from .negative_scales import NegativeScales, negative_scales_hint
from .node_labels import NodeLabels, loss_labeller
from .recorded import batch_size
from .rerun import Runner
from .source import user_source
from .transforms import outside_transforms
from .zero_matrix import zero_everywhere_hint
from .zero_ridge import Ridges, small_ridge_hint, zero_ridge_hint

# ops whose inputs must be symmetric positive-definite: judged by their eigenvalues
_SPD = ("cholesky", "cholesky_ex", "linalg_cholesky_ex", "cholesky_inverse", "cholesky_solve")
_CHECK = "_linalg_check_errors"  # raises for the op dispatched just before it


@dataclass
class Failed:
    """The op whose failure ended the run: its name, which call of it, its matrix, where."""

    op: str
    occurrence: int
    matrix: torch.Tensor | None
    source: str | None
    within: tuple[str, int, int] | None  # (module, call, micro-batch) running it
    error: str = ""
    raised: bool = True  # (the float64 run's: the op failed there too)
    learned: bool = True  # the model's parameters or buffers went into the matrix
    in_backward: bool = False  # raised by a derivative (a custom Function's KKT solve)
    ridge: torch.Tensor | None = None  # the diagonal an add put on the matrix (zero_ridge)
    negative: dict[str, float] = field(default_factory=dict)  # (replay.negative_scales)


@dataclass
class ModuleCalls:
    """The module calls running (a stack) and how many each module made per micro-batch."""

    runner: Runner
    stack: list[tuple[str, int, int]] = field(default_factory=list)
    counts: dict[tuple[str, int], int] = field(default_factory=dict)
    labels: NodeLabels | None = None  # (the backward's re-run: which module made each node)

    def hooks(self, model):
        hs = []
        for name, m in hookable_modules(model):
            hs.append(m.register_forward_pre_hook(outside_transforms(self._enter(name))))
            hs.append(m.register_forward_hook(outside_transforms(self._leave)))
        return hs

    def _leave(self, m, args, out) -> None:  # (returns None: the output stays the module's)
        if self.stack:
            self.stack.pop()

    def _enter(self, name: str):
        def pre(m, args):
            mb = self.runner.micro_batch
            call = self.counts.get((name, mb), 0)
            self.counts[(name, mb)] = call + 1
            self.stack.append((name, call, mb))
        return pre

    def running(self) -> tuple[str, int, int] | None:
        if self.stack:
            return self.stack[-1]
        mb = self.runner.micro_batch
        if self.runner.in_loss:
            return ("<loss>", 0, mb)
        node = running_node() if self.labels is not None else None
        if node is None or (name := self.labels.names.get(node)) is None:
            return None
        # the backward of a node that module's forward made: its last call's, as it ran last
        return (name, max(self.counts.get((name, mb), 1) - 1, 0), mb)


class _Failing(TorchDispatchMode):
    """Names the op that raised a decomposition's failure; with ``target`` (op, occurrence),
    keeps that call's matrix instead and stops the run after it (the float64 re-run)."""

    def __init__(self, calls: ModuleCalls, target: tuple[str, int] | None = None):
        super().__init__()
        self.calls, self.target = calls, target
        self.seen: dict[str, int] = {}
        self.last: tuple[str, int, list, list] | None = None  # the last op with an info
        self.wrapped: Failed | None = None  # (see _read_info)
        self.failed: Failed | None = None
        # (only the first run's: its matrix is judged, the float64 run's only measured)
        self.learned = Learned(calls.runner.model) if target is None else None
        self.ridges = Ridges() if target is None else None
        self.negative = NegativeScales(calls.runner.model) if target is None else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        k = self.seen.get(name, 0)
        if name != _CHECK:
            self.seen[name] = k + 1
        # (a complex matrix as it is, not its real view: its batch of matrices, its spectrum)
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
               and (t.is_floating_point() or t.is_complex()) and t.dim() >= 2]
        hit = self.target == (name, k)
        if hit:
            self.failed = Failed(name, k, ins[0].detach().clone() if ins else None, None, None,
                                 raised=False)
        try:
            out = run_op(func, args, kwargs)
        except Exception as e:
            if self.target is None and self.failed is None and linalg_reason(e):
                last = self.last if name == _CHECK and self.last is not None \
                    and any(args[0] is t for t in self.last[3]) else (name, k, ins, [])
                op, occ, mats, _ = last
                self.failed = Failed(op, occ, mats[0].detach().clone() if mats else None,
                                     user_source(), self.calls.running(), str(e).split("\n")[0],
                                     learned=not mats or mats[0] in self.learned,
                                     in_backward=running_node() is not None,
                                     ridge=self.ridges.of(mats[0]) if mats else None,
                                     negative=self.negative.of(mats[0] if mats else None))
            elif self.failed is not None and self.target is not None:
                self.failed.raised = True
                raise StopRun from e
            elif self.target is not None and self.failed is None and linalg_reason(e):
                last = self.last if name == _CHECK and self.last is not None else (name, k, ins)
                if last[0] == self.target[0] and last[1] < self.target[1]:
                    # float64 refused an earlier call of the op: singular in float64 already
                    # there (float32's rounding had let that call through)
                    self.failed = Failed(last[0], last[1], last[2][0].detach().clone()
                                         if last[2] else None, None, None, raised=True)
                    raise StopRun from e
            raise
        if self.learned is not None:
            self.learned.track((args, kwargs), out)
            self.ridges.track(name, args, out)
            self.negative.track(name, args, out)
        if self.target is not None and self.failed is not None and name != _CHECK \
                and not hit:
            raise StopRun  # (the op and its check ran: what comes later is not needed)
        infos = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                 and not t.is_floating_point() and not t.is_complex()]
        if infos and name != _CHECK:  # (an ``_ex`` op: its info is what the check reads)
            self.last = (name, k, ins, infos)
            if name.endswith("_ex"):  # (not a comparison of the info: ``info > 0``)
                self._read_info(name, k, ins, infos, hit)
        return out

    def _read_info(self, name, k, ins, infos, hit) -> None:
        """An ``_ex`` op's info read as a library reads it (linear_operator's
        ``psd_safe_cholesky`` retries with jitter, then raises its own ``NotPSDError``, no
        torch check op): the first failing call since the last that succeeded is kept in
        ``wrapped``, the op a library's error names; the float64 run's target call failed
        there too when its info says so."""
        bad = any(bool(i.any()) for i in infos)
        if hit and self.failed is not None:
            self.failed.raised = bad
        elif self.target is None and not bad:
            self.wrapped = None
        elif self.target is None and self.wrapped is None:
            self.wrapped = Failed(name, k, ins[0].detach().clone() if ins else None,
                                  user_source(), self.calls.running(),
                                  learned=not ins or ins[0] in self.learned,
                                  in_backward=running_node() is not None,
                                  ridge=self.ridges.of(ins[0]) if ins else None,
                                  negative=self.negative.of(ins[0] if ins else None))


def failing_op(runner: Runner) -> Failed | None:
    """Re-run the step forward; the decomposition that raised, if one did."""
    calls = ModuleCalls(runner)
    mode = _Failing(calls)
    with mode:
        run = runner.run(backward=False, instrument=False, hooks=calls.hooks)
    if mode.failed is None and mode.wrapped is not None and run.error is not None \
            and linalg_reason(run.error):  # (a library raised its own error from the info)
        mode.wrapped.error = f"{type(run.error).__name__}: {(str(run.error).splitlines() or [''])[0]}"
        return mode.wrapped
    if mode.failed is not None or run.error is not None:
        return mode.failed
    # forward went through: a derivative raised (OptNet's backward solving a singular KKT
    # system), named by the module whose forward made its node
    calls = ModuleCalls(runner, labels=(labels := NodeLabels(lambda node, name: None)))
    mode = _Failing(calls)
    with mode:
        runner.run(instrument=False, hooks=lambda m: calls.hooks(m) + labels.hooks(m),
                   backward_ctx=loss_labeller(runner, labels))
    return mode.failed


def float64_matrix(runner: Runner, failed: Failed) -> Failed | None:
    """The same op call in the step re-run in float64: its matrix, whether it failed too."""
    calls = ModuleCalls(runner)
    mode = _Failing(calls, target=(failed.op, failed.occurrence))
    with in_float64(runner), mode:
        run = runner.run(backward=failed.in_backward, instrument=False, hooks=calls.hooks)
    if mode.failed is None and run.error is not None:
        return None
    return mode.failed


def report_linalg(report, step: Step, runner: Runner, run) -> dict[str, Any] | None:
    """The report of a re-run that a failed decomposition ended; None when it was not one."""
    if run.error is None or not linalg_reason(run.error):
        return None
    failed = failing_op(runner)
    if failed is None or failed.within is None:
        return None
    module, call, mb = failed.within
    phase = "backward" if failed.in_backward else "loss" if module == "<loss>" else "forward"
    origin = origin_fields(phase=phase, module=module,
                           call=call, micro_batch=mb, op=f"aten.{failed.op}", made="LinAlgError",
                           source=failed.source, error=failed.error,
                           inputs_finite=failed.matrix is None or finite(failed.matrix),
                           samples=failed_rows(failed, batch_size(step, mb)))
    if not origin["inputs_finite"]:
        return _non_finite_matrix(report, runner, failed, origin)
    try:
        exact = float64_matrix(runner, failed)
    except Exception as e:  # the model refuses float64
        exact, why = None, f"{type(e).__name__}: {e}"
    else:
        why = "the float64 re-run did not reach the op"
    if exact is None or exact.matrix is None:
        return finish(report, origin, None, reproduced=True, hint=(
            f"aten.{failed.op} failed on a finite matrix; {why}, so whether it is singular in "
            "exact arithmetic is not known: " + _REMEDY["invalid"]))
    of_data = not failed.learned and 0 < len(origin["samples"]) < (batch_size(step, mb) or 0)
    cause, hint = judge(failed.op, failed.matrix, exact, of_data, origin["samples"])
    if cause == "invalid" and failed.negative and "is indefinite" in hint:
        hint = negative_scales_hint(hint, failed.negative, runner.model)
    if exact.occurrence < failed.occurrence:  # (the float64 run stopped at an earlier call)
        hint = hint.replace("(float64 re-run: ", f"(the float64 re-run refused call "
                            f"{exact.occurrence} of it already, {failed.occurrence - exact.occurrence}"
                            " before this one: ", 1)
    if cause == "invalid" and (ridge := zero_ridge_hint(failed.ridge, origin["samples"])):
        # (of data alone, the advice that a ridge would only hide the records is wrong here)
        hint = f"{hint.split('); ', 1)[0]}); {ridge}" if of_data else f"{hint}; {ridge}"
    if "is all zeros, in float64 too" in hint:  # (every sample's too: the model's, no record's)
        runner.reset()  # (the weights as the step began)
        hint = zero_everywhere_hint(failed.op, runner.model, origin["samples"],
                                    batch_size(step, mb)) or hint
    if cause == "precision" and (small := small_ridge_hint(failed.ridge, failed.matrix,
                                                             origin["samples"])):
        hint = f"{hint.split('; ', 1)[0]}; {small}"
    if cause == "precision":
        hint += few_samples_note(failed.matrix, exact.matrix,
                                 batch_size(step, mb), failed.op in _SPD)
    return finish(report, origin, cause, reproduced=True, hint=hint)


def failed_rows(failed: Failed, n: int | None) -> list[int]:
    """The samples whose own matrix failed, for a batch of ``n`` matrices (one per sample,
    dim 0); none for one matrix of the whole batch (a covariance, a kernel), which every
    sample made, nor for matrices of something else (attention heads)."""
    m = failed.matrix
    if m is None or m.dim() != 3 or m.shape[0] != n or m.shape[-1] != m.shape[-2] \
            or not finite(m):
        return []
    info = (torch.linalg.cholesky_ex(m).info if failed.op in _SPD
            else torch.linalg.inv_ex(m).info)
    return info.nonzero().flatten().tolist()


def judge(op: str, m32: torch.Tensor, exact: Failed, of_data: bool = False,
          rows: list[int] = ()) -> tuple[str, str]:
    """``invalid`` or ``precision`` for a finite matrix ``m32`` that made ``op`` fail, from
    the float64 re-run's matrix ``exact`` (the matrices of the failing samples ``rows`` in a
    batch of them); ``of_data``: the batch alone made the matrices, of which only some
    samples' failed (see :mod:`replay.learned`)."""
    whole = exact.matrix.detach()
    whole = whole.to(torch.complex128 if whole.is_complex() else torch.float64)
    a = failed_matrices(whole, list(rows))
    # (the batch elements a's matrices are: the failing samples' when picked out of a batch)
    elements = list(rows) if a is not whole else None if whole.dim() < 3 else \
        list(range(whole.shape[:-2].numel()))
    zero = not of_data and all_zero_hint(op, a, list(rows))
    if zero:
        return "invalid", zero
    n = a.shape[-1]
    spd = op in _SPD
    vals = (torch.linalg.eigvalsh((a + a.mH) / 2) if spd else torch.linalg.svdvals(a))
    lo, hi = float(vals.min()), float(vals.abs().max())
    tol = n * torch.finfo(torch.float64).eps * max(hi, 1e-300)
    what = "eigenvalue" if spd else "singular value"
    said = f"smallest {what} {lo:.3g}, largest {hi:.3g}"
    if spd and lo < 0 and (negative := indefinite_hint(op, a, elements)) is not None:
        return "invalid", negative
    if exact.raised or lo <= tol:
        kind = "not positive-definite" if spd else "rank-deficient" \
            if op == "linalg_lstsq" else "singular"
        remedy = "of_data" if of_data else "invalid" if spd else "singular"
        remedy = "least_squares" if op == "linalg_lstsq" and not of_data else remedy
        return "invalid", (f"aten.{op}: the matrix is {kind} in exact arithmetic too (float64 "
                           f"re-run: {said}); " + _REMEDY[remedy])
    return "precision", (f"aten.{op}: the matrix is {'positive-definite' if spd else 'invertible'}"
                         f" in float64 ({said}, condition {hi / lo:.3g}) but not as "
                         f"{str(m32.dtype).removeprefix('torch.')} rounded it; "
                         + _REMEDY["least_squares" if op == "linalg_lstsq" else "precision"])


_REMEDY = {
    "invalid": "its rows are linearly dependent (duplicated or constant rows, a dead feature, "
               "fewer samples than features, a kernel whose lengthscale collapsed): add a ridge "
               "to the diagonal (A + eps * I, eps scaled to A.diagonal().mean()), or drop the "
               "dependent rows",
    "singular": "its rows are linearly dependent (a zero or duplicated row, fewer samples than "
                "features): use torch.linalg.lstsq or pinv, or add a ridge to the diagonal "
                "(A + eps * I)",
    # (lstsq itself: its advice to use lstsq is no advice; a tall matrix's columns are what
    # its QR driver needs independent)
    "least_squares": "its columns are linearly dependent (a column of zeros: a feature or a "
                     "basis function no sample reaches, a B-spline's basis over a knot span "
                     "no point falls in; duplicated columns), and the driver 'gels' (QR, the "
                     "only one on CUDA) needs full column rank: use driver='gelsd' or "
                     "'gelsy' (CPU), torch.linalg.pinv(A) @ B, or a ridge (solve (A^T A + eps "
                     "* I) x = A^T B)",
    # (replay.learned: no parameter or buffer went into the matrix, some samples' failed)
    "of_data": "it was computed from the batch's data alone (nothing the model learns), so "
               "the records of the samples named are degenerate (a box of zero width or "
               "height, repeated or collinear points, a constant feature): drop or repair "
               "them where the data is made (the dataset, its transforms, the collate_fn); "
               "lstsq, pinv or a ridge would only hide them",
    "precision": "add jitter to the diagonal scaled to the matrix (A + 1e-6 * "
                 "A.diagonal().mean() * I), or use torch.linalg.cholesky_ex and retry with more "
                 "jitter where info > 0, or decompose in float64",
}


def _non_finite_matrix(report, runner: Runner, failed: Failed, origin) -> dict[str, Any]:
    """The decomposition was given NaN/Inf: the op that made it, in the same module call."""
    module, call, mb = failed.within
    if module == "<loss>":  # (a distribution the loss built: LowRankMultivariateNormal)
        return _made_in_the_loss(report, runner, failed, origin)
    finder = find_op_in_call(runner, module, call, mb)
    hit = finder.origin()
    if hit is None:
        return finish(report, origin, None, reproduced=True, hint=(
            f"aten.{failed.op} was given a non-finite matrix, made before the module call "
            "running it (see the chain of the step's recorded history)"))
    cause = classify(runner, "forward", until=failed.within, hit=hit)
    origin.update(op=hit.op, made=hit.made, source=hit.source or origin["source"],
                  samples=hit.rows or [], inputs_finite=True)
    report["problems"].append(f"aten.{failed.op} raised on the {hit.made} that {hit.op} made "
                              f"({failed.error})")
    # (a divisor the model keeps as a buffer, 0 there: named as a forward event's would be)
    hint = cause.name == "invalid" and (
        buffer_divisor_hint(cause.hint, runner.model, finder, hit)
        or held_divisor_hint(cause.hint, cause.name, finder, hit, runner.model.named_buffers())
        or kept_divisor_hint(cause.hint, finder, hit))
    return finish(report, origin, cause.name, reproduced=True, hint=hint or cause.hint)


def _made_in_the_loss(report, runner: Runner, failed: Failed, origin) -> dict[str, Any]:
    """The loss's own op made the matrix non-finite before the decomposition raised on it
    (a capacitance ``I + W^T D^-1 W`` of a ``cov_diag`` of 0): the loss re-run alone names
    it, its samples and why, as a loss event's origin would be."""
    found = made_in_loss(runner, failed.within[2], raised=torch.linalg.LinAlgError)
    if found is None:
        return finish(report, origin, None, reproduced=True, hint=(
            f"aten.{failed.op} was given a non-finite matrix, made before the loss call "
            "running it (see the chain of the step's recorded history)"))
    hit, cause = found
    origin.update(op=hit.op, made=hit.made, source=hit.source or origin["source"],
                  samples=hit.rows or [], inputs_finite=True)
    report["problems"].append(f"aten.{failed.op} raised on the {hit.made} that {hit.op} made "
                              f"({failed.error})")
    return finish(report, origin, cause.name, reproduced=True, hint=cause.hint)

"""A step a ``torch.distributions`` check ended (the recorder's ``"constraint"`` event, see
:mod:`recorder.constraints`), or a torch loss's own check of an argument (``nn.GaussianNLLLoss``
refusing a negative ``var``, read from ``gaussian_nll_loss``'s frame): what made the refused
value, and why.

The re-run raises the same ``ValueError``. Then:

- a NaN/Inf refused (``Normal(loc)`` with a ``0/0`` the root's own forward made): the op that
  made it, found by the op finder over the root's call, and classified as any forward origin;
- a finite value outside the constraint (a scale of 0, a negative one): the values, as the
  check saw them (its frame's ``value`` and ``valid``), with the rows that hold them, and the
  step re-run in float64: refused there too, ``invalid`` (the code gives the distribution a
  value its constraint excludes: a raw linear output as a scale); accepted there, the type's
  rounding made it, ``underflow`` for a 0 (``softplus`` or ``exp`` of a very negative input)
  else ``precision``.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from recorder.compat import view_base
from recorder.constraints import refusal, refuser

from .cause import classify
from .compat import TorchDispatchMode, returns_view, tree_leaves, writes_arguments
from .findings import finish, origin_fields
from .float64_step import in_float64
from .forward import find_op_in_call
from .linalg import ModuleCalls, report_linalg
from .load import Step
from .looked_up_refusal import looked_up_refusal_hint
from .passed_zeros import zeros_maker
from .raised_check import report_check
from .recorded import batch_size
from .refused_data import data_tensor
from .refused_matrix import cholesky_diagonal, is_matrix_refusal, matrix_judge
from .refused_param import entry_valid, param_hint, refused_param
from .refused_rounding import capture, float64_zeros, rounded_hint
from .refused_underflow import positive_underflow
from .refused_value import data_value_hint, of_data, transformed_support
from .rerun import Runner
from .source import raised_at, user_source

# torch's file whose frame (``_validate_args``, ``_validate_sample``) holds the values
_CHECKS = os.path.join("torch", "distributions", "distribution.py")
# a torch loss function's frame whose argument its own check refused, and the entries it
# accepts (recorder.constraints.LOSS_CHECKS)
_FUNCTIONAL = os.path.join("torch", "nn", "functional.py")
_LOSS_ARGS = {"gaussian_nll_loss": ("var", lambda v: v >= 0)}


def report_raised(report, step: Step, runner: Runner, run) -> dict[str, Any] | None:
    """The report of a re-run that an error of the step's own numerics ended (a failed
    decomposition, a distribution refusing a value, the code's own check on a non-finite
    value); None when it was none of them."""
    if (linalg := report_linalg(report, step, runner, run)) is not None:
        return linalg
    if (refused := report_refused(report, step, runner, run)) is not None:
        return refused
    return report_check(report, step, runner, run)  # (the code's own NaN check: raised_check)


def report_refused(report, step: Step, runner: Runner, run) -> dict[str, Any] | None:
    """The report of a re-run a distribution's check ended (see the module's docstring);
    None when ``run`` ended otherwise."""
    said = refusal(run.error) if run.error is not None else None
    if said is None:
        return None
    dist, what, constraint = said
    mb, source = runner.micro_batch, raised_at(run.error)
    refused = f"{refuser(dist)} refused its {what} (constraint {constraint})"
    finder = find_op_in_call(runner, "", 0, mb)
    if (hit := finder.origin()) is not None:  # a NaN/Inf, made by an op of the forward
        module, call = hit.within or ("", 0)
        cause = classify(runner, "forward", until=(module, call, mb), hit=hit)
        origin = origin_fields(phase="forward", module=module, call=call, micro_batch=mb,
                               op=hit.op, made=hit.made, source=hit.source or source,
                               samples=hit.rows or [], inputs_finite=True)
        report["problems"].append(f"{refused} at {source}: the {hit.made} that {hit.op} made")
        return finish(report, origin, cause.name, reproduced=True, hint=cause.hint)
    value, valid, makers = _made(runner)  # a finite value outside the constraint
    data = of_data(what, value)  # (log_prob's value, made of the batch alone)
    value = value.detach() if value is not None else None
    bad = cholesky_diagonal(constraint, value, valid,
                            value[~valid] if value is not None else None)
    zeros = bad is not None and bad.numel() and not bad.any()
    maker = makers[1] if zeros and makers[1] else makers[0]  # (the op that made the 0)
    op, module, where = maker or (None, None, source)
    module = module or ("", 0, mb)  # (an op outside every module call: the root's)
    phase = "loss" if module[0] == "<loss>" else "forward"  # (a distribution in loss_fn)
    matrix = value if is_matrix_refusal(constraint, value) else None
    made = _said(bad[:1]) if bad is not None and bad.numel() else None
    origin = origin_fields(phase=phase, module=module[0], call=module[1], micro_batch=mb,
                           op=op, source=where, inputs_finite=True,
                           made="a matrix not positive-definite" if matrix is not None else made,
                           samples=_rows(value, valid, batch_size(step, mb)))
    report["problems"].append(f"{refused} at {source}")
    if data and (held := data_tensor(step, mb, value, valid)) is not None:
        origin["tensor"] = data = held  # (the data it refused, not the copy that wrote it)
    name = refused_param(runner.model, value)  # (before the float64 re-run casts it)
    cause, hint = _judge(runner, refused, bad, data, matrix,
                         zeros_at=(capture(maker, value), value, valid, constraint), op=op)
    if cause == "invalid" and name is not None:
        origin["param"], hint = name, param_hint(hint, name, refused, value, valid)
    return finish(report, origin, cause, reproduced=True, hint=hint)


class _Makers(TorchDispatchMode):
    """Which op (and module call, and line) wrote each floating tensor last, by storage; and
    which first made its zeros (``zeros``, see replay.passed_zeros)."""

    def __init__(self, calls: ModuleCalls):
        super().__init__()
        self.calls, self.made, self.zeros = calls, {}, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # A view (the check's own value.mT, MultivariateNormal's expand) shares its base's
        # data_ptr and, below autograd, has no _base: it would overwrite the base's maker.
        if returns_view(func) and not writes_arguments(func):
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not t.is_nested \
                    and t.layout == torch.strided and view_base(t) is None:
                made = (f"aten.{func.overloadpacket.__name__}", self.calls.running(),
                        user_source())
                self.made[t.data_ptr()] = made
                self.zeros[t.data_ptr()] = zeros_maker(t, args, kwargs, self.zeros) or made
        return out


def _made(runner: Runner):
    """The step re-run with the op that wrote each tensor kept: the refused value, its mask
    of valid entries and the (op, (module, call, micro-batch), source) of its maker and of the
    op that made its zeros, each None if not seen."""
    calls = ModuleCalls(runner)
    makers = _Makers(calls)
    with makers:
        again = runner.run(backward=False, instrument=False, hooks=calls.hooks)
    value, valid = _checked(again.error) if again.error is not None else (None, None)
    if value is None:
        return None, None, (None, None)
    base = view_base(value)
    key = (value if base is None else base).data_ptr()
    return value, valid, (makers.made.get(key), makers.zeros.get(key))


def _said(first: torch.Tensor) -> str:
    return "0" if not first.any() else f"{float(first):.3g}"


def _checked(error: BaseException) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The value the check refused and its mask of valid entries, from the check's frame."""
    tb, found = error.__traceback__, (None, None)
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_filename.endswith(_CHECKS):
            value, valid = frame.f_locals.get("value"), frame.f_locals.get("valid")
            if isinstance(value, torch.Tensor) and isinstance(valid, torch.Tensor) \
                    and valid.shape == value.shape[:valid.dim()]:  # (a simplex: per vector)
                valid = valid.reshape(*valid.shape, *[1] * (value.dim() - valid.dim()))
                found = value, entry_valid(frame.f_locals, value, valid.expand_as(value))
        elif frame.f_code.co_filename.endswith(_FUNCTIONAL) \
                and (arg := _LOSS_ARGS.get(frame.f_code.co_name)) is not None \
                and isinstance(value := frame.f_locals.get(arg[0]), torch.Tensor):
            with torch.no_grad():
                found = value, arg[1](value.detach())
        tb = tb.tb_next
    return found


def _rows(value, valid, n: int | None) -> list[int]:
    """The samples (dim 0 of the batch's size) holding a refused entry."""
    if value is None or not value.dim() or value.shape[0] != n:
        return []
    return (~valid).reshape(n, -1).any(1).nonzero().flatten().tolist()


def _judge(runner: Runner, refused: str, bad, data: bool | str, matrix=None,
           zeros_at=(None, None, None, None), op: str | None = None) -> tuple[str | None, str]:
    """The cause of the finite refused values ``bad``, by the step re-run in float64;
    ``data``: they are log_prob's value, made of the batch alone (replay.refused_value), the
    recorded tensor's name when one holds them (replay.refused_data);
    ``matrix``: the refused value, a matrix refused as a whole (replay.refused_matrix);
    ``zeros_at``: the capture of its maker op, the value, its mask and the constraint
    (replay.refused_rounding); ``op``: the aten op that made the refused zeros."""
    lo, hi = (float(bad.min()), float(bad.max())) if bad is not None and bad.numel() else (0, 0)
    seen = ("its values" if bad is None or not bad.numel() else
            f"{bad.numel()} value(s) refused, " + (f"all {lo:.3g}" if lo == hi else
                                                   f"from {lo:.3g} to {hi:.3g}"))
    try:
        with in_float64(runner), zeros_at[0] or contextlib.nullcontext():
            again = runner.run(backward=False, instrument=False)
    except Exception:  # the model refuses float64
        return None, f"{refused}: {seen}; the float64 re-run could not run, so whether exact " \
                     "arithmetic gives the same is not known"
    if again.error is not None and refusal(again.error) is not None and matrix is not None:
        value64, valid64 = _checked(again.error)
        if value64 is not None and value64.shape == matrix.shape:
            return matrix_judge(refused, value64, valid64)
    if again.error is not None and refusal(again.error) is not None and data:
        return "invalid", data_value_hint(f"{refused}: {seen}, in float64 too",
                                          transformed_support(again.error),
                                          data if isinstance(data, str) else None)
    zeros = bad is not None and bad.numel() and not bad.any()
    if again.error is not None and refusal(again.error) is not None and zeros \
            and (said := positive_underflow(refused, seen, op)):
        return said
    if again.error is not None and refusal(again.error) is not None and zeros \
            and (table := looked_up_refusal_hint(refused, seen, op, runner.model)):
        return "invalid", table  # (a 0 picked out of a buffer: scVI's library_log_vars[s])
    if again.error is not None and refusal(again.error) is not None:
        return "invalid", (f"{refused}: {seen}, in float64 too: the code gives it values its "
                           "constraint excludes; make the value satisfy it by construction "
                           "(a scale through softplus or exp plus a floor, probabilities "
                           "through softmax, logits instead of probs)")
    if zeros and (said := rounded_hint(refused, seen, float64_zeros(*zeros_at),
                                       zeros_at[1].dtype)):
        return "precision", said
    if zeros:
        return "underflow", (f"{refused}: {seen}; float64 keeps them above 0, so they are "
                             "positive values the type rounded to 0 (softplus, exp or sigmoid of a "
                             "very negative input): add a floor (F.softplus(x) + 1e-4, "
                             "x.exp().clamp_min(1e-6)) or parametrize in log space")
    return "precision", (f"{refused}: {seen}; float64 accepts them, so the type's rounding "
                         "pushed them across the constraint: compute them in float32/float64 "
                         "or clamp them inside it")

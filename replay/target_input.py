"""A model input holding NaN that the model's own forward takes only as the target of a
``torch.nn.functional`` loss: labels computed into the model's loss (a Hugging Face model's
``labels`` under ``problem_type="multi_label_classification"``'s BCE-with-logits, or
``"regression"``'s MSE), not features. Missing labels (a multi-label dataset's unknown
findings read as NaN) are not imputed like features, and ``allow_nan`` cannot help, since the
loss takes them: they are left out of the loss by a mask, or filled by a stated label policy.
Told by re-running the forward once under a torch-function mode that follows the tensor
through layout calls (``view``, ``float``, ``to``) to the first call that computes with it."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .load import Step, autocast_as_recorded, micro_batch_inputs
from .missing_entries import entries_where
from .recorded import origin_key

# the hint; {where}: the samples holding the NaN, and their entries of a (B, L) tensor
TARGET_INPUT = (
    "the batch itself holds NaN in {tensor}, which the model takes only as the target of its "
    "own loss ({loss}): missing labels, not bad features ({where}); the loss cannot skip a "
    "NaN target, and allow_nan cannot help (the loss takes it): leave the missing labels "
    "out of the loss (compute it yourself from the logits with reduction='none', multiplied "
    "by a mask ~{name}.isnan() and averaged over the entries it keeps, with the NaN filled "
    "by 0 first: {name}.nan_to_num(0.0)), or fill them where the data is made by a stated "
    "policy (an unknown binary label as negative, or as positive), or drop the records that "
    "lack them")

# calls that pass the tensor on unchanged in value (a layout, a type, a copy)
PASSED_ON = {"view", "reshape", "flatten", "squeeze", "unsqueeze", "float", "double", "half",
             "bfloat16", "to", "type_as", "contiguous", "clone", "detach", "__getitem__",
             "permute", "transpose", "t", "expand", "expand_as", "view_as", "reshape_as"}


class _FirstUse(TorchFunctionMode):
    """The first call that computes with ``watched`` (or what layout calls made of it), and
    the parameter it was given as."""

    def __init__(self, watched: torch.Tensor):
        super().__init__()
        self.watched = {id(watched): watched}
        self.use: tuple[Any, str | None] | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.use is not None:
            return out
        given = [(k, v) for k, v in _bound(func, args, kwargs) if id(v) in self.watched]
        if given and getattr(func, "__name__", "") in PASSED_ON:
            if isinstance(out, torch.Tensor):
                self.watched[id(out)] = out  # (kept alive: ids stay unique)
        elif given:
            self.use = (func, given[0][0])
        return out


def _bound(func, args, kwargs) -> list[tuple[str | None, Any]]:
    """(parameter name or None, value) of each argument of a call."""
    try:
        bound = inspect.signature(func).bind(*args, **kwargs)
        return list(bound.arguments.items())
    except (TypeError, ValueError):
        return [(None, a) for a in (*args, *kwargs.values())]


def loss_taking(step: Step, origin: dict[str, Any]) -> str | None:
    """The ``torch.nn.functional`` loss (``F.binary_cross_entropy_with_logits``) whose
    ``target`` is the first use of the input origin's batch tensor in the model's forward
    re-run on its micro-batch; None for any other first use, or a forward that raised."""
    key, _ = origin_key(step, origin)
    if not key or step.model is None or origin.get("made") != "nan":
        return None
    i = origin.get("micro_batch") or 0
    model = step.model
    kept = {n: b.detach().clone() for n, b in model.named_buffers()}
    try:
        made: dict[str, torch.Tensor] = {}
        args, kwargs = micro_batch_inputs(step, i, made)
        if key not in made:
            return None
        mode = _FirstUse(made[key])
        with torch.no_grad(), autocast_as_recorded(step.micro_batches[i], step.device), mode:
            model(*args, **kwargs)
    except Exception:
        return None
    finally:
        with torch.no_grad():  # (a BatchNorm's running statistics: as the bundle holds them)
            for n, b in model.named_buffers():
                if n in kept and kept[n].shape == b.shape:
                    b.copy_(kept[n])
    func, param = mode.use or (None, None)
    if func is None or param != "target" \
            or getattr(func, "__module__", "") != "torch.nn.functional":
        return None
    return f"F.{func.__name__}"


def target_input_hint(step: Step, origin: dict[str, Any]) -> str | None:
    """The hint of an input event on a batch tensor the model takes only as its loss's
    target; None for any other."""
    tensor = origin.get("tensor") or ""
    if tensor.startswith("loss_") or not (loss := loss_taking(step, origin)):
        return None
    t = step.tensors.get(origin_key(step, origin)[0])
    rows = origin.get("samples") or []
    where = f"sample(s) {', '.join(map(str, rows))}" if rows else "no sample rows"
    if t is not None and t.dim() == 2 and rows:  # (records by labels: which of them)
        where = entries_where(torch.isnan(t)).replace("feature(s)", "entries")
    name = tensor.split('"')[1] if tensor.startswith("kwargs[") else origin.get("arg", "target")
    return TARGET_INPUT.format(tensor=tensor, loss=loss, where=where, name=name)

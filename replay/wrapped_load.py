"""A recorded wrapper-subclass parameter (QLoRA's int8 base weight: ``recorder.wrapped``) put
into the factory's model as a tensor of its own class, rebuilt from the bundle's inner tensors
(``wrapped/<key>/<attr>``) with ``__tensor_unflatten__``: the re-run then dequantizes as the
run did. Loading the bundle's dense value instead would make it a plain weight, and the step's
arithmetic (and the op the replay names) another."""

from __future__ import annotations

from typing import Any

import torch

from recorder.wrapped import PREFIX, is_wrapper

from .errors import ReplayError

__all__ = ["as_recorded", "finite_parts", "non_finite_inner", "plain_parts", "rebuilt",
           "wrapped_entry"]


def wrapped_entry(step, key: str) -> dict[str, Any] | None:
    """The bundle's description of wrapper tensor ``key`` (``weights/proj.weight``), if any."""
    entry = (step.meta.get("wrapped") or {}).get(key)
    return entry if isinstance(entry, dict) else None


def _class_name(t: torch.Tensor) -> str:
    return f"{type(t).__module__}.{type(t).__qualname__}"


def _unflatten(step, key: str, entry: dict[str, Any], like: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``entry`` describes, of ``like``'s class (None when ``like`` is another)."""
    if not is_wrapper(like) or _class_name(like) != entry.get("class") \
            or not hasattr(like, "__tensor_flatten__"):
        return None
    attrs, ctx = like.__tensor_flatten__()
    if list(attrs) != entry.get("inner") or (entry.get("context") is not None
                                             and entry["context"] != ctx):
        return None  # (another layout: the recorded flatten context, when kept, must agree)
    inner = {}
    for a in attrs:
        nested = (entry.get("nested") or {}).get(a)
        if nested is not None:
            inner[a] = _unflatten(step, f"{key}/{a}", nested, getattr(like, a))
        else:
            t = step.tensors.get(f"{PREFIX}{key}/{a}")
            mine = getattr(like, a)
            inner[a] = None if t is None or t.shape != mine.shape or t.dtype != mine.dtype \
                else t.to(step.device or t.device)
        if inner[a] is None:
            return None
    return type(like).__tensor_unflatten__(inner, ctx, like.shape, like.stride())


def non_finite_inner(step, key: str) -> str | None:
    """The first inner tensor of recorded wrapper ``key`` holding NaN/Inf, with its rows."""
    for k, t in step.tensors.items():
        if k.startswith(f"{PREFIX}{key}/") and t.is_floating_point() and t.numel() \
                and not bool(t.isfinite().all()):
            rows = (~t.isfinite()).reshape(len(t), -1).any(1).nonzero().flatten().tolist() \
                if t.dim() else []
            at = f" (row(s) {', '.join(map(str, rows[:8]))} of {len(t)})" if t.dim() else ""
            return f"{k.removeprefix(f'{PREFIX}{key}/')!r} was non-finite{at}"
    return None


def rebuilt(step, key: str, like: torch.Tensor) -> torch.Tensor | None:
    """Recorded wrapper tensor ``key`` rebuilt as ``like``'s class (the factory's parameter),
    or None when it was not one. A factory building another class or layout gets a note: the
    re-run then holds the dense value, and its arithmetic may differ from the run's."""
    entry = wrapped_entry(step, key)
    if entry is None:
        return None
    new = _unflatten(step, key, entry, like)
    if new is not None and (bad := non_finite_inner(step, key)):
        step.problems.append(
            f"{key.removeprefix('weights/')} is a {entry.get('class')} tensor subclass whose "
            f"inner tensor {bad} as the step began: it dequantizes to non-finite values (the "
            "quantization that made it, an all-zero block's scale, or a write into it)")
    if new is None:
        step.problems.append(
            f"{key} was a {entry.get('class')} tensor in the run, but the factory's is a "
            f"{_class_name(like)} of another layout: the re-run uses its dense value "
            "(its arithmetic may differ from the run's); build it as the run did in the factory")
    return new


def plain_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s values: ``t`` itself, or a wrapper subclass's inner
    tensors (``__tensor_flatten__``, nested ones in turn; none when it has no such method)."""
    if not is_wrapper(t):
        return [t]
    if not hasattr(t, "__tensor_flatten__"):
        return []
    return [q for a in t.__tensor_flatten__()[0] for q in plain_parts(getattr(t, a))]


def finite_parts(p: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A wrapper subclass ``p``'s floating inner tensors made finite in place (NaN, ±inf: 0),
    as (tensor, copy of its value before) to put back with ``copy_``. Setting ``p.data`` does
    not reach them: the subclass computes from its inner tensors."""
    saved = [(q, q.clone()) for q in plain_parts(p) if q.is_floating_point()]
    with torch.no_grad():
        for q, _ in saved:
            q.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    return saved


def as_recorded(step, key: str, like: torch.Tensor) -> torch.Tensor:
    """Bundle tensor ``key`` as the replay loads it into ``like``'s place: rebuilt as its
    wrapper subclass when it was one (:func:`rebuilt`), else the bundle's tensor."""
    new = rebuilt(step, key, like)
    t = step.tensors[key] if new is None else new
    if like.requires_grad and not (t.is_floating_point() or t.is_complex()):
        # (a trained parameter cannot hold integers: torch would refuse it deep in the load)
        raise ReplayError(f"{key} is {t.dtype} in the bundle but a trained {like.dtype} "
                          "parameter in the model from the factory; the file is corrupted or "
                          "was written for another model: pass the bundle the recorder wrote")
    return t

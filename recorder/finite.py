"""What kind of non-finite value a tensor holds, and where: the one place both packages ask.

Kinds are ``"nan"``, ``"+inf"`` and ``"-inf"``; NaN wins over an infinity (it is the worse
news, and a NaN anywhere is an event under every policy). Functions that return a Python
value read the device; the ``*_flag`` ones stay on it, for the recorder's hot path.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable

import torch

from .compat import sparse_rows, sparse_values

KINDS = ("nan", "+inf", "-inf")
LABELS = {"nan": "NaN", "+inf": "+Inf", "-inf": "-Inf", "inf": "Inf", "scale": "AMP scale"}


def label(kind: str | None) -> str | None:
    """How reports spell a kind: ``"nan"`` -> ``"NaN"``, ``"+inf"`` -> ``"+Inf"``."""
    return LABELS.get(kind, kind) if kind is not None else None


def matches(name: str, patterns: Iterable[str]) -> bool:
    """Whether ``name`` matches one of the ``allow_inf`` patterns (fnmatch, case-sensitive), or
    is one: a root input's name ``args[1]`` is a pattern whose ``[1]`` fnmatch reads as a
    character class (it matches ``args1``, never ``args[1]``)."""
    return any(name == p or fnmatch.fnmatchcase(name, p) for p in patterns)


def checkable(t: torch.Tensor) -> bool:
    """A floating (or complex) tensor with values to check: dense and non-empty, or sparse
    with specified values."""
    return (t.is_floating_point() or t.is_complex()) and t.numel() > 0 and (
        t.layout == torch.strided or stored(t).numel() > 0)


def real_view(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor as its real view (``[..., 2]``, its samples still in dim 0): min, max
    and sums see a NaN or +-Inf in either part; other tensors unchanged."""
    if not t.is_complex():
        return t
    return torch.view_as_real(t.detach().resolve_conj().resolve_neg())  # (a conj view has none)


def stored(t: torch.Tensor) -> torch.Tensor:
    """The values a tensor stores: itself, a sparse tensor's specified values (a sparse
    gradient of ``nn.Embedding(sparse=True)``; its implicit zeros are finite), or a nested
    tensor's elements as one vector (``nn.TransformerEncoder``'s fast path, in eval mode with
    a padding mask, passes its layers nested tensors, which most reductions refuse)."""
    if t.is_nested:
        return torch.cat([c.reshape(-1) for c in t.unbind()])
    return t if t.layout == torch.strided else sparse_values(t)


# the 1-byte float dtypes (hand-written FP8 training casts to and from them)
FLOAT8 = frozenset(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                "float8_e5m2fnuz", "float8_e8m0fnu")
                   if hasattr(torch, n))


def ends(t: torch.Tensor) -> torch.Tensor:
    """(min, max) of a real floating tensor as a float64 pair, on its device. NaN propagates
    into both and +-Inf shows as an extreme, so the pair tells every kind in one reduction
    pass, where ``isfinite(t).all()`` takes a full-size temporary (and, on CPU, longer)."""
    return torch.stack(extrema(t.detach())).double()


def extrema(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.aminmax`` of ``t``'s stored values; (0, 0) when it has none (an empty batch,
    Poisson sampling's draw of no sample), whose finiteness nothing contradicts."""
    values = stored(t)
    if values.dtype in FLOAT8:  # (aminmax has no float8 kernel)
        values = values.float()
    if values.numel():
        return torch.aminmax(values)
    zero = values.new_zeros(())
    return zero, zero


F32_MAX = torch.finfo(torch.float32).max


def as_float32(v: torch.Tensor) -> torch.Tensor:
    """A float64 statistic as a float32 slot can hold it without making a finite value
    infinite: NaN and +-Inf as they are, a finite value beyond float32's range at float32's
    largest (a float64 model's output of -2.7e117 is finite, no -Inf to stop the run for)."""
    return torch.where(v.isinf(), v, v.clamp(-F32_MAX, F32_MAX))


def pair_kind(lo: float, hi: float) -> str | None:
    """The kind an :func:`ends` pair shows, None when both are finite."""
    if math.isnan(lo) or math.isnan(hi):
        return "nan"
    if hi == math.inf:
        return "+inf"
    if lo == -math.inf:
        return "-inf"
    return None


# a ref's allowance beside False (finite) and True (NaN-free): anything (an allow_nan input)
ANY = 2


def pair_ok(lo: float, hi: float, allow_inf: bool | int = False) -> bool:
    """An :func:`ends` pair is finite (NaN-free, with ``allow_inf``; anything with ``ANY``)."""
    if allow_inf == ANY:
        return True
    if allow_inf:
        return not (math.isnan(lo) or math.isnan(hi))
    return math.isfinite(lo) and math.isfinite(hi)


def finite_flag(t: torch.Tensor, allow_inf: bool = False) -> torch.Tensor:
    """:func:`finite` as a 0-d bool tensor on ``t``'s device (no host read)."""
    if not checkable(t):
        return torch.ones((), dtype=torch.bool, device=t.device)
    if t.is_complex():
        t = stored(t)
        return ~(torch.isnan(t) if allow_inf else ~torch.isfinite(t)).any()
    return pair_flag(ends(t), allow_inf)


def finite(t: torch.Tensor, allow_inf: bool = False) -> bool:
    """No NaN/Inf in ``t`` (no NaN, with ``allow_inf``); True for non-floating tensors."""
    return not checkable(t) or bool(finite_flag(t, allow_inf))


def kind_of(t: torch.Tensor) -> str | None:
    """The kind ``t`` holds (NaN first), None when finite or not floating."""
    if not checkable(t):
        return None
    if t.is_complex():
        t = torch.view_as_real(t)
    return pair_kind(*ends(t).tolist())


def tensors_kind(tensors: Iterable[torch.Tensor]) -> str | None:
    """The worst kind any of ``tensors`` holds: NaN if any has one, else +Inf, else -Inf."""
    found = {kind_of(t.detach()) for t in tensors}
    return next((k for k in KINDS if k in found), None)


def bad_rows(t: torch.Tensor, dim: int = 0) -> list[int]:
    """Indices along ``dim`` holding a non-finite value (a 0-d tensor: ``[0]`` if it is)."""
    if t.is_nested and dim == 0:  # its components
        return [i for i, c in enumerate(t.unbind()) if not finite(c)]
    if not checkable(t):
        return []
    if t.layout == torch.sparse_coo and dim == 0:  # the rows of the specified values
        rows, values = sparse_rows(t.detach())
        bad = ~torch.isfinite(values).reshape(values.shape[0], -1).all(dim=1)
        return rows[bad].unique().tolist()
    if t.layout != torch.strided:
        t = t.to_dense()
    bad = ~torch.isfinite(t.detach())
    if t.dim() == 0:
        return [0] if bool(bad) else []
    bad = bad.movedim(dim, 0)
    return bad.reshape(bad.shape[0], -1).any(dim=1).nonzero().flatten().tolist()


def pair_flag(e: torch.Tensor, allow_inf: bool = False) -> torch.Tensor:
    """:func:`pair_ok` on the device: an :func:`ends` pair's finiteness (NaN-freedom, with
    ``allow_inf``) as a 0-d bool tensor, for flags that accumulate before one host read."""
    return ~torch.isnan(e).any() if allow_inf else torch.isfinite(e).all()


def flags_kind(nan: bool, posinf: bool, neginf: bool) -> str | None:
    """The kind that a call's decoded flags show (NaN first), None when none is set."""
    if nan:
        return "nan"
    if posinf:
        return "+inf"
    return "-inf" if neginf else None


def has_nan(t: torch.Tensor) -> bool:
    """``t`` holds a NaN (the one non-finite value every policy counts); False if not floating."""
    return checkable(t) and bool(torch.isnan(stored(t.detach())).any())


def additive_mask(t: torch.Tensor) -> bool:
    """``t`` is an additive attention mask: a real floating tensor whose values are all 0 or
    -inf (``nn.Transformer.generate_square_subsequent_mask``, a padding mask built by hand)."""
    if not (t.is_floating_point() and t.numel() and t.layout == torch.strided
            and not t.is_nested):
        return False
    d = t.detach()
    return bool(((d == 0) | (d == -math.inf)).all())


def zero_one(t: torch.Tensor) -> bool:
    """Every value of ``t`` is 0 or 1: a 0/1 mask, a label, an indicator, whose values are
    classes, not magnitudes (and whose rows of 0 are records with nothing set)."""
    return bool(((t == 0) | (t == 1)).all())


def only_mask_infinities(tensors: Iterable[torch.Tensor]) -> bool:
    """Some of ``tensors`` hold a non-finite value, and each such is an additive mask: the
    -inf there is intended (by the default policy, no event), unlike a data tensor's."""
    bad = [t for t in tensors if isinstance(t, torch.Tensor) and checkable(t) and not finite(t)]
    return bool(bad) and all(additive_mask(t) for t in bad)


def inf_read_finite(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` with their +-Inf read as 0 and their NaN kept: the rows of a NaN in a model
    output that ``allow_inf`` lets hold +-Inf (wav2vec 2.0's -inf logits, whose rows are no
    samples of a NaN made of the whole batch)."""
    return [t.nan_to_num(0.0, 0.0, 0.0).masked_fill(t.isnan(), math.nan)
            if t.is_floating_point() else t for t in tensors]

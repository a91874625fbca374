"""A forward division 0/0 exactly in the rows of a parameter that are all 0: weight
normalisation (``W_dec / W_dec.norm(dim=-1, keepdim=True)``, a cosine classifier's
``w / w.norm(dim=1)``) of a row no update made 0 but code wrote so (a sparse autoencoder's
dead latents resampled from an input of zeros, a reset of dead units, a mask). The generic
advice for weights (keep a parametrisation off its pole) does not say which rows, nor that
they were written; structured pruning's mask is :mod:`replay.pruned`'s. Also a buffer's rows
the code has not written yet: a retriever's bank of EMA-refreshed document embeddings started
at zeros, ``bank / bank.norm(dim=-1, keepdim=True)`` before every document was encoded once.
In the user's own parametrization (``register_parametrization(lin, "weight", UnitRows())``)
the division runs in ``lin.parametrizations.weight.0`` and divides the parameter torch keeps
as ``lin.parametrizations.weight.original``, which the first of the chain takes as its
argument: that parameter is named by the user's name, ``lin.weight``.
And a parameter 0 everywhere, every entry of the division NaN: a zero initialisation of a
weight the forward normalises (a tau-normalised or cosine classifier re-initialised to zeros
for decoupled re-training, ``w / w.norm(dim=1)**tau``); under the hook-based
``torch.nn.utils.spectral_norm``, its ``weight_orig`` divided by a largest singular value of 0.
"""

from __future__ import annotations

import re

import torch

__all__ = ["zero_param_rows_hint"]

_DIVISIONS = {"aten.div", "aten.true_divide"}
SHOWN = 8  # rows named in the hint
# the first parametrization of a chain (``owner.parametrizations.tensor.0``): its argument is
# the chain's ``original`` (a later one takes the output of the one before it)
_FIRST = re.compile(r"^(?:(?P<owner>.*)\.)?parametrizations\.(?P<tensor>[^.]+)\.0$")


def zero_param_rows_hint(model: torch.nn.Module, module: str | None, hit) -> str | None:
    """The hint for ``hit``, a division that made NaN (0/0) in module ``module``, whose
    non-finite output entries are exactly the rows (along one dim) of one of the module's
    parameters of the output's shape that are all 0 (or every entry, of a parameter 0
    everywhere); else None."""
    ev = hit.evidence if hit is not None else None
    if ev is None or hit.op not in _DIVISIONS or hit.made != "nan" or module is None:
        return None
    try:
        sub = model.get_submodule(module)
    except AttributeError:
        return None
    at = f"{module}." if module else ""
    held = [(n, at + n, b, _says_buffer) for n, b in sub.named_buffers()
            if b.is_floating_point()]
    for own, name, p, says in [(n, at + n, p, _says) for n, p in sub.named_parameters()] \
            + _chain_original(model, module) + held:
        if p.dim() < 2 or tuple(p.shape) != tuple(ev.bad.shape):
            continue
        for d in range(p.dim()):
            zero = (p.detach().movedim(d, 0).reshape(p.shape[d], -1) == 0).all(1)
            bad = ev.bad.movedim(d, 0).reshape(p.shape[d], -1).any(1)
            if says is _says and d == 0 and bool(zero.all()) and bool(bad.all()):
                return _says_whole(hit.op, name, _spectral(sub, own))
            if bool(zero.any()) and not bool(zero.all()) and torch.equal(bad, zero):
                return says(hit.op, name, d, zero.nonzero().flatten().tolist())
    return None


def _chain_original(model: torch.nn.Module, module: str) -> list:
    """``[(attribute, name, tensor, says)]`` for the ``original`` that the user's
    parametrization ``module`` takes as its argument (the first of its chain), named as the
    user knows it: ``lin.weight (kept by torch as lin.parametrizations.weight.original)``;
    else []."""
    if (site := _FIRST.match(module)) is None:
        return []
    chain = module.rsplit(".", 1)[0]
    try:
        original = model.get_submodule(chain).original
    except AttributeError:
        return []  # (original0, original1: a parametrization of several tensors)
    owner = f"{site['owner']}." if site["owner"] else ""
    says = _says if isinstance(original, torch.nn.Parameter) else _says_buffer
    return [("original", f"{owner}{site['tensor']} (kept by torch as {chain}.original)",
             original, says)]


def _shown(rows: list[int]) -> str:
    return ", ".join(map(str, rows[:SHOWN])) + (f", ... ({len(rows)} in all)"
                                                if len(rows) > SHOWN else "")


def _says_buffer(op: str, name: str, dim: int, rows: list[int]) -> str:
    # (no optimizer writes a buffer: the code that fills it has not reached these slices)
    return (f"{op} of 0 by 0 (0/0) exactly where the buffer {name} is 0 in whole slices "
            f"along dim {dim} ({_shown(rows)}), as this step began, and the forward divides "
            "by their norm (or sum); every sample meets them, no record is to blame. A buffer "
            "the code fills as it trains (a bank or index of EMA-refreshed embeddings, a "
            "queue, a codebook) is 0 where it started at zeros and no update has written yet: "
            "fill every slice before training (encode every document once, as REALM builds "
            "its index; random unit vectors, as MoCo's queue), skip the slices not written "
            "yet, or clamp the divisor (x.norm(dim, keepdim=True).clamp_min(eps), "
            "F.normalize)")


def _says(op: str, name: str, dim: int, rows: list[int]) -> str:
    return (f"{op} of 0 by 0 (0/0) exactly where the parameter {name} is 0 in whole slices "
            f"along dim {dim} ({_shown(rows)}), as this step began: a norm, sum or std over such a "
            "slice is 0 and the forward divides by it (weight normalisation: "
            "w / w.norm(dim, keepdim=True)). No gradient step zeroes a whole slice exactly: "
            "code wrote it (a resampling or re-initialisation of dead units from an input of "
            "zeros, a reset of their weights, a mask, a zero init): write a non-zero direction "
            "there (or skip those units), or clamp the divisor "
            "(w.norm(dim, keepdim=True).clamp_min(eps), F.normalize)")


def _spectral(sub: torch.nn.Module, name: str) -> bool:
    """Whether ``name`` is the ``<w>_orig`` of the hook-based ``torch.nn.utils.spectral_norm``
    (its power-iteration vectors ``<w>_u`` and ``<w>_v`` beside it; pruning's ``_orig`` has a
    ``_mask`` instead)."""
    base = name.removesuffix("_orig")
    return base != name and all(isinstance(getattr(sub, f"{base}_{k}", None), torch.Tensor)
                                for k in "uv")


def _says_whole(op: str, name: str, spectral: bool = False) -> str:
    if spectral:  # (weight = weight_orig / sigma, computed by its forward pre-hook)
        return (f"{op} of 0 by 0 (0/0) in every entry: the parameter {name} is 0 everywhere as "
                "this step began, and torch.nn.utils.spectral_norm's forward pre-hook divides "
                "it by its largest singular value, 0 for a matrix of zeros; every sample meets "
                "it, no record is to blame. No gradient step zeroes a whole weight exactly: it "
                "was initialised to zeros before spectral_norm was applied (nn.init.zeros_, a "
                "zero-initialised head): initialise it nonzero (the layer's own "
                "reset_parameters, a small normal), or leave that layer out of spectral_norm")
    return (f"{op} of 0 by 0 (0/0) in every entry: the parameter {name} is 0 everywhere as "
            "this step began, and the forward divides it by its norm (or sum) over each slice, "
            "0 too (weight normalisation: w / w.norm(dim, keepdim=True) ** tau); every sample "
            "meets it, no record is to blame. No gradient step zeroes a whole weight exactly: "
            "it was initialised or re-initialised to zeros (nn.init.zeros_, a classifier reset "
            "to 0 for re-training on a re-balanced sampler, as cRT re-trains a tau-normalised "
            "one): initialise it nonzero (the layer's own reset_parameters, a small normal), "
            "or clamp the divisor (w.norm(dim, keepdim=True).clamp_min(eps), F.normalize)")

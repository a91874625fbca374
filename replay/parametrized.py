"""An op that went non-finite inside a parametrization torch registered on a layer
(``torch.nn.utils.parametrizations.weight_norm``'s ``_WeightNorm``, ``spectral_norm``'s
``_SpectralNorm``): the code is torch's, so the hint's "add an eps to the denominator" cannot be
followed. Such a parametrization divides its parameter ``original`` (``original0`` and
``original1``: weight_norm's magnitude and direction) by a norm of it, which is 0 where the
parameter is 0 (a layer initialised to zeros, a common trick for a last layer, then put under
the parametrization). This names that parameter and its rows of zeros; so for the hook-based
``torch.nn.utils.weight_norm``, whose ``weight_v`` is divided by its norm the same way."""

from __future__ import annotations

import re

import torch

from .load import Step

# (weight_norm's parameters: original0 the magnitude g, original1 the direction v)
_WEIGHT_NORM = (" (to start the layer at 0, zero its magnitude original0 instead: g * v / |v| "
                "is then 0, and finite)")
_SITE = re.compile(r"^(?:(?P<owner>.*)\.)?parametrizations\.(?P<tensor>[^.]+)\.\d+$")
_ORIGINAL = re.compile(r"^(?:(?P<owner>.*)\.)?parametrizations\.(?P<tensor>[^.]+)"
                       r"\.original\d*$")
# what to do about the parameter ``original`` of a parametrization that an op took as is
_IN_ITS_FORWARD = {
    "overflow": "bound it in that parametrization's forward, where it arrives as the "
                "argument (clamp it there before the op, x.clamp(max=...), or make the value "
                "with softplus in place of exp) or lower its learning rate",
    "invalid": "keep it in the op's domain in that parametrization's forward, where it "
               "arrives as the argument (clamp it there, or make the value with exp or "
               "softplus of it)",
}
_IN_TORCH = ("torch's code, which takes no clamp: keep the parameter in range by its updates "
             "(a lower learning rate, gradient clipping, weight decay)")


def _torch_site(step: Step, module: str | None):
    """(the name's match, the class) of ``module`` when it is one of torch's own
    parametrization modules (``owner.parametrizations.tensor.k``) in the rebuilt model."""
    site = _SITE.match(module or "")
    if site is None or step.model is None:
        return None
    try:
        kind = type(step.model.get_submodule(module))
    except AttributeError:
        return None
    return (site, kind) if kind.__module__.startswith("torch.") else None


def parametrization_hint(step: Step, module: str | None, op: str | None) -> str | None:
    """The hint for an ``invalid`` op of torch's parametrization module ``module`` whose own
    parameter holds rows of zeros (or of a layer under the hook-based weight_norm), else
    None."""
    if _SITE.match(module or "") is None and step.model is not None:
        return _legacy_weight_norm(step, module or "", op)
    if (found := _torch_site(step, module)) is None:
        return None  # (none, or a parametrization of the user's own: its code takes an eps)
    site, kind = found
    owner, tensor = site["owner"], site["tensor"]
    prefix = f"{owner + '.' if owner else ''}parametrizations.{tensor}."
    names = sorted(k.removeprefix("weights/") for k in step.tensors
                   if k.startswith(f"weights/{prefix}original"))
    # (weight_norm's magnitude original0 multiplies: only its direction original1 divides)
    for name in [n for n in names if not n.endswith(".original0")] or names:
        where = _zero_rows(step.tensors[f"weights/{name}"])
        if where is None:
            continue
        head = (f"{op or 'an op'} in torch's {kind.__name__} parametrization of "
                f"{owner + '.' if owner else ''}{tensor} divides by a norm of its parameter "
                f"{name}, which {where}")
        if "original1" in name and where.startswith("has "):
            return head + _switched_off(f"{prefix}original0")
        return (head + ": a layer initialised to zeros (nn.init.zeros_) or driven there by its "
                "updates has norm 0 and the parametrization 0/0; initialise that parameter "
                "nonzero" + (_WEIGHT_NORM if "original1" in name else ""))
    return None


def parametrization_range_hint(step: Step, module: str | None, op: str | None, hint: str | None,
                               cause: str) -> str | None:
    """For an op of torch's own parametrization module ``module`` (``orthogonal``'s
    ``matrix_exp``) that overflowed or lost precision on a parameter grown huge: ``hint``'s
    diagnosis, with the advice that fits torch's code (which takes no rescaling, no row max,
    no eps): keep the parameter in range by its updates; else None."""
    if hint is None or cause not in ("overflow", "precision") \
            or (found := _torch_site(step, module)) is None:
        return None  # (or the user's own: its code can be rescaled, as the hint says)
    site, kind = found
    owner = f"{site['owner']}." if site["owner"] else ""
    prefix = f"{owner}parametrizations.{site['tensor']}."
    held = {k.removeprefix("weights/"): t for k, t in step.tensors.items()
            if k.startswith(f"weights/{prefix}original") and t.is_floating_point() and t.numel()}
    if not held:
        return None
    name, largest = max(((n, float(t.abs().max())) for n, t in held.items()),
                        key=lambda nt: nt[1])
    said = hint.split(": rescale its inputs")[0] if ": rescale its inputs" in hint else hint
    return (f"{said}; {op or 'the op'} runs in torch's {kind.__name__} parametrization of "
            f"{owner}{site['tensor']}, on its parameter {name} (|values| up to {largest:.3g}): "
            "torch's code takes no rescaling there, so keep that parameter in range by its "
            "updates (a lower learning rate, clipping the gradient norm; a write of a huge "
            "value, a checkpoint's, is a bug of its own) or compute that layer in float64")


def parametrized_advice(step: Step | None, param: str | None, cause: str) -> str | None:
    """What to do about ``param`` when it is a parametrization's ``original`` (the value the
    optimizer trains, which the model reads only through the parametrization's forward, as
    ``OWNER.TENSOR``: the place to bound it is that forward, not a use of the name), else
    None."""
    site = _ORIGINAL.match(param or "")
    if site is None or cause not in ("overflow", "invalid", "precision"):
        return None
    owner = f"{site['owner']}." if site["owner"] else ""
    made, where = f"{owner}{site['tensor']}", f"{owner}parametrizations.{site['tensor']}"
    try:
        kinds = [type(m) for m in step.model.get_submodule(where)] if step else []
    except (AttributeError, TypeError):
        kinds = []
    names = ", ".join(k.__name__ for k in kinds) or "register_parametrization"
    said = f"torch keeps it for the parametrization that makes {made} ({names} in {where})"
    if kinds and all(k.__module__.startswith("torch.") for k in kinds):
        return f"{said}; its forward is {_IN_TORCH}"
    return f"{said}: {_IN_ITS_FORWARD['invalid' if cause == 'precision' else cause]}"


def _legacy_weight_norm(step: Step, module: str, op: str | None) -> str | None:
    """The hook-based ``torch.nn.utils.weight_norm`` (HiFi-GAN's and many vocoders' own code),
    told by the pair of parameters it leaves on the layer, ``NAME_g`` and ``NAME_v`` in place
    of ``NAME``: the hook computes ``g * v / |v|`` before each forward, 0/0 in a row of ``v``
    all 0."""
    prefix = f"{module}." if module else ""
    for key in sorted(step.tensors):
        name = key.removeprefix("weights/")
        if not key.startswith(f"weights/{prefix}") or not name.endswith("_v") \
                or "." in name[len(prefix):] or f"weights/{name[:-2]}_g" not in step.tensors:
            continue
        where = _zero_rows(step.tensors[key])
        if where is None:
            continue
        head = (f"{op or 'an op'} in torch's hook-based weight_norm of {prefix}"
                f"{name[len(prefix):-2]} (torch.nn.utils.weight_norm: g * v / |v| before each "
                f"forward) divides by the norm of {name}, which {where}")
        if where.startswith("has "):
            return head + _switched_off(f"{name[:-2]}_g")
        return (head + ": a layer initialised to zeros (nn.init.zeros_) and then put under "
                "weight_norm has norm 0 and the weight 0/0; initialise it nonzero (to start "
                f"the layer at 0, zero {name[:-2]}_g instead: the weight is then 0, and "
                "finite)")
    return None


def _switched_off(magnitude: str) -> str:
    """The advice for some rows of a weight-normed direction all 0, the rest not: rows the run
    zeroed (a structured pruning of units, a write, updates that drove them there), which no
    initialisation fixes."""
    return (": rows zeroed by the run (a pruning of units, a write of 0, updates that drove "
            "them there) have norm 0 and the weight 0/0 in them; to switch such units off, "
            f"zero the same rows of the magnitude {magnitude} instead and leave the direction "
            "nonzero (g * v / |v| is then 0 in them, and finite)")


def _zero_rows(w: torch.Tensor) -> str | None:
    """What of ``w`` is 0 along its first dimension ("is all 0", "has 2 of its 8 rows all
    0: [3, 5]"), None when no row is all 0."""
    if not w.is_floating_point() or w.dim() == 0 or w.numel() == 0:
        return None
    zero, n = (w.reshape(w.shape[0], -1) == 0).all(1), w.shape[0]
    rows = zero.nonzero().flatten().tolist()
    if not rows:
        return None
    listed = f"{rows[:8]}"[:-1] + (", ...]" if len(rows) > 8 else "]")
    return "is all 0" if len(rows) == n else f"has {len(rows)} of its {n} rows all 0: {listed}"

"""Modules of the user's that hold the recorded model as a submodule (a loss wrapper:
``LossWrapper(model)(batch)`` is what the loop calls, and it computes the losses the recorder
then cannot see). Looked for only on the slow path, when no loss was given (one look at the
model's referrers at the event), never per step."""

from __future__ import annotations

import gc

from torch import nn


def holders_of(model: nn.Module | None, given: object = None) -> list[dict[str, str]]:
    """``{"class": "module:Qualname", "attribute": name}`` of each live module holding
    ``model`` as a direct submodule; not ``given`` (what the recorder was given, such as a DDP
    wrapper) nor torch's own wrappers."""
    if model is None:
        return []
    found = []
    for d in gc.get_referrers(model):
        if not isinstance(d, dict):
            continue
        for owner in _owners(d):
            if owner is given or owner is model:
                continue
            cls = type(owner)
            if cls.__module__.split(".")[0] in ("torch", "lightning", "pytorch_lightning",
                                                "transformers", "accelerate"):
                continue
            name = next((k for k, v in d.items() if v is model), "?")
            found.append({"class": f"{cls.__module__}:{cls.__qualname__}", "attribute": name})
    return found


def _owners(modules: dict) -> list[nn.Module]:
    """The modules whose ``_modules`` is ``modules`` (referred to from the module, or from its
    ``__dict__``, as the Python version keeps it)."""
    out = []
    for r in gc.get_referrers(modules):
        if isinstance(r, nn.Module):
            out.append(r)
        elif isinstance(r, dict):
            out += [o for o in gc.get_referrers(r) if isinstance(o, nn.Module)]
    return list({id(o): o for o in out if getattr(o, "_modules", None) is modules}.values())

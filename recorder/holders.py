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
    dicts = [d for d in gc.get_referrers(model) if isinstance(d, dict)]
    owners = _owners(dicts)
    found = []
    for d in dicts:
        for owner in owners[id(d)]:
            if owner is given or owner is model:
                continue
            cls = type(owner)
            if cls.__module__.split(".")[0] in ("torch", "lightning", "pytorch_lightning",
                                                "transformers", "accelerate"):
                continue
            name = next((k for k, v in d.items() if v is model), "?")
            found.append({"class": f"{cls.__module__}:{cls.__qualname__}", "attribute": name})
    return found


def _owners(dicts: list[dict]) -> dict[int, list[nn.Module]]:
    """By ``id`` of each of ``dicts``, the modules whose ``_modules`` it is (referred to from
    the module, or from its ``__dict__``, as the Python version keeps it). Each look at the
    referrers walks the whole heap: one walk for all the dicts, one for all their ``__dict__``s."""
    refs = _referrers_of(dicts)
    inner = _referrers_of([r for d in dicts for r in refs[id(d)] if isinstance(r, dict)])
    owners = {}
    for d in dicts:
        out = []
        for r in refs[id(d)]:
            if isinstance(r, nn.Module):
                out.append(r)
            elif isinstance(r, dict):
                out += [o for o in inner[id(r)] if isinstance(o, nn.Module)]
        owners[id(d)] = list({id(o): o for o in out
                              if getattr(o, "_modules", None) is d}.values())
    return owners


def _referrers_of(objs: list) -> dict[int, list]:
    """``gc.get_referrers`` of each of ``objs`` (by ``id``, in the order it gives them), from
    one walk of the heap."""
    objs = list({id(o): o for o in objs}.values())
    found: dict[int, list] = {id(o): [] for o in objs}
    if not objs:
        return found
    for r in gc.get_referrers(*objs):
        for o in objs:
            if _refers_to(r, o):
                found[id(o)].append(r)
    return found


def _refers_to(r, o) -> bool:
    # (what gc.get_referrers(o) tests: o among the objects r's type traverses)
    return any(x is o for x in gc.get_referents(r))

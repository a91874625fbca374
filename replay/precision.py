"""FSDP2's mixed precision in a re-run: the dtypes each ``fully_shard``-ed module computed in.

A module sharded with ``fully_shard(m, mp_policy=MixedPrecisionPolicy(param_dtype=...))``
trains float32 shards but computes with its parameters all-gathered in ``param_dtype``, its
floating inputs cast to it (``cast_forward_inputs``) and its output cast to ``output_dtype``
(the bundle's ``modules[i]["fsdp"]``, see ``recorder.shards.mixed_precision``). The replay's
model is unsharded float32, so its re-run would compute in another dtype than training did (or
fail at the first matmul of a recorded bfloat16 input with a float32 weight): while a re-run
runs as recorded, each such module's own parameters (not those of a nested ``fully_shard``-ed
module) are swapped for casts of them during its forward, as FSDP2's all-gather gave them; the
gradient reaches the float32 parameter through the cast, as FSDP2's reduce-scatter brought it
back in the parameter's dtype.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from recorder.capture import map_tensors

from .compat import set_parameter


def _dtype(name: Any) -> torch.dtype | None:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def _policies(meta: dict[str, Any]) -> dict[str, dict[str, Any]]:
    modules = meta.get("modules") if isinstance(meta.get("modules"), list) else []
    return {m["name"]: m["fsdp"] for m in modules if isinstance(m, dict)
            and isinstance(m.get("name"), str) and isinstance(m.get("fsdp"), dict)}


def _own_params(model: nn.Module, name: str, sharded: set[str]):
    """(submodule, attribute) of the parameters module ``name``'s all-gather held: those under
    it that no nested ``fully_shard``-ed module holds."""
    subs = dict(model.named_modules())
    prefix = f"{name}." if name else ""
    for full, _ in subs[name].named_parameters(prefix=name):
        owner, _, attr = full.rpartition(".")
        nested = [s for s in sharded if s != name and s.startswith(prefix)
                  and (owner == s or owner.startswith(s + "."))]
        if not nested:
            yield subs[owner], attr


def _cast(obj, dtype: torch.dtype):
    return map_tensors(obj, lambda t: t.to(dtype) if t.is_floating_point() else t)


def _hooks(module: nn.Module, params: list, policy: dict[str, Any]) -> list:
    pdt, odt = _dtype(policy.get("param_dtype")), _dtype(policy.get("output_dtype"))
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []

    def before(mod, args, kwargs):
        if pdt is None:
            return None
        for sub, attr in params:
            p = getattr(sub, attr)
            if isinstance(p, nn.Parameter) and p.is_floating_point() and p.dtype != pdt:
                swapped.append((sub, attr, p))
                set_parameter(sub, attr, p.to(pdt))  # (as torch.func.functional_call swaps)
        if policy.get("cast_forward_inputs"):
            return _cast((args, kwargs), pdt)
        return None

    def after(mod, args, kwargs, out):
        while swapped:
            sub, attr, p = swapped.pop()
            set_parameter(sub, attr, p)
        return _cast(out, odt) if odt is not None else None

    return [module.register_forward_pre_hook(before, with_kwargs=True, prepend=True),
            module.register_forward_hook(after, with_kwargs=True, prepend=True,
                                         always_call=True)]


def precision_hooks(model: nn.Module | None, meta: dict[str, Any]) -> list:
    """Hooks (their handles, to remove) under which the modules recorded under an FSDP2
    ``MixedPrecisionPolicy`` compute in its dtypes (see the module doc); none for any other
    bundle. They run before any other hook of the module (the instrumented pass sees the
    casts, as the recorder saw FSDP2's)."""
    policies = _policies(meta)
    subs = dict(model.named_modules()) if model is not None and policies else {}
    handles = []
    for name, policy in policies.items():
        if name in subs and (_dtype(policy.get("param_dtype"))
                             or _dtype(policy.get("output_dtype"))):
            handles += _hooks(subs[name], list(_own_params(model, name, set(policies))),
                              policy)
    return handles

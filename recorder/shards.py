"""Sharded parameters (FSDP2 ``fully_shard``, DTensor): what the recorder measures and stores.

Under FSDP2 a parameter is a ``DTensor`` whose rank-local shard is ``to_local()``; its gradient
(after the reduce-scatter) and its optimizer state are DTensors sharded the same way. The
recorder measures local shards only: a norm of the DTensor itself would be a collective, run
from a hook on one rank. A bundle stores each rank's local shard under the usual key with, in
``meta["shards"]``, where it sits in the full tensor (placements, mesh, offset), from which the
replay puts the full tensor back together (``replay.shards``).

>>> local(dtensor_param).shape          # doctest: +SKIP
torch.Size([8, 8])                      # rank 0's half of a (16, 8) weight

Supported: FSDP2 over one mesh dimension (``Shard(0)``) or HSDP (``Replicate()``,
``Shard(0)``). FSDP1 (``FullyShardedDataParallel``) and tensor parallelism (any other DTensor
placement, or DTensor parameters outside ``fully_shard``) are refused with one line.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .compat import dtensor_chunk, fsdp_mp_policy

try:
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # a torch built without distributed: nothing is ever sharded
    DTensor = FSDPModule = FullyShardedDataParallel = None

PLAIN = (torch.Tensor, nn.Parameter)  # the types that are never a shard


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t``'s rank-local shard when it is a DTensor, else ``t`` (no copy, no collective)."""
    if t is None or type(t) in PLAIN or DTensor is None or not isinstance(t, DTensor):
        return t
    return t.to_local()


def sharded(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor (FSDP2)."""
    return DTensor is not None and any(isinstance(p, DTensor) for p in model.parameters())


def check_supported(model: nn.Module) -> None:
    """Refuse, in one line, the sharding the recorder does not record (see the module doc)."""
    if DTensor is None:
        return
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise ValueError("FlightRecorder: FullyShardedDataParallel (FSDP1) is not supported: "
                         "its flat parameters hide which shard is which parameter; use FSDP2 "
                         "(torch.distributed.fsdp.fully_shard), which the recorder records")
    managed = {id(p) for m in model.modules() if isinstance(m, FSDPModule)
               for p in m.parameters()}
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            continue
        # FSDP: Shard(0) over one mesh dimension (HSDP: Replicate() over another); a second
        # Shard (2-D FSDP + TP) or any other placement is tensor parallelism
        fsdp_like = all(isinstance(pl, Replicate) or (type(pl) is Shard and pl.dim == 0)
                        for pl in p.placements) \
            and sum(type(pl) is Shard for pl in p.placements) <= 1
        if id(p) not in managed or not fsdp_like:
            raise ValueError(f"FlightRecorder: parameter {name!r} is a DTensor with placements "
                             f"{tuple(p.placements)} (tensor parallelism), which is not "
                             "supported: per-layer statistics would be of sharded activations; "
                             "shard with FSDP2 (torch.distributed.fsdp.fully_shard) only")


def class_name(m: nn.Module) -> str:
    """``module.QualName`` of the user's class: ``fully_shard`` swaps a module's class for a
    generated ``FSDP<Class>`` subclass, which the replay's factory does not build."""
    cls = type(m)
    if FSDPModule is not None and isinstance(m, FSDPModule):
        cls = next(c for c in cls.__mro__[1:] if not issubclass(c, FSDPModule))
    return f"{cls.__module__}.{cls.__qualname__}"


def mixed_precision(m: nn.Module) -> dict[str, Any] | None:
    """For a ``fully_shard``-ed module, the dtypes its ``MixedPrecisionPolicy`` computes in
    (JSON, None where unset): FSDP2 all-gathers its parameters cast to ``param_dtype`` and
    casts its floating inputs (``cast_forward_inputs``) and outputs (``output_dtype``), so the
    replay computes as it did (``replay.precision``). None for any other module."""
    if FSDPModule is None or not isinstance(m, FSDPModule):
        return None
    policy = fsdp_mp_policy(m)

    def name(dtype) -> str | None:
        return str(dtype).removeprefix("torch.") if dtype is not None else None

    return {"param_dtype": name(getattr(policy, "param_dtype", None)),
            "output_dtype": name(getattr(policy, "output_dtype", None)),
            "cast_forward_inputs": bool(getattr(policy, "cast_forward_inputs", False))}


def localize(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """In place, before the bundle is written: every DTensor in ``tensors`` (weights,
    gradients, optimizer state) becomes its local shard, described in ``meta["shards"]``."""
    if DTensor is None:
        return
    shards = {}
    for key, t in tensors.items():
        if isinstance(t, DTensor):
            shards[key] = describe(t)
            tensors[key] = t.to_local().detach()
    if shards:
        meta["shards"] = shards


def describe(t) -> dict[str, Any]:
    """Where a DTensor's local shard sits in the full tensor (JSON): the full shape, the
    shard's offset and shape, the placements, the mesh's shape and this rank's coordinate."""
    offset, shape = dtensor_chunk(t)
    mesh = t.device_mesh
    return {"global_shape": list(t.shape), "offset": offset, "local_shape": shape,
            "placements": [_placement(p) for p in t.placements],
            "mesh": list(mesh.shape), "mesh_dims": list(mesh.mesh_dim_names or ()),
            "coordinate": list(mesh.get_coordinate() or ())}


def _placement(p) -> dict[str, Any]:
    if isinstance(p, Shard):
        return {"shard": p.dim}
    if isinstance(p, Replicate):
        return {"replicate": True}
    return {"other": str(p)}  # Partial: the replay refuses it

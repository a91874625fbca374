"""Sharded parameters (FSDP2 ``fully_shard``, DTensor): what the recorder measures and stores.

Under FSDP2 a parameter is a ``DTensor`` whose rank-local shard is ``to_local()``; its gradient
(after the reduce-scatter) and its optimizer state are DTensors sharded the same way. The
recorder measures local shards only: a norm of the DTensor itself would be a collective, run
from a hook on one rank. A bundle stores each rank's local shard under the usual key with, in
``meta["shards"]``, where it sits in the full tensor (placements, mesh, offset), from which the
replay puts the full tensor back together (``replay.shards``).

>>> local(dtensor_param).shape          # doctest: +SKIP
torch.Size([8, 8])                      # rank 0's half of a (16, 8) weight

Supported: FSDP2 over one mesh dimension (``Shard(0)``), HSDP (``Replicate()``, ``Shard(0)``)
and tensor parallelism (``parallelize_module``: ``Shard(d)``/``Replicate()`` parameters). Under
tensor parallelism the hooks of the modules between a column- and a row-wise layer see this
rank's slice of the activations: their statistics are of that slice, which the replay, re-running
the step unsharded, compares as such (``replay.local_shards``). FSDP1
(``FullyShardedDataParallel``) and ``Partial`` parameters are refused with one line.
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
    for name, p in model.named_parameters():
        # (the replay puts Shard and Replicate pieces back together; a Partial parameter's
        # pieces are summands, which no rank's bundle holds whole)
        if isinstance(p, DTensor) and not all(isinstance(pl, (Shard, Replicate))
                                              for pl in p.placements):
            raise ValueError(f"FlightRecorder: parameter {name!r} is a DTensor with placements "
                             f"{tuple(p.placements)}, which is not supported: only Shard and "
                             "Replicate parameters can be put back together for the replay; "
                             "redistribute it to Shard or Replicate before training")


def tensor_parallel(model: nn.Module) -> bool:
    """Whether ``model`` is tensor-parallel: a DTensor parameter that no ``fully_shard``
    manages, or one sharded otherwise than FSDP2 shards (2-D FSDP + TP). Its modules may have
    computed on slices of their activations, which the unsharded replay does not."""
    if DTensor is None:
        return False
    managed = {id(p) for m in model.modules() if isinstance(m, FSDPModule)
               for p in m.parameters()}
    for p in model.parameters():
        if not isinstance(p, DTensor):
            continue
        fsdp_like = all(isinstance(pl, Replicate) or (type(pl) is Shard and pl.dim == 0)
                        for pl in p.placements) \
            and sum(type(pl) is Shard for pl in p.placements) <= 1
        if id(p) not in managed or not fsdp_like:
            return True
    return False


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


def localize(meta: dict[str, Any], tensors: dict[str, torch.Tensor],
             model: nn.Module | None = None) -> None:
    """In place, before the bundle is written: every DTensor in ``tensors`` (weights,
    gradients, optimizer state) becomes its local shard, described in ``meta["shards"]``; a
    tensor-parallel ``model`` is marked so in ``meta["model"]`` (its hooks saw slices)."""
    if DTensor is None:
        return
    if model is not None and "model" in meta and tensor_parallel(model):
        meta["model"]["tensor_parallel"] = True
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
    offset, shape = dtensor_chunk(_summands_placed(t))
    mesh = t.device_mesh
    return {"global_shape": list(t.shape), "offset": offset, "local_shape": shape,
            "placements": [_placement(p) for p in t.placements],
            "mesh": list(mesh.shape), "mesh_dims": list(mesh.mesh_dim_names or ()),
            "coordinate": list(mesh.get_coordinate() or ())}


def _summands_placed(t):
    """``t`` with each ``Partial`` placement read as ``Replicate`` (no collective): a partial
    tensor's local piece (a summand of the full tensor: a sequence-parallel norm's weight
    gradient before its all-reduce) covers the region a replica would; torch's chunk list
    refuses partial placements."""
    if not any(p.is_partial() for p in t.placements):
        return t
    placements = [Replicate() if p.is_partial() else p for p in t.placements]
    return DTensor.from_local(t.to_local(), t.device_mesh, placements, run_check=False,
                              shape=t.shape, stride=t.stride())


def _placement(p) -> dict[str, Any]:
    if isinstance(p, Shard):
        return {"shard": p.dim}
    if isinstance(p, Replicate):
        return {"replicate": True}
    if p.is_partial():  # (the replay adds the ranks' pieces: replay.shards)
        return {"partial": str(getattr(p, "reduce_op", "sum"))}
    return {"other": str(p)}  # the replay refuses it

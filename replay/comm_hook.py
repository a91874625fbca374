"""A backward event of a DDP model with a communication hook (the bundle's ``ddp`` entry,
recorder.comm_hooks) whose re-run, without the hook, makes every local gradient finite: the
gradients DDP handed the optimizer were the hook's. ``fp16_compress_hook`` casts each rank's
gradients to float16 and sums them there: a local gradient over 65504, or a sum over the ranks
over it, is inf on every rank although each rank's backward was finite."""

from __future__ import annotations

from typing import Any

import torch

from .load import Step
from .user_grad_hooks import set_source, where

# the compressing hooks of torch.distributed.algorithms.ddp_comm_hooks, by name
_COMPRESSED = {"fp16_compress": torch.float16, "bf16_compress": torch.bfloat16}


def _compressed_dtype(name: str) -> torch.dtype | None:
    return next((dt for key, dt in _COMPRESSED.items() if key in name), None)


def _largest(runner) -> tuple[float, str | None]:
    """The largest |entry| of the re-run's local gradients, and whose."""
    best, whose = 0.0, None
    for name, p in runner.model.named_parameters():
        if p.grad is not None and p.grad.numel():
            m = float(p.grad.detach().abs().max())
            if m > best:
                best, whose = m, name
    return best, whose


def _overflow_text(dtype: torch.dtype, hook: str, rank: int, world: int, largest: float,
                   whose: str | None) -> str:
    top, kind = torch.finfo(dtype).max, str(dtype).removeprefix("torch.")
    made = (f"rank {rank}'s local gradient of {whose} reaches {largest:.3g}, over {kind}'s "
            f"largest {top:.6g}: the hook's cast to {kind} made it inf" if largest > top else
            f"rank {rank}'s local gradients are finite and within {kind} (largest |g| "
            f"{largest:.3g}, of {whose}): another of the {world} ranks' casts overflowed, "
            f"or the {kind} sum (replay the other ranks' bundles, beside this one, to see "
            "theirs)")
    return (f"the local gradients were finite: DDP's communication hook {hook} "
            f"(ddp.register_comm_hook) all-reduces them in {kind}, and {made}, on every rank "
            "after the all-reduce. Register bf16_compress_hook (float32's range; NCCL) or no "
            "hook, or lower the loss scale or the weights that make gradients this large")


def comm_hook_gradient(report: dict[str, Any], step: Step, runner) -> bool:
    """Name the DDP communication hook as what made the recorded non-finite gradients, where
    the re-run's local backward (without the hook) made every gradient finite; True if so."""
    hooks = ((step.meta.get("ddp") or {}).get("comm_hooks")) or []
    env = step.meta.get("env") or {}
    if not hooks or runner is None or (env.get("world_size") or 1) < 2:
        return False
    runner.run(instrument=False)
    largest, whose = _largest(runner)
    name = str(hooks[-1].get("name") or "a hook").replace(".<locals>", "")
    rank, world = env.get("rank", 0), env["world_size"]
    report["comm_hook"] = {"hook": name, "rank": rank, "largest": largest, "param": whose,
                           "dtype": None, "cast_overflow": False}
    if (dtype := _compressed_dtype(name)) is not None and step.event.get("kind") != "nan":
        report["cause"] = "overflow"
        report["hint"] = _overflow_text(dtype, name, rank, world, largest, whose)
        report["comm_hook"].update(dtype=str(dtype).removeprefix("torch."),
                                   cast_overflow=largest > torch.finfo(dtype).max)
        return True
    set_source(report, hooks[-1])  # (a hook of the script's: its line)
    report["hint"] = (
        f"the gradients DDP handed the optimizer are the output of its communication hook "
        f"{where(hooks[-1])} (ddp.register_comm_hook), which the single-process replay does "
        f"not run: rank "
        f"{rank}'s local gradients are finite (largest |g| {largest:.3g}), so the hook made "
        "the non-finite values; check the hook (its state, its division and casts), or train "
        "a step without it")
    return True


def cast_overflowed(report: dict[str, Any]) -> bool:
    """Whether this rank's own local gradient overflowed the hook's cast (it made the inf)."""
    return bool((report.get("comm_hook") or {}).get("cast_overflow"))


def made_on_rank(report: dict[str, Any], replayed: int, rank: int) -> str:
    """Why ``rank``'s step, not ``replayed``'s, is the one the report names."""
    if cast_overflowed(report):
        hook = report["comm_hook"]
        return (f"the all-reduce gives every rank the sum of each rank's gradients cast to "
                f"{hook['dtype']}: rank {replayed}'s local gradients are within it, rank "
                f"{rank}'s {hook['param']} ({hook['largest']:.3g}) overflows the cast")
    return (f"a NaN that one rank's backward makes reaches every rank's gradients through the "
            f"all-reduce: rank {replayed}'s step alone is finite, rank {rank}'s makes it")

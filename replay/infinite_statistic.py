"""A forward NaN made in a module whose own running statistic held an infinity as the step
began: an earlier step's batch overflowed it, and this step only read it.

The recorder checks no buffer, so an outlier record (a value of 3e38) that overflows a
BatchNorm's ``running_var`` to +inf is no event at its own step; BatchNorm in training reads
the batch's statistics, not the running ones, but a conv-bn fused for quantization-aware
training (``fuse_modules_qat``: ``ConvBnReLU2d``) scales its weight by ``bn.weight /
sqrt(running_var)`` every forward, 0 there, and divides its output by that 0 (0/0) at the next
step. An eps at the division cannot help: the statistic is to be fixed where the batch fed it.
Only the running statistics of the module if a norm layer (BatchNorm, InstanceNorm), or of
its child norm layers, are read, and only for a division: other buffers may hold an infinity on purpose (an observer's
min/max before its first batch, a mask).
"""

from __future__ import annotations

import torch

from recorder.running_stats import named_running_statistics

from .load import Step

__all__ = ["infinite_statistic_hint"]

_DIVIDES = {"aten.div", "aten.reciprocal", "aten.rsqrt"}


def infinite_statistic_hint(step: Step, model: torch.nn.Module | None,
                            module: str | None, op: str | None) -> str | None:
    """The hint for an ``invalid`` division ``op`` in ``module`` whose norm layers' running
    statistics (its own, or a submodule's) held +-inf as the step began, else None."""
    if model is None or module is None or op not in _DIVIDES:
        return None
    try:
        root = model.get_submodule(module)
    except AttributeError:
        return None
    prefix = f"{module}." if module else ""
    held = [n for n in _statistics(root)
            if _infinite(step.tensors.get(f"buffers/{prefix}{n}"))]
    if not held:
        return None
    names = ", ".join(f"{prefix}{n}" for n in held[:4]) + (" ..." if len(held) > 4 else "")
    return (f"{names} held an infinity as the step began (the bundle's copy from before its "
            "forward): a running statistic that an earlier step's batch overflowed (an "
            "outlier record; see the precursors for the step whose absmax jumped), which this "
            f"module's forward reads{_fused(root)}; an eps at the op cannot help: find and "
            "filter or clip that data, and reset the statistic (reset_running_stats()) or "
            "resume from a checkpoint before it")


def _statistics(root: torch.nn.Module) -> list[str]:
    """The floating buffers of ``root`` if a norm layer, and of its children that are (a
    fused module's ``bn``: not those deeper, which other code of the module may not read)."""
    return [f"{mname}.{bname}" if mname else bname
            for mname, mod in [("", root), *root.named_children()]
            for bname, _ in named_running_statistics(mod)]


def _infinite(t: torch.Tensor | None) -> bool:
    """Whether ``t`` holds +-inf."""
    return t is not None and t.is_floating_point() and not bool(torch.isfinite(t).all())


def _fused(root: torch.nn.Module) -> str:
    """What reads it, for a conv or linear fused with its BatchNorm for QAT."""
    if hasattr(root, "bn") and hasattr(root, "weight_fake_quant"):
        return (" (a conv-bn fused for quantization-aware training scales its weight by "
                "bn.weight / sqrt(running_var), 0 where it is +inf)")
    return ""

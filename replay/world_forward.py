"""A module whose forward reads the process group: its values in training were the world's.

Batch statistics synchronised across the ranks (``nn.SyncBatchNorm``; on CPU/gloo, where
torch's refuses CPU tensors, a hand-written batch norm that all-reduces its sums and count)
make a rank's forward depend on every rank's batch. The replay runs one process, without the
run's process group: such a module takes the rank's own batch alone (SyncBatchNorm falls back to
``F.batch_norm``; user code skips its collective when ``torch.distributed.is_initialized()`` is
False, as the replay's hint for a collective advises), so the re-run's values differ from the
recorded ones from that call on although the factory builds the recorded model. The fidelity
check names that instead of a factory that builds another model.

>>> world_forward(step, "norm")      # doctest: +SKIP
{'class': 'AllReduceBatchNorm', 'source': 'ddp_stack_models.py:48'}
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from torch import nn

from .load import Step
from .source import is_torch_file, short_path

# a forward that asks for the process group (not torch.cuda.is_initialized), or calls a
# collective (dist.all_reduce, an imported all_gather, functional collectives)
_READS_GROUP = re.compile(
    r"\bdist\w*\.(?:is_initialized|get_world_size|get_rank)\s*\(|"
    r"\b(?:all_reduce|all_gather\w*|reduce_scatter\w*|broadcast)\s*\(")


def world_forward(step: Step, module: str | None) -> dict[str, Any] | None:
    """``{"class", "source", "world_size"}`` of the first module at or below ``module`` whose
    forward reads the process group, in a bundle of a run of several ranks; else None."""
    world = int((step.meta.get("env") or {}).get("world_size") or 1)
    model = step.model
    if world < 2 or model is None or module is None:
        return None
    try:
        top = model.get_submodule(module)
    except AttributeError:
        return None
    for m in top.modules():
        where = _reads_group(m)
        if where is not None:
            return {"class": type(m).__name__, "source": where, "world_size": world}
    return None


def _reads_group(m: nn.Module) -> str | None:
    """``file:line`` of ``m``'s forward when it reads the process group (SyncBatchNorm: its
    class's own line, torch's file)."""
    forward = getattr(type(m), "forward", None)
    if forward is None or forward in (nn.Module.forward,):
        return None
    try:
        lines, start = inspect.getsourcelines(forward)
        path = inspect.getsourcefile(forward)
    except (OSError, TypeError):
        return None
    if path is None or not (isinstance(m, nn.SyncBatchNorm) or _READS_GROUP.search("".join(lines))):
        return None
    if is_torch_file(path):
        return f"torch.nn.{type(m).__name__}.forward"
    return f"{short_path(path)}:{start}"


TEXT = ("its forward ({cls}.forward, {source}) reads the process group: in training it "
        "computed over every rank's values ({world} ranks: statistics synchronised across "
        "them, as SyncBatchNorm's are), in the re-run, a single process without the run's "
        "ranks, over this rank's alone, so the step cannot be re-run as it ran (the model is "
        "the recorded one). To replay such a step, reproduce it with one rank (world size 1, "
        "the whole batch on it) under the recorder")


def describe(found: dict[str, Any]) -> str:
    """The fidelity line's reason."""
    return TEXT.format(cls=found["class"], source=found["source"], world=found["world_size"])


MISMATCH = "the model's forward used every rank's values in training, this rank's alone here"

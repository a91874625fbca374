"""A distribution's parameter refused as 0 that an index op looked up in a buffer.

scVI's latent library prior ``Normal(library_log_means[s], library_log_vars[s].sqrt())``
picks each cell's batch statistics out of buffers the code computed once from the data; a
batch of a single cell has a variance of exactly 0 there, so ``Normal`` refuses the scale of
that batch's cells. The generic advice (a scale through softplus or exp plus a floor) is for
a value the network makes; this one is an entry of a table, as ``replay.looked_up`` says of
a pole's 0 looked up in a buffer: the fix is the table, where it is built.
"""

from __future__ import annotations

from torch import nn

from .looked_up import SHOWN

_INDEXING = {"aten.index", "aten.index_select", "aten.embedding", "aten.gather",
             "aten.take_along_dim"}


def looked_up_refusal_hint(refused: str, seen: str, op: str | None,
                           model: nn.Module) -> str | None:
    """The hint for refused zeros made by the index op ``op`` when exactly one floating
    buffer of ``model`` holds 0 in some entries (the table they were picked from); else
    None."""
    if op not in _INDEXING:
        return None
    # (some entries 0, not all: a fresh BatchNorm's running_mean is no table of the data)
    tables = [(n, b) for n, b in model.named_buffers()
              if b.is_floating_point() and b.dim() and b.numel() and bool((b == 0).any())
              and not bool((b == 0).all())]
    if len(tables) != 1:
        return None
    name, table = tables[0]
    rows = (table == 0).reshape(len(table), -1).any(1).nonzero().flatten().tolist()
    ids = ", ".join(map(str, rows[:SHOWN])) + (f", ... ({len(rows)} in all)"
                                               if len(rows) > SHOWN else "")
    return (f"{refused}: {seen}, in float64 too: {op} looked them up in the buffer {name}, a "
            f"table the code was built with, which is exactly 0 at {len(rows)} of its "
            f"{len(table)} entries ({ids}), and the batch picked them by index: a statistic "
            "of a group with one member or none (a variance over a batch category of a "
            "single cell). Fix the table where it is built (floor it, or compute it over "
            "more data) or merge or drop such groups; a floor at the distribution hides it")

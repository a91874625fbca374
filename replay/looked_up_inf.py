"""A NaN (or a +-inf output) made of an infinity that an op picked by index from a buffer of
the model: a table of one value per id the code built from data (a category's log frequency
``log(count / n)`` in the training fold, its inverse frequency, a class's log prior), infinite
at an id the data never held (a log or a reciprocal of a count of 0), which the batch then
looked up (a category seen only in the validation fold or the test set). The op finder takes a
buffer holding +-inf for a mask (``replay.storages.mask_buffers``), on purpose; picked by id
from a buffer whose finite values vary (no 0/-inf mask: a CRF's forbidden transitions), one of
its entries is a value the table was built without: the hint names the buffer, its non-finite
entries and the fix where the table is built, and the chain's start is no longer marked
intentional.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["looked_up_inf_hint"]

# ops that pick entries of their first input by an integer index tensor (not a slice, a view)
LOOKUPS = {"aten.index", "aten._unsafe_index", "aten.index_select", "aten.embedding",
           "aten.take", "aten.gather", "aten.take_along_dim"}
SHOWN = 8  # entries named


def looked_up_inf_hint(hint: str | None, cause: str, start, hit, model: torch.nn.Module,
                       origin: dict[str, Any]) -> str | None:
    """The hint for ``hit``, a NaN made from infinities (``cause`` invalid) when the chain's
    start (``start``, the finder's intended infinity) is a lookup op that picked the +-inf of
    a model buffer, which holds it at fewer than half its entries and more than one finite
    value elsewhere (no 0/-inf mask); else None. Marks the origin's chain entry of ``start``
    as not intentional."""
    if cause != "invalid" or hit is None or start is None or start.buffer is None \
            or start.op not in LOOKUPS or hit.inputs_finite:
        return None
    table = dict(model.named_buffers()).get(start.buffer)
    if table is None or not table.is_floating_point() or table.numel() == 0:
        return None
    bad = ~torch.isfinite(table.detach())
    count = int(bad.sum())
    if not 0 < 2 * count < table.numel():  # (a mask: as many infinities as values, or more)
        return None
    if table.detach()[~bad].unique().numel() < 2:  # (a mask of 0 and -inf: a CRF's forbidden
        return None  # transitions, picked by the tags; a table's values vary)
    for entry in origin.get("chain") or []:
        if entry.get("op") == start.op and entry.get("intentional"):
            entry["intentional"] = False
    places = [str(tuple(p)) if len(p) > 1 else str(p[0])
              for p in bad.nonzero().tolist()[:SHOWN]]
    more = f" (+{count - SHOWN} more)" if count > SHOWN else ""
    kinds = sorted({"NaN" if v != v else ("-inf" if v < 0 else "+inf")
                    for v in table.detach()[bad].tolist()})
    at = f" ({start.source})" if start.source else ""
    made = "NaN" if hit.made == "nan" else hit.made
    samples = origin.get("samples") or hit.rows
    who = f" for sample(s) {samples[:SHOWN]}" if samples else ""
    return (f"{start.op}{at} picked the {'/'.join(kinds)} of buffer '{start.buffer}'{who}, "
            f"which holds it at {count} of its {table.numel()} entries: {', '.join(places)}"
            f"{more}, and {hit.op} made {made} of it. A table of one value per id looked up "
            "by the batch's ids is no mask: those entries are ids the data the table was "
            "built from never held (the log or the reciprocal of a count of 0: a category "
            "absent from the training fold, met in the validation fold or the test set; a "
            "class no training sample has). Fix the table where it is built: smooth its "
            "counts (log((count + 1) / (n + k)), 1 / (count + 1)), or map ids unseen there "
            "to an 'unknown' entry before the lookup; an eps at the op would only hide the "
            "unseen ids")

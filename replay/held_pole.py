"""A log whose input is one of the model's or the loss's buffers as the code keeps it, 0 in
some entries, and -inf exactly there: a prior or frequency made of counts (a class prior
``counts / counts.sum()`` added as ``log(prior)`` to the logits by logit adjustment or a
balanced softmax; a token's unigram frequency), 0 for an entry no example was counted in (a
class absent from the training split). Every sample takes the same entries: no record is to
blame and no rows are to drop, and the generic advice of a log's pole (a parametrisation, an
eps in the data) points away from where the buffer is computed.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

LOGS = frozenset({"aten.log", "aten.log2", "aten.log10"})
SHOWN = 8  # entries named

HELD_POLE = (
    "{op} of 0: its input is the buffer {name} as the code keeps it, 0 at entr{ies} {where} "
    "of its shape {shape}, and the -inf is exactly there; every sample takes the same "
    "entries, so no record is to blame and there are no rows to drop. A prior, frequency or "
    "count kept as a buffer (a class prior counts / counts.sum() whose log logit adjustment "
    "or a balanced softmax adds to the logits, a token's frequency) is 0 for an entry no "
    "example was counted in (a class absent from the split it was counted over): its log is "
    "-inf in every row, which a label smoothing, a mixup target or a label of that class then "
    "takes; smooth it where it is made ((counts + 1) / (counts.sum() + C), "
    "counts.clamp_min(1)), or leave that entry out of the classes")


def held_pole_hint(hint: str | None, cause: str, hit,
                   buffers: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """``HELD_POLE`` filled when the blamed op (``hit``) is a log of the model's parameters
    and buffers alone whose -inf lies exactly where one of ``buffers`` (name, tensor) is 0,
    broadcast over the output; else None."""
    ev = hit and hit.evidence
    if hint is None or cause != "invalid" or ev is None or hit.op not in LOGS \
            or not ev.of_weights:
        return None
    found = []
    for name, buf in buffers:
        if not buf.is_floating_point() or buf.dim() == 0 or buf.dim() > ev.bad.dim() \
                or tuple(ev.bad.shape[ev.bad.dim() - buf.dim():]) != tuple(buf.shape):
            continue
        zero = buf.detach().cpu() == 0
        if bool(zero.any()) and bool((ev.bad.cpu().reshape(-1, *buf.shape) == zero).all()):
            found.append((name, buf, zero))
    if len(found) != 1:
        return None
    name, buf, zero = found[0]
    at = zero.nonzero()
    where = ", ".join(str(tuple(i)) if len(i) > 1 else str(i[0]) for i in at[:SHOWN].tolist()) \
        + (f", ... ({len(at)} in all)" if len(at) > SHOWN else "")
    return HELD_POLE.format(op=hit.op, name=name, ies="ies" if len(at) > 1 else "y",
                            where=where, shape=tuple(buf.shape))

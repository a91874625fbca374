"""A division 0/0 exactly where the batch holds one token id: the vector looked up for that id
is 0, a padding row (``padding_idx``, a row the code zeroed or masked) normalised by its norm
(a cosine vocabulary's ``e / e.norm(dim=-1, keepdim=True)``). Padding positions are usually
masked before, so the run is healthy until a symbol the tokenizer maps to the padding id (an
unknown residue letter, an out-of-vocabulary word) puts that row among the real tokens. The
generic advice (an eps) hides the symbol; the fix is its id, in the tokenizer.
"""

from __future__ import annotations

import torch

from recorder.capture import batch_path

from .load import Step
from .recorded import n_args, samples

__all__ = ["zero_id_rows_hint"]

_DIVISIONS = {"aten.div", "aten.div_", "aten.true_divide"}
SHOWN = 4  # positions named in the hint


def zero_id_rows_hint(step: Step, model: torch.nn.Module | None, origin, hit) -> str | None:
    """The hint for ``hit``, a 0/0 division in ``origin``'s module of ``model``, whose
    non-finite entries (over the dims after the first two) are exactly the positions of one
    id in an integer model input of the micro-batch, shaped as those two dims, an id the
    module holds a table row for (a 2-D weight of the output's width: one id of the batch
    alone is no lookup); else None."""
    ev = hit.evidence if hit is not None else None
    if ev is None or hit.op not in _DIVISIONS or hit.made != "nan" or ev.bad.dim() < 3 \
            or model is None or origin.micro_batch >= len(step.micro_batches):
        return None
    try:
        module, micro_batch = model.get_submodule(origin.module), origin.micro_batch
    except AttributeError:
        return None
    rows = [len(t) for t in [*module.parameters(), *module.buffers()]
            if t.dim() == 2 and t.is_floating_point() and t.shape[1] == ev.bad.shape[-1]]
    bad = ev.bad.reshape(*ev.bad.shape[:2], -1).any(-1).cpu()
    entry = step.micro_batches[micro_batch]
    count = n_args(entry.get("inputs"))
    for key, raw in (entry.get("paths") or {}).items():
        ids = step.tensors.get(key)
        if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex() \
                or ids.dtype == torch.bool or tuple(ids.shape) != tuple(bad.shape):
            continue
        picked = ids[bad].unique()
        if picked.numel() == 1 and int(picked) < max(rows, default=0) \
                and torch.equal(ids == picked, bad):
            places = bad.nonzero().tolist()
            if samples(step, micro_batch).dim(ids) == 1:  # (sequence-first ids: (N, B))
                places = [[s, p] for p, s in places]
            return _says(hit.op, batch_path(raw, count), int(picked), places)
    return None


def _says(op: str, name: str, token: int, places: list[list[int]]) -> str:
    shown = ", ".join(f"sample {s} position {p}" for s, p in places[:SHOWN]) + (
        f", ... ({len(places)} in all)" if len(places) > SHOWN else "")
    return (f"{op} of 0 by 0 (0/0) exactly where {name} holds the id {token} ({shown}), and "
            f"nowhere else: the vector looked up for id {token} is 0 (a padding row: "
            "padding_idx, a row the code zeroes or masks) and the forward divides by its norm "
            "or sum. If that id is the padding id, a symbol the tokenizer maps to it (an "
            "unknown residue letter or word) put it among the real tokens: give unknown "
            "symbols an id of their own (<unk>) or drop them in the dataset; else clamp the "
            "divisor (x.norm(dim=-1, keepdim=True).clamp_min(eps), F.normalize)")

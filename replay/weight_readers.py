"""Where weights that were non-finite before the step first went into the forward: which rows
of the parameter hold the non-finite values, and the module call, op and samples that first
read them. An embedding table with one bad row (an added token's row initialised as the mean
of no vectors) poisons only the samples that look that token up; naming the row and those
samples points at the code that wrote the row.
"""

from __future__ import annotations

from typing import Any

from recorder.finite import bad_rows

from .forward import find_op_in_call, module_source, origin_rows
from .load import Step
from .rerun import Runner


def bad_row_fields(step: Step, name: str, prefix: str = "") -> dict[str, Any]:
    """``rows`` (indices along dim 0 holding a non-finite value) and ``rows_of`` (dim 0's
    size) of parameter or buffer ``name`` as the bundle holds it (its rewind copy's, with
    ``prefix`` ``"rewind/"``), when only some rows are bad; else nothing (every row bad, or a
    tensor without rows)."""
    t = step.tensors.get(f"{prefix}weights/{name}")
    if t is None:
        t = step.tensors.get(f"{prefix}buffers/{name}")
    if t is None or t.dim() < 2:
        return {}
    rows = bad_rows(t, 0)
    if not 0 < len(rows) < t.shape[0]:
        return {}
    owner = name.rpartition(".")[0]
    types = {m.get("name"): m.get("type") or "" for m in step.meta.get("modules") or []}
    return {"rows": rows, "rows_of": t.shape[0],
            "embedding": types.get(owner, "").endswith(("Embedding", "EmbeddingBag"))}


def first_reader(step: Step) -> dict[str, Any]:
    """The module call (and its op and samples) where the forward re-run from the bundle's
    weights first made a non-finite value from finite inputs: the reader of the bad weights.
    Empty when the model was not rebuilt or its forward stays finite (a weight only the
    backward or the optimizer reads)."""
    if step.model is None:
        return {}
    runner = Runner(step)
    run = runner.run(backward=False)
    o = run.forward_origin()
    if o is None or not o.inputs_finite:
        return {}
    finder = find_op_in_call(runner, o.module, o.call, o.micro_batch)
    hit = finder.origin() or finder.first_met
    return {"module": o.module, "call": o.call, "micro_batch": o.micro_batch,
            "op": hit.op if hit else None,
            "source": (hit.source if hit and hit.source else module_source(step, o.module)),
            "samples": origin_rows(step, run, o, hit)}


def rows_text(name: str, fields: dict[str, Any]) -> str | None:
    """The hint's words for the bad rows of ``name`` (None when every row is bad)."""
    rows = fields.get("rows")
    if not rows:
        return None
    shown = ", ".join(map(str, rows[:8])) + (f" (+{len(rows) - 8})" if len(rows) > 8 else "")
    return (f"only row(s) {shown} of {fields['rows_of']} of {name} are non-finite"
            + (": those token ids' embeddings (rows added or initialised by hand, as after "
               "resize_token_embeddings, are the usual writers)" if fields.get("embedding")
               else ""))

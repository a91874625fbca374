"""A pole's 0 made by a matrix product with a column (or row) of one operand all 0.

Forward correction for noisy labels, ``log(softmax(logits) @ T)``, with a transition matrix
estimated from counts on a trusted subset that never held some noisy class: ``T``'s column
for that class is 0, so every sample's corrected probability is exactly 0 there whatever the
model predicts, and the log is -inf. The generic advice (clamp the log's input) hides a wrong
matrix and leaves that class untrainable; the column is the bug. The op finder's watch keeps,
per ``mm``/``bmm`` result while it lives unmodified, which of its lines an all-0 operand
line zeroed (no host read: only a blamed op's inputs are looked at). Only an operand the
backward does not differentiate is such a matrix: one that requires grad is the model's own
activations, whose all-0 row is a sample's (a blank image through a bias-free tower), not an
estimate's.
"""

from __future__ import annotations

import torch

from .memo import TensorMemo

SHOWN = 8  # columns or rows named
TEXT = ("; but that 0 is a matrix product's {what} {lines}, where its {side} operand "
        "{shape} holds only 0 (a transition or mixing matrix estimated from counts that "
        "never saw that class), so the product is 0 there in every sample whatever the other "
        "operand holds: a clamp or eps would hide the matrix's {what}; fill them (smooth the "
        "estimate, add a floor before normalising) or re-estimate the matrix")


class ZeroOperand:
    """Matrix products whose output has lines that an operand's all-0 line made 0."""

    def __init__(self):
        self._lines = TensorMemo()

    def track(self, name: str, args, out) -> None:
        """After an op ran: keep ``mm``/``bmm``'s zero columns of its right operand and zero
        rows of its left one (as device masks)."""
        if name not in ("mm", "bmm") or len(args) < 2 or not isinstance(out, torch.Tensor) \
                or not out.is_floating_point() or out.layout != torch.strided:
            return
        a, b = args[0], args[1]
        if not all(isinstance(t, torch.Tensor) and t.layout == torch.strided for t in (a, b)):
            return
        # (an operand that requires grad is activations or weights, no estimate: not scanned,
        # so a training re-run's matmuls, both operands on the graph, cost nothing here)
        if a.requires_grad and b.requires_grad:
            return
        with torch.no_grad():
            cols = None if b.requires_grad else (b == 0).all(-2)  # (..., n): column j all 0
            rows = None if a.requires_grad else (a == 0).all(-1)  # (..., m): row i all 0
        # kept whether or not any line is 0: a host read per product to tell would cost a
        # sync per matmul of the re-run on CUDA; these are only read when an op is blamed
        self._lines.put(out, (cols, rows, tuple(b.shape), tuple(a.shape)))

    def find(self, ins: list[torch.Tensor], bad: torch.Tensor) -> str | None:
        """The hint's addition when an input of the blamed op is such a product's result,
        exactly 0 wherever the op's output went non-finite, and those entries all lie in the
        zeroed lines; else None."""
        for t in ins:
            kept = self._lines.get(t)
            if kept is None or t.shape != bad.shape:
                continue
            cols, rows, b_shape, a_shape = kept
            with torch.no_grad():
                if not bool((t.detach()[bad] == 0).all()):
                    continue
                if cols is not None and bool(cols.any()) \
                        and not bool((bad & ~cols.unsqueeze(-2)).any()):
                    return _said("column(s)", cols, "right", b_shape)
                if rows is not None and bool(rows.any()) \
                        and not bool((bad & ~rows.unsqueeze(-1)).any()):
                    return _said("row(s)", rows, "left", a_shape)
        return None


def _said(what: str, lines: torch.Tensor, side: str, shape) -> str:
    while lines.dim() > 1:  # (bmm: the lines zero in some matrix of the batch)
        lines = lines.any(0)
    idx = lines.nonzero().flatten().tolist()
    shown = str(idx[:SHOWN])[:-1] + (", ...]" if len(idx) > SHOWN else "]")
    return TEXT.format(what=what, lines=shown, side=side, shape=shape)

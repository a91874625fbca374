"""Python numbers the watched code read out of tensors (``.item()``, ``float(t)``: aten's
``_local_scalar_dense``). A division by such a number divides by a value the step computed
(DETR's ``num_boxes.item()``, a count over the batch's targets), not by a setting of the
run; :func:`replay.domains.describe` advises on it as on a 0-d count tensor."""

from __future__ import annotations

import math


class ReadNumbers:
    def __init__(self) -> None:
        self.values: set[float] = set()

    def track(self, name: str, out) -> None:
        if name == "_local_scalar_dense" and isinstance(out, (int, float)) \
                and not isinstance(out, bool) and math.isfinite(out):
            self.values.add(float(out))

    def of(self, args) -> frozenset[float]:
        """The Python numbers among ``args`` (an op's positional arguments) that were read."""
        return frozenset(float(a) for a in args if isinstance(a, (int, float))
                         and not isinstance(a, bool) and float(a) in self.values)

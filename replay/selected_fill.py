"""A top-k selection that took a mask's fill as one of its top values: a row with fewer
entries left unmasked than the k it selects (Campanella et al.'s top-k instance pooling over
a slide's patches padded with ``-inf``, a bag smaller than k) hands the fill's infinity on as
a selected score, which the mean of the top k folds into the output."""

from __future__ import annotations

from .hits import OpHit

# ops that select k entries of each row by value (not an index given by the data)
_SELECTIONS = {"topk", "kthvalue"}


def selected_fill_hint(name: str, hit: OpHit) -> str | None:
    """The hint for ``hit``, an op ``name`` that passed on an infinity it was given, when it
    is a selection by value from a masked row; None otherwise."""
    if name not in _SELECTIONS:
        return None
    return (f"{hit.op} selected the {hit.made} a mask put in on purpose as one of the top "
            "values of a row: that row holds fewer entries left unmasked than the k it "
            "selects (top-k pooling over a padded set: a bag of fewer instances than k, a "
            "sequence shorter than k), so the padding was picked. Select at most the row's "
            "count of real entries (k = min(k, n) per row, or zero the picked fills and divide "
            "by min(k, n)), or drop or skip sets smaller than k")

"""What a step anomaly mode stopped (``torch.autograd.detect_anomaly()`` raising at a backward
node's NaN, before any reached a parameter) says when the replay re-runs it without anomaly
mode: a node of the re-run made the NaN and a later node dropped it (a clamp's or a where's
backward zeroes it), so the update would have gone on; or no node of the re-run makes one, so
the node that did is not in what the replay re-runs: a term the loop added to the loss
``loss_fn`` returned, which the replay cannot re-run."""

from __future__ import annotations

_STOPPED = "torch.autograd's anomaly mode (set_detect_anomaly) stopped training at this NaN, "


def anomaly_note(found: bool) -> str:
    """The note for a re-run whose backward found a node making the NaN (``found``) or not."""
    if found:
        return (_STOPPED + "but re-run without it every parameter's gradient is finite: a "
                "later backward node drops it (a clamp's or a where's backward zeroes it), so "
                "the update would have gone on; fix the node above, or train without anomaly "
                "mode and let the recorder watch")
    return (_STOPPED + "but the re-run's backward, of the model and the loss_fn the recorder "
            "was given, makes no NaN: the node that made it is not in what the replay "
            "re-runs, a term the loop added to loss_fn's loss (loss = rec.loss_fn(out, y) + "
            "penalty), or the step is not reproducible")


# the hint when no node of the re-run made it
UNSEEN_HINT = ("compute the whole loss inside loss_fn (the penalty too), so that the replay "
               "re-runs it and names the backward node that made the NaN; or train without "
               "anomaly mode, so that the recorder reads the NaN where it reaches the model")

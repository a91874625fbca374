"""The words of an input event: a batch tensor holding NaN/Inf in whole columns or every value,
one not per sample, a loss argument the loop may have computed, and an ``allow_nan`` input
whose NaN got past the model's handling (read by :mod:`replay.recorded`, :mod:`replay.origins`,
:mod:`replay.imputed`). No torch here, as in :mod:`replay.cause_text`."""

from __future__ import annotations

# An input event on a tensor no row of which is a sample's (replay.recorded.input_hint)
# an allow_nan input whose NaN reached a module's output, the loss or a gradient
ALLOWED_NAN_LEAKED = (
    "{tensor} may hold NaN (allow_nan: missing values the model handles), but in this step a "
    "NaN of it got past that handling: find where forward uses {tensor} before (or without) "
    "imputing it; the samples are its rows whose NaN reached the model's output (else every "
    "row holding NaN)")
ALLOWED_NAN_GOT_PAST = ("{tensor} may hold NaN (allow_nan: missing values the model handles), "
                        "but in this step a NaN of it got past that handling: ")
# a backward node that multiplied an allow_nan input's NaN, which the forward masked after it
# used it (replay.origins.report_backward)
ALLOWED_NAN_SAVED = (
    "{node} multiplied a NaN it saved in the forward, which came in with {tensor} (allow_nan: "
    "missing values in rows {rows}) and which the forward masked only after computing with "
    "it: torch.where or a mask on a later value still sends the gradient through the masked "
    "entries, and 0 * NaN is NaN; impute {tensor} before the first op that reads it "
    "(torch.nan_to_num(x), torch.where(torch.isnan(x), fill, x)), then mask")
# a batch tensor whose same features are NaN/Inf in every sample
WHOLE_COLUMNS = (
    "the batch itself holds NaN/Inf, and {tensor} holds it in the same feature(s) of every "
    "sample ({cols}): a per-feature step of the data pipeline made them, not a bad record (a "
    "standardisation dividing by a constant column's zero std: add an eps or drop the "
    "column; statistics fitted on a split holding a NaN in that column: fit them with "
    "nanmean/nanstd or fill the missing values first; a feature missing from the source; a "
    "field defined on part of a grid only, as "
    "sea-surface temperature over land: fill it, torch.nan_to_num, and mask it in the loss)")
# ... and every value of it: no feature stands out, a factor all values share made them
WHOLE_TENSOR = (
    "the batch itself holds NaN/Inf, and every value of {tensor} is {kind}: no sample and no "
    "feature stands out, so the code that made the whole tensor did (a division by a scalar "
    "that is 0, as a sampler's x / sqrt(alpha_bar) where the schedule reaches alpha_bar = 0, "
    "or a multiplication by a NaN/Inf scalar or weight: a mixup lambda from Beta(0, 0), "
    "x / (x + y) of two 0 draws), not a record of the data{evaluating}")
WHOLE_TENSOR_EVALUATING = (
    "; this forward ran with gradients off between steps, so the loop's code before it (a "
    "sampling loop feeding the model what it computed from the last output) is the first "
    "place to look")


def evaluating(event: dict) -> str:
    """WHOLE_TENSOR's last words: for an evaluation forward's batch, which ran with gradients
    off (the loop's last forwards with gradients on, checked at the exit, are not one)."""
    return WHOLE_TENSOR_EVALUATING if event.get("evaluation") \
        and not event.get("no_backward") else ""


SHARED_INPUT = ("{tensor} holds NaN/Inf and is not per sample: every sample of the batch goes "
                "through it (a mask, a bias or a table passed to forward), so no sample is to "
                "blame; check the code that makes it")
SHARED_ROWS = ("; it holds them only in its rows {rows} (of {n}): if those are records of their "
               "own (a few-shot episode's support set beside the query batch, a memory bank's "
               "entries), fix or filter them where the data is made")

# An input event on a loss argument while the model's own inputs were finite
# (replay.recorded.input_hint): not necessarily data, the loop may have computed it
LOSS_ARGUMENT = ("{tensor} is an argument of the loss, not data the model took (its inputs "
                 "were finite){every}: if the loop computes it (a teacher's or a momentum/EMA "
                 "target network's output, a target built from the batch), that code made the "
                 "{kind}: check it and the weights of the network behind it (an EMA update "
                 "with a non-finite momentum, or a decay above 1, which steps away from the "
                 "model and grows the weights each update); if it is data (labels, regression "
                 "targets), fix the data pipeline for these samples")
LOSS_ARGUMENT_EVERY = (", and every row holds {kind}: a cause the rows share, not one sample's "
                       "data (a network's weights, or a statistic of the batch: targets "
                       "standardised per batch, (y - y.mean()) / y.std(), divide by a std of 0 "
                       "when every target of the batch is equal; add an eps or use the "
                       "dataset's statistics)")

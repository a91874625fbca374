"""What the data did, said once the report is made: the rows of the loop's batch a chunk's
samples are (``replay.chunk_rows``); the dataset records they are, by the identifiers the batch
carries (``replay.record_ids``); the rows out of scale in the batch of the step where a rewind
window shows the trouble began (``replay.began_batch``); values far outside the batch's scale
(``replay.data_scale``), also where they drove an op out of its domain
(``replay.domain_outliers``), or negative in a few records alone (``replay.negative_rows``);
a propensity of 0 or 1 given as data (``replay.edge_probability``);
a target distribution the loop built with no mass in a row (``replay.massless_rows``);
a loss argument normalised by an infinite total (``replay.inf_normalised``);
a NaN the loss made that a mask's 0 then met (``replay.masked_after``); an overflow in
entries a mask's 0 then met (``replay.masked_overflow``); an overflow of an op
that took the loss's data alone (``replay.data_overflow``), or a model output already near the
type's range (``replay.output_overflow``); a square of a batch tensor in raw units beyond the
type's range (``replay.squared_data``); a weight element far out of its tensor's scale at
an overflow's (``replay.outlier_weights``: a checkpoint's flipped bit); the samples a loss
argument of a
value per pair or group reaches (``replay.grouped_arg``); a loss made non-finite by a
micro-batch of one sample (``replay.single_sample``); a 0/0 over records with nothing in them
(``replay.empty_records``), or over a class one-hot labels hold none of in those records
(``replay.absent_channels``), or over a channel of real-valued data that reads 0 throughout
those records (``replay.dead_channels``), or over graphs with no node
(``replay.empty_graphs``), or a log's pole over records whose counts are all 0 (``replay.empty_counts``); a pole or domain
edge on samples whose model input is all 0 (``replay.zero_records``); a fully masked softmax
over the padding units of exactly the samples that have some (``replay.padded_units``); a 0/0 of a feature the
batch holds constant
(``replay.constant_columns``); a number attribute the loop grew past the step's type
(``replay.grown_number``); an overflow of a batch whose columns are in other units
(``replay.column_scale``); the attribute holding a NaN number an op was given
(``replay.nan_attribute``); a log's
argument outside its domain that the batch holds as given (``replay.data_pole``), or a log
barrier's bound the batch holds as 0 (``replay.zero_bound``); other
tensors of an input event's micro-batch bad in other rows (``replay.other_inputs``); a model
input coded -999 where its mask is 0 (``replay.sentinel_inputs``); an input's NaN the forward
cast to an integer type, its outputs finite (``replay.nan_cast``); a mean loss over no target
in one micro-batch of several, every target ignored (``replay.ignored_micro_batch``), or
token labels ignored at every position beside real tokens (``replay.unselected_targets``); a
distance at 0 between samples that are one record in pairs (``replay.same_record_pairs``); a
loss's weighted mean over a batch whose weights are all 0 (``replay.zero_weights_batch``); a
loss's pole at the 0 error of a model output equal to its target, in every entry or in the
origin's samples (``replay.perfect_fit``); a loss's op out of its domain on a model output
holding negative values beside data that holds none (``replay.output_range``); a loss's pole
at the spread of a model output constant within each named sample (``replay.constant_output``),
or at a non-negative model output's exact zeros under positive data (``replay.zero_output``)."""

from __future__ import annotations

from typing import Any

from .absent_channels import absent_channels_hint
from .batch_overflow import data_alone_hint
from .began_batch import began_batch_note
from .between_writes import written_weights_hint
from .causal_buffer import causal_buffer_hint
from .chunk_rows import chunk_note
from .column_scale import column_scale_hint
from .constant_columns import constant_columns_hint
from .constant_output import constant_output_hint
from .data_overflow import data_overflow_hint
from .data_pole import data_pole_hint
from .data_scale import data_scale_hint
from .dead_channels import dead_channels_hint
from .domain_outliers import domain_outlier_hint
from .edge_probability import edge_probability_hint
from .empty_counts import empty_counts_hint
from .empty_graphs import empty_graphs_hint
from .empty_records import empty_records_hint
from .fp16_drift import fp16_drift_hint
from .grouped_arg import grouped_arg_hint
from .grown_arg import grown_argument_hint
from .grown_number import grown_number_hint
from .ignored_micro_batch import ignored_micro_batch_hint
from .inf_normalised import inf_normalised_hint
from .load import Step
from .masked_after import masked_after_hint
from .masked_overflow import masked_overflow_hint
from .massless_rows import massless_rows_hint
from .nan_attribute import nan_attribute_hint
from .nan_cast import nan_cast_hint
from .negative_rows import negative_hint
from .other_inputs import other_inputs_note
from .outlier_weights import outlier_weight_hint
from .output_overflow import huge_output_hint
from .output_range import output_range_hint
from .padded_units import padded_units_hint
from .padding_batch import padding_batch_hint
from .perfect_fit import perfect_fit_hint
from .pole_buffers import pole_buffer_hint
from .record_ids import record_ids_note
from .recorded import whole_batch
from .same_record_pairs import same_record_pairs_hint
from .sentinel_inputs import sentinel_inputs_hint
from .single_sample import single_sample_hint
from .spread_grads import spread_grads_note
from .squared_data import squared_data_hint
from .unselected_targets import unselected_targets_hint
from .zero_bound import zero_bound_hint
from .zero_eps_attribute import zero_eps_attribute_hint
from .zero_norm_eps import zero_norm_eps_hint
from .zero_number import zero_number_hint
from .zero_output import zero_output_hint
from .zero_records import zero_records_hint
from .zero_weights_batch import zero_weights_hint


def data_hints(report: dict[str, Any], step: Step) -> None:
    chunk_note(step, report)  # (a chunk of the loop's batch: its rows there)
    record_ids_note(report, step)  # (a shuffled loader's batch["id"] at the samples)
    began_batch_note(report, step)  # (a target of 1e17 at the step the loss jumped)
    data_scale_hint(report, step)
    fp16_drift_hint(report, step)  # (a float16 base's LoRA output grown past its maximum)
    data_alone_hint(report, step)  # (exp of timestamps in microseconds: no learning rate)
    domain_outlier_hint(report, step)  # (log1p of a gap after a timestamp in ms)
    edge_probability_hint(report, step)  # (a propensity of 0 or 1 given as data)
    massless_rows_hint(report, step)  # (a projected target that lost its mass: C51)
    inf_normalised_hint(report, step)  # (NaN beside 0s: w / w.max() of an infinite w)
    masked_after_hint(report, step)  # (an invisible keypoint's 0/0, weighted by 0 after)
    masked_overflow_hint(report, step)  # (padded steps' overflow, masked by nll * mask)
    data_overflow_hint(report, step)  # (a loss's pow of its targets alone: 0..255 heatmaps)
    huge_output_hint(report, step)  # (mse of traces a CFL-unstable simulation made 1e35)
    squared_data_hint(report, step)  # (a GP's squared residual of outcomes of 1e25, float32)
    outlier_weight_hint(report, step)  # (a checkpoint's weight of 2e38: a flipped exponent bit)
    written_weights_hint(report, step)  # (a head re-initialised mid-run with a std of 1e38)
    grown_argument_hint(report, step)  # (an EMA teacher's logits of 1e9 with decay > 1)
    grouped_arg_hint(report, step)  # (a preference pair's NaN rating gap: the pair's rows)
    single_sample_hint(report, step)  # (InfoLOOB's negatives of a last batch of one)
    same_record_pairs_hint(report, step)  # (a triplet whose positive is its anchor's text)
    padding_batch_hint(report, step)  # (a segment past every piece's end: mean of none)
    unselected_targets_hint(report, step)  # (an SFT answer truncated away: labels all -100)
    zero_weights_hint(report, step)  # (a last short batch of records all weighted 0)
    empty_records_hint(report, step)  # (a per-line mean over an empty stroke file's mask)
    absent_channels_hint(report, step)  # (a Dice of a structure absent from a scan's labels)
    dead_channels_hint(report, step)  # (dF/F of a ROI reading 0 all trial)
    empty_graphs_hint(report, step)  # (a per-atom energy of a structure with no atoms)
    empty_counts_hint(report, step)  # (log of a library size of a cell with no counts)
    zero_records_hint(report, step)  # (a metric depth scaled by a focal length left at 0)
    padded_units_hint(report, step)  # (HAN's padding sentences through its word attention)
    causal_buffer_hint(report, step)  # (nanoGPT's masked_fill(self.bias == 1): the diagonal)
    pole_buffer_hint(report, step)  # (ALiBi slopes 1 / arange(H): 1 / 0, then inf * 0)
    constant_columns_hint(report, step)  # (x.std(0) of a gene no cell of the batch expresses)
    grown_number_hint(report, step)  # (an augmented Lagrangian's rho past float32's range)
    column_scale_hint(report, step)  # (a variable in millimetres among metres: NOTEARS' X)
    data_pole_hint(report, step)  # (log1p of a count filled with -1 for missing)
    zero_bound_hint(report, step)  # (a log barrier under a line rating filled with 0)
    negative_hint(report, step)  # (exp(-k t) of a time since dose of -150 h)
    nan_attribute_hint(report, step)  # (a KL warm-up weight of 0/0 the loop set on the loss)
    zero_number_hint(report, step)  # (a label range hi - lo fitted on one value: 0)
    zero_norm_eps_hint(report, step)  # (a config's LayerNorm eps of 0 over a constant row)
    zero_eps_attribute_hint(report, step)  # (a Dice's smooth_dr built as 0, added as eps)
    sentinel_inputs_hint(report, step)  # (VIBO's encoder given responses coded -999 unmasked)
    other_inputs_note(report, step)  # (a bad reading in some windows' inputs, others' targets)
    nan_cast_hint(report, step)  # (NaN intrinsics' frustum points voxelised by .long())
    ignored_micro_batch_hint(report, step)  # (gold SQL no action of kept, one micro-batch)
    spread_grads_note(report, step)  # (a clip_grad_norm_ of a NaN total norm: every grad NaN)
    perfect_fit_hint(report, step)  # (PSNR's max² / mse of an identity net on a clean pair)
    output_range_hint(report, step)  # (MS-SSIM's sim ** beta of a tanh output in [-1, 1])
    constant_output_hint(report, step)  # (a Pearson loss of a persistence forecast: flat)
    zero_output_hint(report, step)  # (a KL of a ReLU-normalised histogram: a bin at 0)
    if (o := report.get("origin")) is not None and "all_samples" in o:
        o["all_samples"] = whole_batch(o)  # (a hint named the rows: a micro-batch's, all)

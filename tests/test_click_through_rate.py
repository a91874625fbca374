"""End to end on click-through-rate models (``click_through_rate_models``): DeepFM over hashed
fields and log1p'd, batch-normalised counts; DIN's target attention over a 0-padded behaviour
sequence; DCN-v2's cross layers under float16 autocast; BCE with logits weighted ``1 / rate``
for negative downsampling; a DataLoader over a TensorDataset; Adam (SparseAdam beside it for
sparse tables), an exponential schedule and gradient clipping. Each planted bug of the domain
fires under the recorder and is replayed with the CLI; the healthy runs raise no event and
train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import click_through_rate_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

STEPS = 4
LAST = (STEPS - 1) * M.B  # the first row of the last step's batch
MAX_DWELL = 500.0  # the training log's largest count, DCN's min-max scale


def line_of(text: str) -> str:
    return source_line("click_through_rate_models.py", text)


def optimizers(model, make: str):
    """Adam over the dense part; a sparse model's tables get SparseAdam (DeepCTR's split)."""
    if "sparse" not in make:
        return torch.optim.Adam(model.parameters(), lr=1e-2), None
    tables = {id(model.emb.weight), id(model.first.weight)}
    dense = [p for p in model.parameters() if id(p) not in tables]
    sparse = torch.optim.SparseAdam([model.emb.weight, model.first.weight], lr=1e-2)
    return torch.optim.Adam(dense, lr=1e-2), sparse


def train(make: str, out_dir, plant=None, record: bool = True, amp=None,
          accum: int = 1):
    """Four batches of 16 impressions; ``plant(tensors, LAST)`` edits the last batch's rows
    before the DataLoader reads them. DIN takes (fields, candidate, history); DeepFM takes
    the raw counts (it log1p's them itself), DCN the counts min-max scaled by the log's
    largest. With ``accum``, each batch is that many micro-batches (DataLoader batches of
    ``16 / accum``), the loss divided by it, one update per batch. Returns the model."""
    model = getattr(M, make)()
    data = M.impressions(STEPS * M.B)
    if plant is not None:
        plant(data.tensors, LAST)
    opt, sparse = optimizers(model, make)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)
    rec = FlightRecorder(model, opt, loss_fn=M.weighted_bce, out_dir=out_dir,
                         factory=f"click_through_rate_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else M.weighted_bce
        for k, (cat, num, item, hist, click, rate) in enumerate(M.loader(data, M.B // accum)):
            args = (cat, item, hist) if "din" in make else (
                cat, num / MAX_DWELL if "dcn" in make else num)
            with torch.autocast("cpu", dtype=amp or torch.float16, enabled=amp is not None):
                logits = model(*args)
            loss = loss_fn(logits.float(), click, 1.0 / rate) / accum
            loss.backward()
            if (k + 1) % accum:
                continue
            torch.nn.utils.clip_grad_norm_(opt.param_groups[0]["params"], 5.0)
            opt.step()
            opt.zero_grad()
            if sparse is not None:
                sparse.step()
                sparse.zero_grad()
            sched.step()
    return model


def fire(make: str, tmp_path, plant, amp=None, accum: int = 1):
    with pytest.raises(NonFiniteError) as info:
        train(make, tmp_path, plant, amp=amp, accum=accum)
    return info.value.event, info.value.bundle_path


def missing_count(code: float = -1.0):
    def plant(tensors, first):
        tensors[1][first + 5, 1] = code  # BUG: the join's fillna(-1) for a user with no clicks
    return plant


POLE = "log1p of -1 (a pole: -inf)"
BELOW = "log1p of a number below -1 (as low as -2)"


@pytest.mark.parametrize("make,code,made,said", [("make_deepfm", -1.0, "-inf", POLE),
                                                 ("make_sparse_deepfm", -1.0, "-inf", POLE),
                                                 ("make_deepfm", -2.0, "nan", BELOW)])
def test_missing_count_code_names_log1p_not_the_batch_norm_that_spread_it(
        tmp_path, make, code, made, said):
    """A count joined as -1 for "missing" is log1p'd to -inf in forward; BatchNorm's batch
    mean then spreads NaN to every row. The event sees NaN in all 16 rows of the root's
    output; the replay names the log1p on record 5 alone, the -1 at its pole (-2: below its
    domain, NaN), that the batch itself holds that code (a missing value to impute, not a
    value to clamp), and dropping the record makes the step finite; the same with the
    tables sparse under SparseAdam beside the recorded Adam."""
    ev, bundle = fire(make, tmp_path, missing_count(code))
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (3, "forward", "", "nan"), ev
    assert ev["samples"] == list(range(M.B)), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "", "aten.log1p", made, [5]), o
    assert o["source"] == line_of("dense = self.num_bn(torch.log1p(num))"), o
    assert rep["cause"] == "invalid" and said in rep["hint"], rep["hint"]
    assert "keep the input above -1 (x.clamp_min(-1 + eps))" in rep["hint"], rep["hint"]
    assert f"args[1] holds {code:g} at sample(s) 5 (column 1) as the batch gave it" in rep["hint"]
    assert "missing value" in rep["hint"] and "impute" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def empty_history(tensors, first):
    tensors[3][first + 7] = 0  # a new user: every behaviour slot is padding


def test_din_softmax_over_an_empty_history_names_the_fully_masked_row(tmp_path):
    """A cold-start user's history is all padding, so the -inf-padded softmax of the target
    attention has no valid position: NaN in that user's row only. The replay names the
    softmax in ``att`` on its line, sample 7, the fully masked row (and the padding
    embedding's 0 that the weighted sum multiplied the NaN by)."""
    ev, bundle = fire("make_din", tmp_path, empty_history)
    assert (ev["step"], ev["phase"], ev["module"], ev["call"], ev["samples"]) == (
        3, "forward", "att", 0, [7]), ev
    rep = nanreplay_json(bundle, "--try", "drop=7")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "att", "aten._softmax", "nan", [7]), o
    assert o["source"] == line_of('w = torch.softmax(scores.masked_fill(~mask, float("-inf"))'), o
    assert rep["cause"] == "invalid" and "fully masked row" in rep["hint"], rep["hint"]
    assert "keep at least one key per row" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def late_empty_history(tensors, first):
    tensors[3][first + M.B // 2 + 3] = 0  # the cold-start user in the second micro-batch


def test_din_empty_history_under_accumulation_names_the_micro_batch_and_its_row(tmp_path):
    """Two micro-batches of 8 per update: the cold-start user is row 3 of the second one.
    The event and the replay name micro-batch 1 and its row 3 (not row 11 of the update)."""
    ev, bundle = fire("make_din", tmp_path, late_empty_history, accum=2)
    assert (ev["step"], ev["module"], ev["micro_batch"], ev["samples"]) == (3, "att", 1, [3]), ev
    rep = nanreplay_json(bundle, "--try", "drop=3")
    o = rep["origin"]
    assert (o["module"], o["op"], o["micro_batch"], o["samples"]) == (
        "att", "aten._softmax", 1, [3]), o
    assert rep["cause"] == "invalid" and "fully masked row" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_din_manual_softmax_of_an_empty_history_is_0_by_0_not_an_underflow(tmp_path):
    """The same cold-start user under a hand-written masked softmax, ``e = exp(s - max) *
    mask; e / e.sum()``: the row's sum is 0 because the bool mask zeroed every term, exactly,
    not because exp underflowed. The replay names the division, sample 7, and ``invalid``
    0/0 (it had said ``underflow`` and sent the user to log space: the bool factor was not
    read as one that can be 0)."""
    ev, bundle = fire("make_din_manual", tmp_path, empty_history)
    assert (ev["step"], ev["module"], ev["samples"]) == (3, "att", [7]), ev
    rep = nanreplay_json(bundle, "--try", "drop=7")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("att", "aten.div", "nan", [7]), o
    assert o["source"] == line_of("w = e / e.sum(-1, keepdim=True)"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert "skip the rows where it is 0" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_mean_pooled_history_of_a_cold_start_user_names_the_0_by_0_average(tmp_path):
    """YouTube-DNN's average of the watched items' embeddings, divided by the count of valid
    positions: 0/0 for the user with none (the padding row's embedding is 0 too). The replay
    names the division in ``att``, sample 7, 0/0 and a floor on the count or skipping the row."""
    ev, bundle = fire("make_din_mean", tmp_path, empty_history)
    assert (ev["step"], ev["module"], ev["samples"], ev["kind"]) == (3, "att", [7], "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=7")
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"]) == ("att", "aten.div", [7]), o
    assert o["source"] == line_of("return keys.sum(1) / mask.sum(-1, keepdim=True)"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert "clamp_min(eps)" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def zero_rate(row: int):
    def plant(tensors, first):
        tensors[5][first + row] = 0.0  # BUG: a rate logged as 0 for a dropped-traffic slice
    return plant


@pytest.mark.parametrize("row,what", [(2, "aten.mul"), (0, "aten.div")])
def test_downsampling_rate_of_0_names_the_sample_weight_argument_and_its_row(tmp_path, row, what):
    """A negative logged with a sampling rate of 0 gets the weight ``1 / 0 = inf``: an input
    event on the loss's weight argument, on that record, not blamed on the model; the loss
    re-run names the op that turned it into NaN: ``0 * inf`` where the record's BCE is
    exactly 0 in float32 (a logit of -22, row 2), else the normalisation's ``inf / inf``."""
    ev, bundle = fire("make_deepfm", tmp_path, zero_rate(row))
    assert (ev["step"], ev["phase"], ev["tensor"], ev["kind"], ev["samples"]) == (
        3, "input", "loss_args[2]", "+inf", [row]), ev
    rep = nanreplay_json(bundle, "--try", f"drop={row}")
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["tensor"], o["samples"]) == (
        True, "input", "loss_args[2]", [row]), o
    assert rep["cause"] == "input", rep
    assert rep["hint"].startswith("loss_args[2] (weights) holds +inf"), rep["hint"]
    line = line_of("return (bce * weights).sum() / weights.sum()")
    assert f"{what} ({line}) computed" in rep["hint"], rep["hint"]
    assert "check the data pipeline for these samples" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def long_session(tensors, first):
    tensors[1][first + 4, 2] = 5e6  # dwell of an idle tab: 10^4 times the log's largest


def test_dcn_cross_layers_under_fp16_autocast_overflow_on_an_out_of_scale_record(tmp_path):
    """Min-max scaling by the training log's largest dwell leaves an idle session at 10^4;
    the first cross layer multiplies by x0 again, and autocast's cast of its output into
    the second layer's float16 matmul overflows. The replay names that cast in ``cross.w.1``
    on record 4 alone (one run of the loop's line: autocast's three casts in one Linear call
    are not three iterations), overflow, float32 as the fix and the record as out of scale
    (not its column as one in other units)."""
    ev, bundle = fire("make_dcn", tmp_path, long_session, amp=torch.float16)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        3, "forward", "cross.w.1", [4]), ev
    rep = nanreplay_json(bundle, "--try", "drop=4")
    o = rep["origin"]
    assert (o["module"], o["call"], o["op"], o["made"], o["samples"]) == (
        "cross.w.1", 0, "aten._to_copy", "+inf", [4]), o
    assert o["line_run"] == 1, o
    assert o["source"] == line_of("x = x0 * lin(x) + x"), o
    assert rep["cause"] == "overflow" and "float16" in rep["hint"], rep["hint"]
    assert "float32" in rep["hint"] and "out of scale" in rep["hint"], rep["hint"]
    # (the record, not the column's unit: every other row's dwell is in range)
    assert "standardise the columns" not in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


@pytest.mark.parametrize("make,plant,amp", [
    ("make_deepfm", None, None),
    ("make_sparse_deepfm", None, None),
    ("make_din", None, None),
    ("make_din_unnormalised", empty_history, None),
    ("make_din_nan_to_num", empty_history, None),
    ("make_dcn", None, torch.float16),
    ("make_dcn", long_session, torch.bfloat16)])
@pytest.mark.parametrize("accum", [1, 2])
def test_healthy_runs_raise_nothing_and_train_the_same(tmp_path, make, plant, amp, accum):
    """DeepFM (dense and with sparse tables under SparseAdam), DIN with -inf padding that
    stays inside its softmax, DIN's own unnormalised attention over a cold-start user's empty
    history (all weights 0: finite), the -inf-padded softmax's NaN row of that user taken back
    by ``nan_to_num`` (masked_fill's backward gives the filled scores no gradient, so none of
    it reaches the weights), DCN-v2 under float16 autocast, and under bfloat16 with the idle
    session's 10^4 (within bfloat16's range, which float16's is not), each with and without two
    accumulated micro-batches: no event, bit-identical weights with and without the
    recorder."""
    recorded = train(make, tmp_path, plant, amp=amp, accum=accum)
    plain = train(make, tmp_path, plant, record=False, amp=amp, accum=accum)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name

"""End to end on a streaming-ASR conformer transducer (``speech_transducers_models``):
SpecAugment and utterance CMVN in the front end, ESPnet's 4x ``Conv2dSubsampling``, conformer
blocks with key padding masks, an LSTM prediction network, the additive joiner over
(B, T, U+1, V), and icefall's hybrid ``rnnt + 0.3 * ctc`` loss (the RNN-T recursion by hand,
``F.ctc_loss`` on the CTC head), trained with AdamW under a warmup schedule and gradient
clipping over a DataLoader of padded utterances. Each planted failure of the domain fires under
the recorder and is replayed with the CLI; the healthy run raises no event and trains
bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import pytest
import speech_transducers_models as M
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("speech_transducers_models.py", text)


def train(make: str, loss, out_dir, special=None, steps: int = 4, record: bool = True,
          amp: bool = False, corpus=M.corpus, accum: int = 1, collate=M.collate):
    """AdamW with a linear warmup and clip_grad_norm_, 4 utterances a batch, ``accum`` batches
    accumulated per update; ``special``: corpus index -> (frames, labels) of planted
    utterances; ``amp``: the forward and the loss under bfloat16 autocast. Returns the
    model."""
    model = getattr(M, make)()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    loader = DataLoader(corpus(4 * steps * accum, special), batch_size=4, collate_fn=collate)
    torch.manual_seed(1)  # (SpecAugment's masks)
    rec = FlightRecorder(model, opt, loss_fn=loss, out_dir=out_dir,
                         factory=f"speech_transducers_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else loss
        for i, (feats, feat_lens, ys, y_lens) in enumerate(loader):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                out = model(feats, feat_lens, ys)
                value = loss_fn(out, ys, y_lens) / accum
            value.backward()
            if (i + 1) % accum == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                opt.step()
                sched.step()
                opt.zero_grad()
    return model


def fire(make: str, loss, tmp_path, special=None, steps: int = 4):
    with pytest.raises(NonFiniteError) as info:
        train(make, loss, tmp_path, special, steps)
    return info.value.event, info.value.bundle_path


def nan_rows_of_cmvn(make: str, special=None, steps: int = 4) -> tuple[int, list[int]]:
    """The rows of the first CMVN output holding NaN in an unrecorded run of the same loop (a
    forward hook on a copy: the replay's claim, checked independently)."""
    model = getattr(M, make)
    seen: list[torch.Tensor] = []

    def hooked():
        m = model()
        m.cmvn.register_forward_hook(lambda mod, i, o: seen.append(o.detach().isnan()))
        return m

    M.make_hooked = hooked
    try:
        train("make_hooked", M.hybrid_loss_safe, None, special, steps, record=False)
    finally:
        del M.make_hooked
    step = next(i for i, o in enumerate(seen) if o.any())
    return step, torch.nonzero(seen[step].flatten(1).any(1)).flatten().tolist()


def test_frequency_mask_before_utterance_cmvn_names_its_division_and_asks_for_an_eps(tmp_path):
    """SpecAugment run before the per-utterance mean/var normalisation (ESPnet's order, with
    ``norm_vars=True`` and no eps): a masked frequency band is 0 in every frame of the clip,
    its variance 0, and ``(x - mean) / std`` is 0/0 at the first step, in every utterance
    that drew a band."""
    step, rows = nan_rows_of_cmvn("make_transducer_specaug_first")
    assert step == 0, step
    ev, bundle = fire("make_transducer_specaug_first", M.hybrid_loss_safe, tmp_path)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "forward", "cmvn", "nan")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "cmvn", "aten.div", "nan", rows), o
    assert o["source"] == line_of("return (x - mean) / var.sqrt() * mask"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert "add an eps to the denominator" in rep["hint"], rep["hint"]


def test_time_masks_over_a_whole_short_clip_name_its_cmvn_division_and_row(tmp_path):
    """Time masks only, still before the CMVN: an 11-frame clip (index 17, row 1 of the fifth
    batch) drew masks of up to 20 frames that cover all of it, so its every frame is 0 and
    its std 0. The replay names the division on that row alone (BatchNorm in the conv module
    spreads the NaN to the other rows' outputs, which the event names), and dropping the row
    makes the step finite."""
    special = {17: (11, 1)}
    assert nan_rows_of_cmvn("make_transducer_time_masks_first", special, 6) == (4, [1])
    ev, bundle = fire("make_transducer_time_masks_first", M.hybrid_loss_safe, tmp_path,
                      special, steps=6)
    assert (ev["step"], ev["phase"], ev["module"]) == (4, "forward", "cmvn"), ev
    rep = nanreplay_json(bundle, "--try", "drop=1")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("cmvn", "aten.div", "nan", [1])
    assert rep["cause"] == "invalid" and "skip the rows where it is 0" in rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_global_cmvn_stats_of_narrowband_audio_name_the_buffer_and_its_bins(tmp_path):
    """WeNet's global CMVN with stats computed over 8 kHz audio resampled to 16 kHz: the top
    4 mel bins hold the log floor in every frame, their std in the stats file is 0, and
    ``(x - mean) / std`` divides by it at the first step. The replay names the buffer, its
    zero bins, no record to drop, and the floor to put on the stats."""
    def corpus(n, special=None):
        return M.narrowband(M.corpus(n, special))

    with pytest.raises(NonFiniteError) as info:
        train("make_transducer_global_cmvn", M.hybrid_loss_safe, tmp_path, corpus=corpus)
    ev, bundle = info.value.event, info.value.bundle_path
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "forward", "cmvn"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["all_samples"]) == ("cmvn", "aten.div", True), o
    assert o["source"] == line_of("return (x - self.mean) / self.std * mask"), o
    hint = rep["hint"]
    assert rep["cause"] == "invalid" and "the buffer cmvn.std" in hint, hint
    assert "0 at entries 12, 13, 14, 15 of its shape (16,)" in hint, hint
    assert "no record is to blame" in hint and "std.clamp_min(eps)" in hint, hint


def rows_with_a_blind_frame(special) -> list[int]:
    """The utterances of the last batch with a frame (padding) that WeNet's chunk mask and the
    key padding leave no key to see, computed from the batch's lengths alone."""
    _, feat_lens, _, _ = M.collate(M.corpus(16, special)[12:])
    lens = ((feat_lens - 1) // 2 - 1) // 2
    t = int(lens.max())
    pad = torch.arange(t)[None] >= lens[:, None]
    mask = pad[:, None, :] | M.outside_chunks(t, 4, 1)[None]
    return torch.nonzero(mask.all(-1).any(-1)).flatten().tolist()


def test_streaming_chunk_mask_past_a_short_utterance_names_the_softmax_and_rows(tmp_path):
    """WeNet's streaming conformer (chunks of 4 frames, 1 chunk of left context) without the
    ``masked_fill(mask, 0)`` after the softmax: a 120-frame utterance pads the batch to 29
    encoder frames, and a padded frame of a short utterance more than a chunk past its end
    sees no key (its own and left chunks are all padding). The softmax of that row is NaN,
    and the conv module carries it into the valid frames. The replay names the first block's
    softmax, the short utterances (not the long one), and the fully masked row."""
    special = {13: (120, 5)}
    rows = rows_with_a_blind_frame(special)
    assert rows == [0, 2, 3], rows
    ev, bundle = fire("make_streaming_transducer", M.hybrid_loss_safe, tmp_path, special)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (
        3, "forward", "blocks.0.attn", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "blocks.0.attn", "aten._softmax", "nan", rows), o
    assert o["source"] == line_of("attn = torch.softmax(scores, dim=-1)"), o
    assert [c["op"] for c in o["chain"]] == ["aten.masked_fill", "aten._softmax"], o["chain"]
    assert rep["cause"] == "invalid" and "every entry is -inf" in rep["hint"], rep["hint"]
    assert "keep at least one key per row" in rep["hint"], rep["hint"]


def test_time_masks_in_the_loader_before_cmvn_are_an_input_event_of_the_clip(tmp_path):
    """The same masks and CMVN run as the loader's input transforms (Lhotse's order): the
    NaN reaches the model in the batch. The event and the replay name the input, the clip's
    row, a normalisation's division in the data pipeline; dropping it makes the step finite."""
    with pytest.raises(NonFiniteError) as info:
        train("make_transducer_normalised_input", M.hybrid_loss_safe, tmp_path, {13: (11, 1)},
              collate=M.AugmentingCollate())
    ev, bundle = info.value.event, info.value.bundle_path
    assert (ev["step"], ev["phase"], ev["samples"]) == (3, "input", [1]), ev
    rep = nanreplay_json(bundle, "--try", "drop=1")
    assert (rep["cause"], rep["origin"]["samples"]) == ("input", [1]), rep
    assert "division by zero in normalisation" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_clip_shorter_than_the_subsampling_names_ctc_and_its_zero_frames(tmp_path):
    """A 5-frame clip (a click the VAD kept) has ``((5 - 1) // 2 - 1) // 2 = 0`` frames after
    the 4x subsampling: the attention's fully masked row is handled by SDPA, but CTC cannot
    align its 2 labels to 0 frames and returns +inf. The replay names the CTC loss, the
    utterance's row in the last batch, and its 0 frames."""
    ev, bundle = fire("make_transducer", M.hybrid_loss, tmp_path, {13: (5, 2)})
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "loss", "+inf"), ev
    rep = nanreplay_json(bundle, "--try", "drop=1")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "<loss>", "aten._ctc_loss", "+inf", [1]), o
    assert o["source"] == line_of("ctc = F.ctc_loss(ctc_lp.transpose(0, 1)"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "row 1: target of 2 labels needs 2 frames, the input has 0" in rep["hint"]
    assert "zero_infinity=True" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_labels_longer_than_the_subsampled_frames_name_the_utterance(tmp_path):
    """A 20-frame clip transcribed with 6 labels: 4 frames after subsampling, fewer than the
    labels (T' < U): the CTC branch's +inf, on that utterance, with the frames it needs."""
    ev, bundle = fire("make_transducer", M.hybrid_loss, tmp_path, {13: (20, 6)})
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "loss", "+inf"), ev
    rep = nanreplay_json(bundle, "--try", "drop=1")
    o = rep["origin"]
    assert (o["op"], o["samples"], rep["cause"]) == ("aten._ctc_loss", [1], "invalid"), rep
    assert "row 1: target of 6 labels needs " in rep["hint"], rep["hint"]
    assert "the input has 4" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_empty_transcript_under_a_per_token_loss_names_the_count_not_an_eps(tmp_path):
    """A noise clip kept with an empty transcript (0 labels) under ESPnet's per-token
    normalisation ``nll / y_lens``: +inf at its row. The divisor is an integer length the
    batch carries, so the hint says so and asks to drop the record or mask it out, not to
    weight it by 1/eps."""
    ev, bundle = fire("make_transducer", M.rnnt_loss_per_token, tmp_path, {13: (50, 0)})
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "loss", "+inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "<loss>", "aten.div", "+inf", [1]), o
    assert o["source"] == line_of("return (rnnt_nll(logits, ys, t_lens, y_lens) / y_lens)"), o
    assert rep["cause"] == "invalid", rep["cause"]
    # (was: "add an eps to the denominator" alone, for a count of labels)
    assert "a length of 0: an empty transcript" in rep["hint"], rep["hint"]
    assert "an eps would weight their error by 1/eps" in rep["hint"], rep["hint"]


def test_an_unalignable_utterance_in_the_second_accumulated_batch_is_named_there(tmp_path):
    """Two batches accumulated per update; the 20-frame clip with 6 labels is corpus index 14,
    row 2 of the second batch of the second update: the event and the replay name that
    micro-batch and row, and dropping it makes the step finite."""
    with pytest.raises(NonFiniteError) as info:
        train("make_transducer", M.hybrid_loss, tmp_path, {14: (20, 6)}, steps=2, accum=2)
    ev, bundle = info.value.event, info.value.bundle_path
    assert (ev["step"], ev["phase"], ev["micro_batch"]) == (1, "loss", 1), ev
    rep = nanreplay_json(bundle, "--try", "drop=2")
    o = rep["origin"]
    assert (o["op"], o["micro_batch"], o["samples"]) == ("aten._ctc_loss", 1, [2]), o
    assert "row 2: target of 6 labels needs " in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_log_add_written_out_underflows_on_a_long_utterance(tmp_path):
    """The RNN-T recursion's log-add written as ``log(exp(a) + exp(b))``: alpha falls ~2.5 per
    frame, and past -104 both exp round to 0 in float32, log(0) = -inf. A 400-frame utterance
    (row 1) pads the batch to 99 encoder frames, and the recursion runs over all of them: the
    first log to make -inf does so in row 1's own frames and in row 0's padded ones (never
    read by the loss, but log's backward would make 0/0 there; rows 2 and 3 follow a few frames
    later, so dropping rows is no fix). The replay names the log, the rows of that first call,
    underflow, and asks for log space."""
    ev, bundle = fire("make_transducer", M.rnnt_loss_log_add_by_hand, tmp_path, {13: (400, 6)})
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "loss", "+inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "<loss>", "aten.log", "-inf", [0, 1]), o
    assert o["source"] == line_of("return torch.log(torch.exp(a) + torch.exp(b))"), o
    assert rep["cause"] == "underflow", rep["cause"]
    assert "compute in log space" in rep["hint"] and "logsumexp" in rep["hint"], rep["hint"]


def test_max_trick_log_add_over_unreachable_cells_names_the_subtraction(tmp_path):
    """The monotonic RNN-T (one symbol per frame) starts alpha at (0, -inf, ...) and shifts a
    -inf in at u = 0: a cell u > t has no path. Its log-add written with the max trick,
    ``m + log(exp(a - m) + exp(b - m))``, computes -inf - -inf = NaN at such a cell, in every
    utterance at the first step. The replay names that subtraction (not the intended -inf
    ``alpha.new_full`` before it, which reads only alpha's dtype and device) and its -inf
    operands put in on purpose."""
    ev, bundle = fire("make_transducer", M.monotonic_loss, tmp_path)
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "loss", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["all_samples"]) == (
        "<loss>", "aten.sub", "nan", True), o
    assert o["source"] == line_of("return m + torch.log(torch.exp(a - m)"), o
    assert [c["op"] for c in o["chain"]] == ["aten.new_full", "aten.sub"], o["chain"]
    assert o["chain"][0]["intentional"] is True, o["chain"]
    assert rep["cause"] == "invalid" and "inf - inf" in rep["hint"], rep["hint"]
    assert "large finite negative number" in rep["hint"], rep["hint"]


def test_where_guard_after_the_log_add_names_the_log_backward_and_the_double_where(tmp_path):
    """The max-trick log-add guarded as ``torch.where(isinf(m), m, safe + log(...))``: the
    forward is finite (-inf at the unreachable cells), but the log was still computed at 0
    there, and its backward multiplies the where's 0 gradient by 1/0. The replay names that
    backward node, every utterance, and the fix: a safe input before the op."""
    ev, bundle = fire("make_transducer", M.monotonic_loss_guarded, tmp_path)
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "backward", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["all_samples"]) == (
        "backward", "<loss>", "LogBackward0", True), o
    assert o["source"] == line_of("return torch.where(torch.isinf(m), m, safe + torch.log("), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "still sends the gradient through both branches" in rep["hint"], rep["hint"]
    assert "make the op's input safe before the op" in rep["hint"], rep["hint"]


def test_labels_outnumbering_frames_in_a_monotonic_transducer_name_the_unreachable_cell(
        tmp_path):
    """The monotonic RNN-T with a correct log-add (the double where: -inf stays -inf, no NaN
    either way) and the 20-frame clip with 6 labels: 4 encoder frames cannot emit 6 labels,
    so its final cell alpha[T, U] keeps the -inf it started from, and the loss is +inf. The
    replay names the sum that folded it in, the utterance alone, the index op that read the
    unreachable cell, and asks to filter such utterances or zero their loss."""
    ev, bundle = fire("make_transducer", M.monotonic_loss_safe, tmp_path, {13: (20, 6)})
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "loss", "+inf"), ev
    rep = nanreplay_json(bundle, "--try", "drop=1")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "<loss>", "aten.sum", "+inf", [1]), o
    assert o["chain"][0]["intentional"] is True, o["chain"]
    hint = rep["hint"]
    # (was: "give the masked entries zero weight in the loss (label smoothing ...)")
    assert f"aten.index ({line_of('return -torch.stack(rows, 1)[torch.arange(b)')})" in hint
    assert "a lattice's final cell that no path reaches" in hint, hint
    assert "filter those whose targets outnumber their frames" in hint, hint
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


@pytest.mark.parametrize("make,loss,special,amp", [
    ("make_transducer", M.hybrid_loss, None, False),
    ("make_transducer", M.hybrid_loss, None, True),
    ("make_transducer", M.monotonic_loss_safe, None, False),
    ("make_transducer_espnet_attention", M.hybrid_loss_safe, {13: (5, 2)}, False),
    ("make_streaming_transducer_refilled", M.hybrid_loss_safe, {13: (120, 5)}, False)])
def test_healthy_transducer_raises_nothing_and_trains_the_same(tmp_path, make, loss, special,
                                                                amp):
    """CMVN before SpecAugment, the RNN-T by ``torch.logaddexp`` and CTC, with key padding
    masks (their -inf stays inside the attention) over utterances of 40-64 frames, in float32
    and under bfloat16 autocast; the monotonic RNN-T with the double-where log-add, its
    unreachable cells at -inf in the forward and no NaN in the backward; and ESPnet's older attention over a clip of 0 frames after
    subsampling, under CTC's zero_infinity, and WeNet's streaming chunk mask over padding no
    key is left for: their softmax over no key is NaN in the forward and in its backward, and
    both are taken back by the masked_fills around it. No event, and
    bit-identical weights with and without the recorder."""
    recorded = train(make, loss, tmp_path, special, amp=amp)
    plain = train(make, loss, tmp_path, special, record=False, amp=amp)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name

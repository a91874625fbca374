"""End to end on knowledge tracing models (``knowledge_tracing_models``): DKT's LSTM,
DKT-Forget's time-gap feature, SAKT's hand-written causal attention and AKT's monotonic
attention with Rasch embeddings, trained on padded student sequences with a masked next-response
BCE, Adam, a warm-up schedule, gradient clipping and an AUC evaluation under ``no_grad``. Each
planted bug of the domain fires under the recorder and is replayed with the CLI; the healthy
versions raise no event and train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import knowledge_tracing_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("knowledge_tracing_models.py", text)


def model_args(kind: str, q, c, r, t) -> tuple[tuple, dict]:
    """The model's positional and keyword arguments (DKT-Forget's timestamps by name)."""
    if kind == "akt":
        return (q, c, r), {}
    if kind in ("dkt_forget", "dkt_retention"):
        return (q, r), {"t": t}
    if kind in ("sakt_left", "sakt_right"):
        return (q, r, q > 0), {}
    return (q, r), {}


def auc(scores, labels) -> float:
    """The rank-sum AUC of the evaluation loop (ties ignored: scores are continuous)."""
    order = scores.argsort()
    ranks = torch.empty_like(scores).scatter_(0, order, torch.arange(1., len(scores) + 1))
    pos = labels.bool()
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / max(n_pos * n_neg, 1))


def evaluate(model, kind: str, batch) -> float:
    q, c, r, t, m = batch
    model.eval()
    with torch.no_grad():
        args, kwargs = model_args(kind, q, c, r, t)
        p = torch.sigmoid(model(*args, **kwargs))
    model.train()
    valid = m[:, 1:]
    return auc(p[valid], r[:, 1:][valid])


def train(kind: str, make: str, out_dir, loss=M.next_response_loss, steps: int = 4,
          record: bool = True, bf16: bool = False, accum: int = 1, **bad):
    """Adam with a linear warm-up, clipping at 1.0 and an AUC check after each step, as pykt
    trains, over ``accum`` micro-batches a step; the bad student (``short=`` or ``clock=``) is
    in the last micro-batch of the last step. Returns the model and its AUCs."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))
    g = torch.Generator().manual_seed(0)
    held_out = M.student_batch(torch.Generator().manual_seed(9))
    if kind == "sakt_left":
        held_out = M.left_padded(*held_out)
    torch.manual_seed(1)  # dropout
    rec = FlightRecorder(model, opt, loss_fn=loss, out_dir=out_dir,
                         factory=f"knowledge_tracing_models:{make}") if record else None
    aucs = []
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else loss
        for step in range(steps):
            opt.zero_grad()
            for k in range(accum):
                last = step == steps - 1 and k == accum - 1
                q, c, r, t, m = M.student_batch(g, **(bad if last else {}))
                if kind == "sakt_left":
                    q, c, r, t, m = M.left_padded(q, c, r, t, m)
                with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
                    args, kwargs = model_args(kind, q, c, r, t)
                    logits = model(*args, **kwargs)
                (loss_fn(logits.float(), r, m) / accum).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            aucs.append(evaluate(model, kind, held_out))
    return model, aucs


def fire(kind: str, make: str, tmp_path, loss=M.next_response_loss, accum: int = 1, **bad):
    with pytest.raises(NonFiniteError) as info:
        train(kind, make, tmp_path, loss=loss, accum=accum, **bad)
    return info.value.event, info.value.bundle_path


def test_single_interaction_student_names_the_per_student_mean_and_the_student(tmp_path):
    """A student who answered one question has no next response to predict: the per-student
    mean ``(bce * valid).sum(1) / valid.sum(1)`` is 0/0 in that row. A loss event; the replay
    names the division on its line, the student, says to add an eps (or skip such rows) and
    that the student's mask holds one step only (so its next-step mask is empty) and such
    records are to be filtered; dropping the student makes the step finite."""
    ev, bundle = fire("dkt", "make_dkt", tmp_path, short=3)
    assert (ev["step"], ev["phase"]) == (3, "loss"), ev
    rep = nanreplay_json(bundle, "--try", "drop=3")
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "loss", "<loss>", "aten.div", "nan", [3]), o
    assert o["source"] == line_of("per_student = (bce * valid).sum(1) / valid.sum(1)"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    # (the mask is not empty in that row: its one interaction leaves no next one, m[:, 1:])
    assert "Sample(s) 3 are records of a single step: loss_args[2]" in rep["hint"], rep["hint"]
    assert "filter records shorter than 2 steps" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_sakt_mask_excluding_the_current_interaction_names_the_softmax_of_the_empty_row(
        tmp_path):
    """SAKT's query at position i is already the next question, so interaction i is in its
    past; a mask copied from AKT's retriever (``triu(diagonal=0)``, the current item
    excluded) leaves the first query no key at all, and ``masked_fill(-inf)`` then softmax
    is NaN in that row of every student, at the first step. The replay names the softmax in
    ``attn`` after the intended ``-inf`` fill, every sample, and advises keeping a key per
    row or a finite mask value."""
    ev, bundle = fire("sakt", "make_sakt_strict", tmp_path)
    assert (ev["step"], ev["phase"], ev["module"], ev["call"], ev["kind"]) == (
        0, "forward", "attn", 0, "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["all_samples"]) == (
        True, "attn", "aten._softmax", "nan", True), o
    assert o["source"] == line_of("return torch.softmax(scores, -1) @ self.v(key)"), o
    assert [c["op"] for c in o["chain"]] == ["aten.masked_fill", "aten._softmax"], o["chain"]
    assert o["chain"][0]["intentional"] is True, o["chain"]
    assert rep["cause"] == "invalid" and "fully masked row" in rep["hint"], rep["hint"]
    assert "keep at least one key per row" in rep["hint"], rep["hint"]


def test_dkt_forget_timestamp_in_milliseconds_names_the_log_of_the_negative_gap(tmp_path):
    """DKT-Forget's time-gap feature ``log1p(minutes since the previous interaction)``: one
    student's log holds a timestamp in milliseconds among seconds, so the gap after it is
    about -2.8e7 minutes and log1p is NaN there. The replay names the log1p on its line in the
    root's forward, that student only, an input out of its domain, and the student's
    timestamps (``t``, given to the model by name) 990x the other students' as the data to fix
    rather than clamp; dropping the student makes the step finite."""
    ev, bundle = fire("dkt_forget", "make_dkt_forget", tmp_path, clock=5)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "", [5]), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "", "aten.log1p", "nan", [5]), o
    assert o["source"] == line_of("gap = torch.log1p(torch.cat("), o
    assert rep["cause"] == "invalid" and "below -1" in rep["hint"], rep["hint"]
    # (a clamp into log1p's domain would hide the record: the hint names its timestamps)
    assert 'But sample(s) 5 of kwargs["t"] reach 1.71e+09' in rep["hint"], rep["hint"]
    assert "out of scale" in rep["hint"] and "fix or filter them" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


@pytest.mark.parametrize("kind,make,bf16", [
    ("dkt", "make_dkt", False), ("dkt_forget", "make_dkt_forget", False),
    ("dkt_retention", "make_dkt_retention", False),
    ("sakt", "make_sakt", False), ("sakt_right", "make_sakt_left", False),
    ("akt", "make_akt", False), ("akt", "make_akt", True), ("akt", "make_akt_inf", False)])
def test_healthy_runs_raise_nothing_and_train_the_same(tmp_path, kind, make, bf16):
    """A student with a single interaction under the eps-guarded per-student mean; SAKT's
    ``-inf`` causal mask with the diagonal kept; ``nn.MultiheadAttention`` given both masks on
    right-padded students (every query keeps its first interaction); AKT's ``-1e32`` masks, its monotonic decay and
    its fully masked first retriever row, zero-padded after the softmax (also under bf16
    autocast, and with ``-inf`` for ``-1e32``: that row's NaN is replaced by the padding and
    masked_fill's backward zeroes its gradient, no weight goes non-finite); the AUC evaluation under ``no_grad`` after each step: no event, bit-identical
    weights and AUCs with and without the recorder."""
    recorded, aucs = train(kind, make, tmp_path, loss=M.next_response_loss_eps, bf16=bf16,
                           short=2)
    plain, plain_aucs = train(kind, make, tmp_path, loss=M.next_response_loss_eps, bf16=bf16,
                              short=2, record=False)
    assert not list(tmp_path.glob("*.nan"))
    assert aucs == plain_aucs and 0.0 < aucs[-1] < 1.0, aucs
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_length_bucket_of_single_interaction_students_names_the_mean_over_no_position(
        tmp_path):
    """Batches bucketed by length put every single-interaction student together (here the
    third of three accumulated micro-batches, which the event and the replay name): pykt's loss
    picks the real next positions with the mask (``logits[sm]``), none here, and the mean BCE
    over no element is 0/0. The replay names the BCE op on the loss line, an empty tensor,
    and says to skip such batches."""
    ev, bundle = fire("dkt", "make_dkt", tmp_path, loss=M.selected_loss, accum=3,
                      short=list(range(8)))
    assert (ev["step"], ev["phase"], ev["kind"], ev["micro_batch"]) == (3, "loss", "nan", 2), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["micro_batch"]) == (
        True, "<loss>", "aten.binary_cross_entropy_with_logits", "nan", 2), o
    assert o["source"] == line_of("return F.binary_cross_entropy_with_logits(logits[sm]"), o
    assert rep["cause"] == "invalid" and "empty tensor" in rep["hint"], rep["hint"]
    assert "skip such batches" in rep["hint"], rep["hint"]


def test_left_padded_sakt_with_both_attention_masks_names_the_padded_queries(tmp_path):
    """SAKT-pytorch pads at the front; given ``nn.MultiheadAttention`` a key padding mask of
    the padded interactions besides its causal mask, every padded query of a short student
    has no key left, and the softmax is NaN in those rows (the loss's mask then meets the NaN:
    0 * NaN). The replay names the softmax in ``attn``, the short students (not the one of
    full length), both masks together and the fixes: zero the padded outputs after the
    attention, a finite mask, or pad on the right (which trains, see the healthy runs)."""
    ev, bundle = fire("sakt_left", "make_sakt_left", tmp_path)
    assert (ev["step"], ev["phase"], ev["module"], ev["call"], ev["kind"]) == (
        0, "forward", "attn", 0, "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["samples"]) == (
        True, "attn", "aten._softmax", [1, 2, 3, 4, 5, 6, 7]), o
    # (torch's own code made the NaN: the user's line is the call giving both masks)
    assert o["source"] == line_of("h, _ = self.attn(e, x, x, attn_mask=future"), o
    assert rep["cause"] == "invalid" and "fully masked row" in rep["hint"], rep["hint"]
    assert "key_padding_mask and attn_mask together mask every key" in rep["hint"], rep["hint"]
    assert "is padding itself" in rep["hint"] and "pad on the right" in rep["hint"], rep["hint"]


def test_partial_credit_of_an_ungraded_answer_is_an_input_event_on_the_student(tmp_path):
    """Responses as partial credit, points / max points: an open question nobody graded is
    0 of 0, NaN in the responses the model takes (and the loss's targets). The recorder stops
    at the model's input before any op, and the replay names ``args[1]`` (the responses), the
    student, and the data pipeline's division as the place to look; dropping the student
    makes the step finite."""
    ev, bundle = fire("dkt", "make_dkt", tmp_path, ungraded=6)
    assert (ev["step"], ev["phase"], ev["kind"], ev["samples"]) == (3, "input", "nan", [6]), ev
    assert ev["detail"] == "non-finite value in the model's input args[1]", ev
    rep = nanreplay_json(bundle, "--try", "drop=6")
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["tensor"], o["samples"]) == (
        True, "input", "args[1]", [6]), o
    assert rep["cause"] == "input" and "division by zero" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_akt_distance_differentiated_names_the_sqrt_backward_in_the_encoder(tmp_path):
    """AKT computes its context-aware distance under ``no_grad``; taken out of it (to learn
    through the distance), the backward differentiates ``sqrt`` at the 0s every row has
    (an item's distance to itself, the clamped masked ones): a NaN gradient at the first
    step. The replay names ``SqrtBackward0`` in the encoder (the retriever keeps no_grad), on
    the sqrt's line, every student, and the derivative's pole at 0."""
    ev, bundle = fire("akt", "make_akt_learned_distance", tmp_path)
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "backward", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["module"], o["op"], o["all_samples"]) == (
        True, "backward", "encoder", "SqrtBackward0", True), o
    assert o["source"] == line_of("return torch.clamp((total - distcum) * position_effect"), o
    assert rep["cause"] == "invalid" and "derivative of sqrt has a pole" in rep["hint"], \
        rep["hint"]
    assert "sqrt(x + eps)" in rep["hint"], rep["hint"]


def train_epoch(out_dir, short: int | None, record: bool = True):
    """One epoch of DKT over a shuffled DataLoader of variable-length students padded by the
    collate_fn; returns the batches seen (the last one the event's, when one fires)."""
    model = M.make_dkt()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(M.StudentLogs(short=short), batch_size=8, shuffle=True,
                                         collate_fn=M.collate,
                                         generator=torch.Generator().manual_seed(3))
    rec = FlightRecorder(model, opt, loss_fn=M.next_response_loss, out_dir=out_dir,
                         factory="knowledge_tracing_models:make_dkt") if record else None
    seen = []
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else M.next_response_loss
        for q, r, m in loader:
            seen.append(m)
            opt.zero_grad()
            loss_fn(model(q, r), r, m).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    return seen


def test_dataloader_student_of_one_interaction_is_named_where_the_shuffle_put_it(tmp_path):
    """The same 0/0 with the students in a shuffled DataLoader whose collate_fn pads them:
    the event is at the batch that drew the single-interaction student, and the replay names
    the row the shuffle put it in (found here from the unrecorded epoch's masks)."""
    seen = train_epoch(None, short=13, record=False)
    step = next(i for i, m in enumerate(seen) if (m.sum(1) == 1).any())
    row = torch.nonzero(seen[step].sum(1) == 1).flatten().tolist()
    with pytest.raises(NonFiniteError) as info:
        train_epoch(tmp_path, short=13)
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (step, "loss"), (ev, step)
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], o["op"], o["samples"], rep["cause"]) == (
        True, "aten.div", row, "invalid"), (o, row)
    assert f"Sample(s) {row[0]} are records of a single step" in rep["hint"], rep["hint"]


def test_retention_of_a_negative_gap_names_the_exp_the_lstm_saved_and_the_student(tmp_path):
    """An Ebbinghaus retention ``exp(-gap / S)`` after a timestamp in milliseconds among
    seconds: the gap after it is about -4.7e5 hours and exp overflows in that student's row.
    The LSTM's gates saturate on the +inf, so the forward stays finite and the backward of the
    LSTM makes the NaN. The replay names that backward in ``lstm`` with the exp (its line,
    +inf) as the maker, the student, an overflow, and the student's timestamps as the data
    out of scale; not a column of ``t`` in other units (one record's value, in a sequence
    of time steps); dropping the student makes the step finite."""
    ev, bundle = fire("dkt_retention", "make_dkt_retention", tmp_path, clock=5)
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "backward", "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["module"], o["samples"]) == (
        True, "backward", "lstm", [5]), o
    assert o["op"].endswith("Backward0") and o["source"] == line_of("h, _ = self.lstm(x)"), o
    assert (o["chain"][0]["op"], o["chain"][0]["made"], o["chain"][0]["source"]) == (
        "aten.exp", "+inf", line_of("retention = torch.exp(-gap / F.softplus(")), o["chain"]
    assert rep["cause"] == "overflow", rep
    assert 'sample(s) 5 of kwargs["t"] reach 1.71e+09' in rep["hint"], rep["hint"]
    assert "column(s)" not in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def train_amp(out_dir, record: bool = True, steps: int = 6):
    """SAKT under float16 autocast with a GradScaler whose first scales overflow the
    gradients (skipped updates, the scale halved), as a mixed-precision KT run starts;
    returns the model and whether each step was skipped."""
    model = M.make_sakt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 22)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(1)
    rec = FlightRecorder(model, opt, loss_fn=M.next_response_loss_eps, out_dir=out_dir,
                         scaler=scaler,
                         factory="knowledge_tracing_models:make_sakt") if record else None
    skipped = []
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else M.next_response_loss_eps
        for _ in range(steps):
            q, _, r, _, m = M.student_batch(g, short=1)
            with torch.autocast("cpu", torch.float16):
                logits = model(q, r)
            opt.zero_grad()
            scaler.scale(loss_fn(logits.float(), r, m)).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped.append(scaler.get_scale() < before)
    return model, skipped


def test_float16_sakt_with_grad_scaler_skips_are_no_events_and_train_the_same(tmp_path):
    """Hand-written ``-inf`` causal attention under float16 autocast and a GradScaler that
    starts too high: the overflowing scaled gradients skip updates, as they should, and are
    no event; the weights are bit-identical with and without the recorder."""
    recorded, skipped = train_amp(tmp_path)
    plain, plain_skipped = train_amp(tmp_path, record=False)
    assert not list(tmp_path.glob("*.nan"))
    assert skipped == plain_skipped and any(skipped) and not all(skipped), skipped
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name

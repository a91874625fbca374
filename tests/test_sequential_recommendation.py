"""End to end on sequential recommenders (``sequential_recommendation_models``): SASRec with
``nn.MultiheadAttention`` over left-padded sequences, BERT4Rec's hand-written bidirectional
attention under the cloze objective, sampled softmax with the logQ correction, BPR, and
in-batch negatives with accidental positives masked to -inf. Each planted bug of the domain
fires under the recorder and is replayed with the CLI; the healthy versions raise no event and
train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import pytest
import sequential_recommendation_models as M
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

MODELS = "sequential_recommendation_models.py"


def line_of(text: str) -> str:
    return source_line(MODELS, text)


def interactions(n: int = 64, seed: int = 0):
    """Left-padded histories (n, MAX_LEN) of 2..MAX_LEN items, each user's next item, and the
    training set's item counts (items 55..60 never occur: a catalogue's cold items)."""
    g = torch.Generator().manual_seed(seed)
    seqs = torch.zeros(n, M.MAX_LEN, dtype=torch.long)
    lengths = torch.randint(2, M.MAX_LEN + 1, (n,), generator=g)
    for u in range(n):
        seqs[u, M.MAX_LEN - lengths[u]:] = torch.randint(1, 55, (int(lengths[u]),), generator=g)
    nxt = torch.randint(1, 55, (n,), generator=g)
    counts = torch.bincount(torch.cat([seqs.flatten(), nxt]), minlength=M.N_ITEMS + 1)
    counts[0] = 0
    return seqs, nxt, counts


def sampled_candidates(nxt, negatives: int, g):
    """[positive, uniform negatives over the items of the training set] per user."""
    neg = torch.randint(1, 55, (len(nxt), negatives), generator=g)
    return torch.cat([nxt[:, None], neg], 1)


def train(make: str, loss, kind: str, out_dir, steps: int = 4, record: bool = True,
          plant=None, accum: int = 1):
    """Adam with weight decay on the embeddings too, a linear warm-up, gradient clipping, the
    DataLoader's shuffled batches of 16 users (``accum`` micro-batches of them per update);
    ``plant(seq, cand)`` edits the last batch."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))
    seqs, nxt, _ = interactions()
    torch.manual_seed(1)
    loader = DataLoader(TensorDataset(seqs, nxt), batch_size=16, shuffle=True)
    g = torch.Generator().manual_seed(2)
    rec = FlightRecorder(model, opt, loss_fn=loss, out_dir=out_dir,
                         factory=f"sequential_recommendation_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else loss
        for step, (seq, pos) in zip(range(steps), loader):
            if kind == "inbatch":
                cand = pos.expand(len(pos), -1)
            else:
                cand = sampled_candidates(pos, 1 if kind == "bpr" else 8, g)
            if plant is not None and step == steps - 1:
                seq, cand = plant(seq, cand)
            opt.zero_grad()
            for mb in zip(*(t.chunk(accum) for t in (seq, pos, cand))):
                (forward(model, loss_fn, kind, *mb) / accum).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    return model


def forward(model, loss_fn, kind: str, seq, pos, cand):
    """One micro-batch's loss."""
    if kind == "bert":
        masked = seq.clone()
        hide = (torch.rand(seq.shape) < 0.3) & (seq != 0)
        hide[:, -1] |= seq[:, -1] != 0
        masked[hide] = M.MASK_ID
        labels = torch.where(hide, seq, torch.zeros_like(seq))
        return loss_fn(model(masked).flatten(0, 1), labels.flatten())
    if kind == "inbatch":
        return loss_fn(model(seq, cand), pos)
    if kind == "logq":
        return loss_fn(model(seq, cand), cand)
    return loss_fn(model(seq, cand))


def fire(*args, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(*args, **kw)
    return info.value.event, info.value.bundle_path


def params_equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def cold_negative(seq, cand):
    """An item added to the catalogue after the counts were taken, drawn as user 5's negative."""
    cand = cand.clone()
    cand[5, 3] = 58
    return seq, cand


def test_logq_correction_of_an_item_the_counts_never_saw_names_the_table_entry(tmp_path):
    """Sampled softmax's logQ correction divides each candidate's training count by the total
    and takes its log; a negative never seen in training has q = 0, log(q) = -inf, and its
    corrected logit is +inf: the loss is NaN while the model output is finite. The replay names
    the log in the loss, its line, user 5, and sends the user to the counts table (smooth it),
    not to an eps at the log or to a degenerate record."""
    _, _, counts = interactions()
    ev, bundle = fire("make_sasrec", M.LogQLoss(counts), "logq", tmp_path, plant=cold_negative)
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "<loss>", "aten.log", "-inf", [5]), o
    assert o["source"] == line_of("logits = scores - torch.log(q)"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "the buffer <loss>.counts" in rep["hint"] and "58" in rep["hint"], rep["hint"]
    assert "counts + 1" in rep["hint"] and "degenerate" not in rep["hint"], rep["hint"]


def test_logq_under_gradient_accumulation_names_the_micro_batch_and_its_row(tmp_path):
    """The same never-counted negative drawn for user 13, in the second of two micro-batches
    of 8 users: the event and the replay name micro-batch 1 and its row 5, and the table."""
    def late(seq, cand):
        cand = cand.clone()
        cand[13, 3] = 58
        return seq, cand

    _, _, counts = interactions()
    ev, bundle = fire("make_sasrec", M.LogQLoss(counts), "logq", tmp_path, plant=late, accum=2)
    assert (ev["step"], ev["phase"], ev["micro_batch"]) == (3, "loss", 1), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["micro_batch"], o["op"], o["samples"]) == (1, "aten.log", [5]), o
    assert "the buffer <loss>.counts" in rep["hint"], rep["hint"]


def test_logq_with_smoothed_counts_raises_nothing_and_trains_the_same(tmp_path):
    """The fix (Laplace-smoothed counts) on the same batches: no event, and the weights are
    bit-identical with and without the recorder."""
    _, _, counts = interactions()
    recorded = train("make_sasrec", M.LogQLoss(counts + 1), "logq", tmp_path, plant=cold_negative)
    plain = train("make_sasrec", M.LogQLoss(counts + 1), "logq", tmp_path, plant=cold_negative,
                  record=False)
    assert not list(tmp_path.glob("*.nan"))
    params_equal(recorded, plain)


def test_bpr_log_of_sigmoid_underflows_for_unnormalised_item2vec_vectors(tmp_path):
    """BPR written as ``-log(sigmoid(pos - neg))`` over item2vec vectors loaded unnormalised:
    a hard negative scores ~100 above the positive, sigmoid rounds to 0 and the loss is +inf
    at the second step. The replay names the log, its line, the users whose difference
    underflowed and the cause underflow, with logsigmoid as the fix."""
    ev, bundle = fire("make_sasrec_item2vec", M.BPRLoss(), "bpr", tmp_path)
    assert (ev["step"], ev["phase"], ev["kind"]) == (1, "loss", "+inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "<loss>", "aten.log", "-inf", [4, 11, 14]), o
    assert o["source"] == line_of("return -torch.log(torch.sigmoid(diff)).mean()"), o
    assert rep["cause"] == "underflow" and "logsigmoid" in rep["hint"], rep["hint"]


def test_bpr_with_logsigmoid_raises_nothing_and_trains_the_same(tmp_path):
    recorded = train("make_sasrec_item2vec", M.BPRLoss(stable=True), "bpr", tmp_path)
    plain = train("make_sasrec_item2vec", M.BPRLoss(stable=True), "bpr", tmp_path, record=False)
    assert not list(tmp_path.glob("*.nan"))
    params_equal(recorded, plain)


def blank_user(seq, cand):
    """User 3's history emptied (every item filtered out as too rare): all padding."""
    seq = seq.clone()
    seq[3] = 0
    return seq, cand


def test_bert4rec_all_padding_user_names_the_softmax_row_and_the_mask(tmp_path):
    """BERT4Rec's bidirectional attention fills padded keys with -inf; a user whose history is
    all padding has no key left, and the softmax of that row is 0/0. The cloze loss ignores the
    user's positions (label 0), so the loss stays finite: the event is the attention's output
    at step 3. The replay names the softmax, its line, user 3 alone, and says the row is fully
    masked, that ``pad`` masks every position of that user, and to leave it out of the batch."""
    loss = torch.nn.CrossEntropyLoss(ignore_index=0)
    ev, bundle = fire("make_bert4rec", loss, "bert", tmp_path, plant=blank_user)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        3, "forward", "blocks.0.attn", [3]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "blocks.0.attn", "aten._softmax", "nan", [3]), o
    assert o["source"] == line_of("attn = torch.softmax(scores, dim=-1)"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "fully masked row" in rep["hint"] and "pad is True" in rep["hint"], rep["hint"]
    assert "leave them out of the batch" in rep["hint"], rep["hint"]


def test_unrecorded_bert4rec_all_padding_user_poisons_the_weights_silently(tmp_path):
    """Without the recorder the same run's loss stays finite while the ignored positions' NaN
    reaches the weights through the softmax's backward: the event above is no false alarm."""
    loss = torch.nn.CrossEntropyLoss(ignore_index=0)
    model = train("make_bert4rec", loss, "bert", tmp_path, plant=blank_user, record=False)
    assert not all(torch.isfinite(p).all() for p in model.parameters())


def test_bert4rec_with_recbole_s_finite_fill_raises_nothing_and_trains_the_same(tmp_path):
    """RecBole's -10000 for padded keys on the same batches, the blank user included: its row
    attends uniformly to padding, no event, and the weights are bit-identical with and
    without the recorder."""
    loss = torch.nn.CrossEntropyLoss(ignore_index=0)
    recorded = train("make_bert4rec_finite_fill", loss, "bert", tmp_path, plant=blank_user)
    plain = train("make_bert4rec_finite_fill", loss, "bert", tmp_path, plant=blank_user,
                  record=False)
    assert not list(tmp_path.glob("*.nan"))
    params_equal(recorded, plain)


def test_in_batch_negatives_with_accidental_positives_at_minus_inf_raise_nothing(tmp_path):
    """In-batch negatives whose duplicates of the user's own positive are masked to -inf: the
    -inf stays inside the cross-entropy (every row keeps its diagonal), so no event, and the
    weights are bit-identical with and without the recorder."""
    class Counted(M.InBatchSoftmax):
        masked = 0

        def forward(self, logits, positives):
            Counted.masked += int((positives[:, None] == positives).sum()) - len(positives)
            return super().forward(logits, positives)

    recorded = train("make_sasrec", Counted(), "inbatch", tmp_path)
    assert Counted.masked > 0  # (the batches do hold accidental positives)
    plain = train("make_sasrec", M.InBatchSoftmax(), "inbatch", tmp_path, record=False)
    assert not list(tmp_path.glob("*.nan"))
    params_equal(recorded, plain)


def first_batch_users() -> torch.Tensor:
    """The first shuffled batch's histories, as ``train`` draws them."""
    seqs, nxt, _ = interactions()
    torch.manual_seed(1)
    return next(iter(DataLoader(TensorDataset(seqs, nxt), batch_size=16, shuffle=True)))[0]


def test_sasrec_key_padding_mask_under_the_causal_mask_names_both_masks(tmp_path):
    """SASRec given the left padding as ``key_padding_mask`` on top of the causal mask: a
    padded position sees only padded keys, its attention row is all -inf and
    ``nn.MultiheadAttention``'s softmax is NaN there; the timeline mask's ``x * 0`` keeps the
    NaN. It fires at the first step in every user with padding. The replay names the softmax,
    the attention call's line and those users, and says that the two masks together (neither
    alone) leave the padded positions no key, with the fixes of the domain."""
    loss = M.LogQLoss(interactions()[2] + 1)
    ev, bundle = fire("make_sasrec_key_padding", loss, "logq", tmp_path)
    padded = (first_batch_users()[:, 0] == 0).nonzero().flatten().tolist()
    assert 0 < len(padded) < 16
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        0, "forward", "blocks.0.attn", padded), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "blocks.0.attn", "aten._softmax", "nan", padded), o
    assert o["source"] == line_of("a, _ = self.attn(q, x, x, attn_mask=causal"), o
    assert rep["cause"] == "invalid", rep["cause"]
    h = rep["hint"]
    assert "key_padding_mask and attn_mask together mask every key" in h, h
    assert "neither alone; each such query position is padding itself" in h, h
    assert "timeline mask" in h and "pad on the right" in h, h


def test_gbce_of_a_confident_positive_names_the_rounded_sigmoid_power(tmp_path):
    """gSASRec's gBCE written with probabilities, ``log(1 / (sigmoid(pos)^-beta - 1))``: over
    unnormalised item2vec vectors a positive scores far above 17, sigmoid is 1.0 (in float64
    too past 37), its power minus 1 is 0 and the reciprocal +inf; the loss is NaN at the first
    step. The replay names the reciprocal, its line and the users whose sigmoid rounded, the
    cause precision (not an eps to add: exact arithmetic keeps it above 0), and the stable
    form from the logits."""
    ev, bundle = fire("make_sasrec_item2vec", M.GBCELoss(8), "gbce", tmp_path)
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "loss", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "<loss>", "aten.reciprocal", "+inf", [1, 8, 10, 13]), o
    # (user 15's gradient overflows in pow's backward on its own, sigmoid(-66)^-1.35: not a
    # row the loss couples with the named ones, as a DPO pair is)
    assert "coupled" not in o, o
    assert o["source"] == line_of("pos_logits = torch.log(1.0 / (pos_probs.pow(-self.beta)"), o
    assert rep["cause"] == "precision", rep["cause"]
    assert "sigmoid(z)^−b − 1 of a sigmoid" in rep["hint"], rep["hint"]
    assert "expm1(−b·logsigmoid(z))" in rep["hint"], rep["hint"]


def test_gbce_from_the_logits_raises_nothing_and_trains_the_same(tmp_path):
    recorded = train("make_sasrec_item2vec", M.GBCELoss(8, stable=True), "gbce", tmp_path)
    plain = train("make_sasrec_item2vec", M.GBCELoss(8, stable=True), "gbce", tmp_path,
                  record=False)
    assert not list(tmp_path.glob("*.nan"))
    params_equal(recorded, plain)

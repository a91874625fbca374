"""End to end: retrieval-augmented LMs (``retrieval_augmented_lm_models``). A kNN-LM trained
with its interpolated next-token NLL (datastore of the LM's own hidden states built from the
training corpus, AdamW, warmup, clip_grad_norm_, gradient accumulation), and a REALM / Atlas
retriever trained by marginal likelihood over a padded set of retrieved chunks, batched by a
DataLoader."""

from __future__ import annotations

import pytest
import retrieval_augmented_lm_models as M
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

MODELS = "retrieval_augmented_lm_models.py"
B, ACCUM = 4, 2


def corpus(g: torch.Generator, n: int) -> torch.Tensor:
    return torch.randint(0, M.VOCAB, (n, M.CTX), generator=g)


def train_knnlm(out_dir, factory: str, steps: int, record: bool = True, from_store=None,
                bf16: bool = False, hook=None, **rec_kw):
    """The datastore is rebuilt from the current LM at each step (REALM's index refresh);
    ``from_store = (step, micro_batch)``: that micro-batch's row 2 is a sequence of the
    datastore's own corpus (built from the training set), so its queries equal keys;
    ``hook``: a forward hook on the model (the plain run's oracle)."""
    model = getattr(M, factory)()
    if hook is not None:
        model.register_forward_hook(hook)
    g = torch.Generator().manual_seed(0)
    store = corpus(g, M.STORE // (M.CTX - 1) + 1)
    opt = torch.optim.AdamW(model.lm.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))
    rec = FlightRecorder(model, opt, loss_fn=M.lm_loss, out_dir=out_dir,
                         factory=f"retrieval_augmented_lm_models:{factory}",
                         **rec_kw) if record else None
    loss_fn = rec.attach().loss_fn if rec else M.lm_loss
    try:
        for step in range(steps):
            model.build(store)
            for k in range(ACCUM):
                ids = corpus(g, B)
                if from_store == (step, k):
                    ids[2] = store[1]
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    logp = model(ids)
                (loss_fn(logp.float(), ids) / ACCUM).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
    finally:
        if rec:
            rec.detach()
    return model


def retrieval_batches(g: torch.Generator, n: int, empty=None):
    """Queries, 4 retrieved chunks each (a variable number are real: ``chunk_mask``), targets;
    ``empty``: the row whose retrieval returned nothing (every chunk padding)."""
    q = torch.randint(0, M.VOCAB, (n, 5), generator=g)
    docs = torch.randint(0, M.VOCAB, (n, 4, 7), generator=g)
    count = torch.randint(1, 5, (n,), generator=g)
    if empty is not None:
        count[empty] = 0
    y = torch.randint(0, M.VOCAB, (n,), generator=g)
    return TensorDataset(q, docs, torch.arange(4) < count[:, None], y)


def train_retriever(out_dir, steps: int, record: bool = True, empty=None,
                    factory: str = "make_retriever", **rec_kw):
    """``empty = (step, row)``: that batch row retrieved no chunk."""
    model = getattr(M, factory)()
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rec = FlightRecorder(model, opt, loss_fn=M.marginal_nll, out_dir=out_dir,
                         factory=f"retrieval_augmented_lm_models:{factory}",
                         **rec_kw) if record else None
    loss_fn = rec.attach().loss_fn if rec else M.marginal_nll
    try:
        for step in range(steps):
            row = empty[1] if empty and empty[0] == step else None
            for q, docs, mask, y in DataLoader(retrieval_batches(g, 6, row), batch_size=6):
                log_p_doc, log_p_y = model(q, docs, mask)
                loss_fn(log_p_doc, log_p_y, y).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
    finally:
        if rec:
            rec.detach()
    return model


def raised(fn, *args, **kw) -> NonFiniteError:
    with pytest.raises(NonFiniteError) as info:
        fn(*args, **kw)
    return info.value


def first_nan_output(factory: str, steps: int, **kw):
    """The oracle: the same training run plainly (no recorder); ``(step, micro_batch, rows)``
    of the first forward whose output holds a NaN, or None."""
    calls, found = [], []

    def hook(module, args, out):
        n = len(calls)
        calls.append(n)
        rows = out.isnan().flatten(1).any(1).nonzero().flatten().tolist()
        if rows and not found:
            found.append((n // ACCUM, n % ACCUM, rows))

    train_knnlm(None, factory, steps, record=False, hook=hook, **kw)
    return found[0] if found else None


def same_weights(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                  b.state_dict().values()))


def test_knnlm_only_log_of_a_target_no_neighbour_holds_is_log_0(tmp_path):
    """``lam = 1``: the kNN distribution alone, 0 at every token none of the K neighbours
    holds, and ``log(lam * p_knn + ...)`` is -inf there from the first step on."""
    err = raised(train_knnlm, tmp_path, "make_knnlm_only", 2)
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (0, "forward", "")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["op"], o["module"], o["made"], o["samples"]) == (
        "invalid", "aten.log", "", "-inf", list(range(B))), rep
    assert o["source"] == source_line(MODELS, "return torch.log(self.lam * p_knn")
    assert o["input_range"][0] == 0.0
    assert "clamp the op's input away from the pole" in rep["hint"], rep["hint"]


def test_knnlm_only_in_log_space_names_the_log_of_p_knn_s_zeros(tmp_path):
    """The logsumexp form with ``lam = 1``: ``log(1 - lam)`` drops the LM's term, and the
    log of ``p_knn``'s zeros is then the output's -inf at every token no neighbour holds."""
    err = raised(train_knnlm, tmp_path, "make_knnlm_lse_only", 2)
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["op"], o["module"], o["made"], o["samples"]) == (
        "invalid", "aten.log", "", "-inf", list(range(B))), rep
    assert o["source"] == source_line(MODELS, "stacked = torch.stack([p_knn.log()")
    assert o["input_range"][0] == 0.0


def test_knnlm_sqrt_of_a_query_s_own_squared_distance_rounded_below_0(tmp_path):
    """A training sequence that is in the datastore: its queries equal their own keys (bit for
    bit), and ``|q|^2 - 2 q.k + |k|^2`` rounds to -3.8e-06 in some of them; the root of the
    top-K distances is NaN in those rows: a rounding float64 does not make. Where it first
    rounds below 0 follows the CPU's kernels (the AMD EPYC's AVX-512 and AVX2 kernels: step 1,
    micro-batch 1, the planted row 2 and row 0, whose first token starts a datastore sequence
    too, position 0's state being its token's alone; scalar kernels: already step 0,
    micro-batch 0, row 3's position 0), so the plain run's first NaN output is the oracle."""
    first = first_nan_output("make_knnlm_sqrt", 3, from_store=(1, 1))
    assert first is not None
    step, micro, rows = first
    err = raised(train_knnlm, tmp_path, "make_knnlm_sqrt", 3, from_store=(1, 1))
    assert (err.event["step"], err.event["micro_batch"], err.event["phase"]) == (
        step, micro, "forward"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["op"], o["module"], o["made"], o["samples"]) == (
        "precision", "aten.sqrt", "", "nan", rows), rep
    assert err.event["samples"] == rows
    assert o["source"] == source_line(MODELS, "top = top.sqrt()")
    assert o["input_range"][0] < 0
    assert "clamp to the domain before the op" in rep["hint"], rep["hint"]


def test_knnlm_temperature_0_divides_a_zero_distance_by_the_number_0(tmp_path):
    """``knn_temp: 0`` meant as "hard nearest neighbour": ``-top / 0`` is NaN where a query's
    distance is exactly 0 (position 0 sees only its own token, which is in the datastore: rows
    0 and 3 at step 0; ``(q - k)^2`` summed is 0 there on every CPU)."""
    err = raised(train_knnlm, tmp_path, "make_knnlm_cold", 2)
    assert (err.event["step"], err.event["phase"]) == (0, "forward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["op"], o["module"], o["made"], o["samples"]) == (
        "invalid", "aten.div", "", "nan", list(range(B))), rep  # (the others' -x/0: -inf)
    assert o["source"] == source_line(MODELS, "F.softmax(-top / self.temp")
    assert "a temperature or scale annealed to 0" in rep["hint"], rep["hint"]


def test_retriever_masked_chunks_need_allow_inf_and_the_report_says_so(tmp_path):
    """``log p(doc | q)`` of padded chunks is -inf in the model's output on purpose; without
    ``allow_inf`` the first step stops, and the report names the fill, not a bug."""
    err = raised(train_retriever, tmp_path, 2)
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["op"], o["module"], o["made"]) == ("aten.masked_fill", "", "-inf"), rep
    assert any("allow_inf=['']" in p for p in rep["problems"]), rep["problems"]


def test_retriever_query_with_no_retrieved_chunk_is_a_fully_masked_row(tmp_path):
    """Step 2's row 3 retrieved nothing: every chunk is padding, and the masked log_softmax
    over an all -inf row is NaN in that row alone."""
    err = raised(train_retriever, tmp_path, 4, empty=(2, 3), allow_inf=[""])
    assert (err.event["step"], err.event["phase"], err.event["samples"]) == (2, "forward", [3])
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["op"], o["module"], o["samples"]) == (
        "invalid", "aten._log_softmax", "", [3]), rep
    assert o["source"] == source_line(MODELS, "log_p_doc = F.log_softmax(scores")
    assert "keep at least one key per row" in rep["hint"], rep["hint"]


def test_retriever_guarding_an_empty_retrieval_in_the_forward_is_nan_in_its_backward(tmp_path):
    """The same empty retrieval, guarded: its ``log p(doc | q)`` set to -inf and its row left
    out of the loss with ``torch.where``; the forward is finite, but logsumexp's derivative
    over that all -inf row is NaN, so the first NaN is a gradient, in row 3."""
    err = raised(train_retriever, tmp_path, 4, empty=(2, 3), allow_inf=[""],
                 factory="make_guarded_retriever")
    assert (err.event["step"], err.event["phase"]) == (2, "backward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["op"], o["module"], o["samples"]) == (
        "invalid", "LogsumexpBackward0", "<loss>", [3]), rep
    assert o["source"] == source_line(MODELS, "lse = torch.logsumexp(log_p_doc + ll")
    assert "keep one finite term in every slice" in rep["hint"], rep["hint"]


def test_healthy_knnlm_and_retriever_train_unchanged_by_the_recorder(tmp_path):
    """An interpolated kNN-LM (both forms) and a retriever with padded chunks (allowed):
    no event, and the weights are those of the runs without the recorder."""
    for factory, bf16 in (("make_knnlm", False), ("make_knnlm_lse", False), ("make_knnlm", True)):
        recorded = train_knnlm(tmp_path, factory, 3, bf16=bf16)
        assert same_weights(recorded, train_knnlm(tmp_path, factory, 3, record=False, bf16=bf16))
    recorded = train_retriever(tmp_path, 3, allow_inf=[""])
    assert same_weights(recorded, train_retriever(tmp_path, 3, record=False))
    assert not list(tmp_path.glob("*.nan"))


def train_bank(out_dir, steps: int, indexed: int, record: bool = True):
    """A dense retriever over a bank of EMA-refreshed document embeddings: the index was built
    for the first ``indexed`` of the NDOC documents (the rest start at the bank's zeros), each
    batch's positives refresh their rows after the update."""
    model = M.make_bank_retriever()
    g = torch.Generator().manual_seed(0)
    docs = torch.randint(0, M.VOCAB, (M.NDOC, 6), generator=g)
    with torch.no_grad():
        model.bank[:indexed] = model.d_enc(docs[:indexed]).mean(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rec = FlightRecorder(model, opt, loss_fn=M.bank_loss, out_dir=out_dir,
                         factory="retrieval_augmented_lm_models:make_bank_retriever"
                         ) if record else None
    loss_fn = rec.attach().loss_fn if rec else M.bank_loss
    try:
        for _ in range(steps):
            idx = torch.randperm(min(indexed, 12), generator=g)[:4]
            scores, d = model(docs[idx][:, :3], docs[idx])
            loss_fn(scores, d, idx).backward()
            opt.step()
            opt.zero_grad()
            model.refresh(idx, d.detach())
    finally:
        if rec:
            rec.detach()
    return model


def test_bank_rows_never_encoded_are_named_as_the_buffer_s_zero_rows(tmp_path):
    """The index holds 12 of 16 documents; the others' rows of the bank are still the zeros
    it started at, and the cosine scores' ``bank / bank.norm(...)`` is 0/0 there. The report
    named no row of the bank: it now names the buffer and its rows 12-15, and the fix."""
    err = raised(train_bank, tmp_path, 3, indexed=12)
    assert (err.event["step"], err.event["phase"]) == (0, "forward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["op"], o["module"], o["samples"]) == (
        "invalid", "aten.div", "", [0, 1, 2, 3]), rep
    assert o["source"] == source_line(MODELS, "bank = self.bank / self.bank.norm(")
    assert rep["hint"].startswith("aten.div of 0 by 0 (0/0) exactly where the buffer bank is 0 "
                                  "in whole slices along dim 0 (12, 13, 14, 15)"), rep["hint"]
    assert "encode every document once" in rep["hint"]


def test_bank_fully_indexed_trains_unchanged_by_the_recorder(tmp_path):
    recorded = train_bank(tmp_path, 3, indexed=M.NDOC)
    assert same_weights(recorded, train_bank(tmp_path, 3, indexed=M.NDOC, record=False))
    assert not list(tmp_path.glob("*.nan"))


def train_l2(out_dir, steps: int, duplicate=None):
    """A Siamese L2 retriever with in-batch negatives; ``duplicate = (step, row)``: that row's
    positive document is its query's own text (a FAQ whose answer repeats the question)."""
    model = M.make_l2_retriever()
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rec = FlightRecorder(model, opt, loss_fn=M.in_batch_loss, out_dir=out_dir,
                         factory="retrieval_augmented_lm_models:make_l2_retriever")
    loss_fn = rec.attach().loss_fn
    try:
        for step in range(steps):
            q = torch.randint(0, M.VOCAB, (6, 5), generator=g)
            d = torch.randint(0, M.VOCAB, (6, 5), generator=g)
            if duplicate and duplicate[0] == step:
                d[duplicate[1]] = q[duplicate[1]]
            loss_fn(model(q, d)).backward()
            opt.step()
            opt.zero_grad()
    finally:
        rec.detach()


def test_l2_retriever_query_equal_to_its_document_is_sqrt_s_pole_in_backward(tmp_path):
    """A query whose positive is its own text: distance exactly 0, finite in the forward, and
    sqrt's derivative there is the pole; the report names sqrt's backward in that row (4)
    and the norm that has a gradient of 0 there."""
    err = raised(train_l2, tmp_path, 4, duplicate=(2, 4))
    assert (err.event["step"], err.event["phase"]) == (2, "backward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["op"], o["module"], o["samples"]) == (
        "invalid", "SqrtBackward0", "", [4]), rep
    assert o["source"] == source_line(MODELS, "dist = (q[:, None] - d[None]).pow(2)")
    assert "torch.linalg.vector_norm(d, dim=-1)" in rep["hint"], rep["hint"]

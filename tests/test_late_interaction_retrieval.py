"""End to end on neural retrieval with late interaction and dual encoders
(``late_interaction_retrieval_models``): ColBERT's MaxSim over ``-inf``-masked passage tokens
with query augmentation, DPR's two encoders with mean pooling normalised by hand, distillation
from a cross-encoder's scores by KL, SPLADE's max-pooled ``log(1 + relu)`` term weights with
the FLOPS regulariser under bfloat16 autocast; in-batch plus hard negatives, AdamW with a
linear warmup, gradient clipping, gradient accumulation."""

from __future__ import annotations

import contextlib

import late_interaction_retrieval_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("late_interaction_retrieval_models.py", text)


def train(make: str, loss, out_dir, steps: int = 4, record: bool = True, accum: int = 1,
          plant: dict | None = None, teacher: bool = False,
          amp: torch.dtype | None = None, **rec_kw):
    """AdamW with a linear warmup, clip_grad_norm_ and ``accum`` micro-batches a step, as
    ColBERT's and sentence-transformers' trainers run; ``plant`` (``batch`` keywords) goes into
    the last micro-batch of the last step. Returns the model."""
    model = getattr(M, make)()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=loss, out_dir=out_dir,
                         factory=f"late_interaction_retrieval_models:{make}",
                         **rec_kw) if record else None
    loss_fn = rec.attach().loss_fn if rec else loss
    try:
        for step in range(steps):
            opt.zero_grad()
            for mb in range(accum):
                last = step == steps - 1 and mb == accum - 1
                q, d, labels, t = M.batch(g, **(plant if last and plant else {}))
                with (torch.autocast("cpu", amp) if amp else contextlib.nullcontext()):
                    out = model(q, d)
                out = out if isinstance(out, tuple) else (out,)
                extra = (t,) if teacher else ()
                (loss_fn(*out, labels, *extra) / accum).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    finally:
        if rec:
            rec.detach()
    return model


def fire(make: str, loss, tmp_path, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(make, loss, tmp_path, **kw)
    return info.value.event, info.value.bundle_path


def same_weights(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.isfinite(q).all() and torch.equal(p, q), name


def test_colbert_blank_positive_passage_names_maxsim_and_the_passage_row(tmp_path):
    """Query 2's positive passage is only punctuation: every token of it is outside ColBERT's
    content mask, so MaxSim's max over its tokens is a max over ``-inf`` only and its score
    is -inf for every query (cross-entropy then +inf for query 2). Under accumulation of two
    micro-batches, the event is the root's output at step 3, micro-batch 1; the replay names
    the max on its line (the fill before it intentional), the fully masked row's advice, and
    row 2 of the passages (``args[1]``, 8 rows beside 4 queries) as where it comes from,
    since every query's row holds the -inf."""
    ev, bundle = fire("make_colbert", M.colbert_loss, tmp_path, accum=2, plant={"blank": 2})
    assert (ev["step"], ev["phase"], ev["module"], ev["micro_batch"], ev["kind"]) == (
        3, "forward", "", 1, "-inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["micro_batch"]) == (
        True, "", "aten.max", "-inf", 1), o
    assert o["source"] == line_of("return sim.max(-1).values.sum(-1)"), o
    assert [(c["op"], c["intentional"]) for c in o["chain"]] == [
        ("aten.masked_fill", True), ("aten.max", False)], o["chain"]
    assert o["input_rows"] == {"tensor": "args[1]", "rows": [2]}, o
    assert any("rows [2] of args[1] are where it comes from" in p for p in rep["problems"])
    assert rep["cause"] == "invalid" and "fully masked row" in rep["hint"], rep["hint"]
    assert "keep at least one key per row" in rep["hint"], rep["hint"]
    assert not any("allow_inf" in p for p in rep["problems"]), rep["problems"]  # (loss +inf)


def test_colbert_empty_hard_negative_is_named_and_allow_inf_on_the_root_trains_the_same(
        tmp_path):
    """An empty hard negative (row 6: ``[CLS] [D] [SEP]``) scores -inf, which cross-entropy
    turns into a probability of 0: the loss and gradients stay finite, but the -inf reaches
    the root's output, an event by default that names row 6 of the passages and, since the
    loss re-ran finite with it, the ``allow_inf`` pattern that allows it. Allowing the root's
    infinities (``allow_inf=[""]``) lets it train, bit-identical to the plain run."""
    plant = {"blank": 6, "blank_kind": "empty"}
    ev, bundle = fire("make_colbert", M.colbert_loss, tmp_path, plant=plant)
    assert (ev["step"], ev["module"], ev["kind"]) == (3, "", "-inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["input_rows"]) == ("aten.max", {"tensor": "args[1]", "rows": [6]}), o
    assert any("the loss of micro-batch 0 re-ran finite" in p
               and "allow_inf=['']" in p for p in rep["problems"]), rep["problems"]
    allowed = train("make_colbert", M.colbert_loss, tmp_path / "allowed", plant=plant,
                    allow_inf=[""])
    plain = train("make_colbert", M.colbert_loss, tmp_path, plant=plant, record=False)
    assert not list((tmp_path / "allowed").glob("*.nan"))
    same_weights(allowed, plain)


def test_colbert_additive_inf_mask_names_the_product_with_the_literal_inf(tmp_path):
    """The passage mask added as ``(1 - mask) * float("-inf")``: for every kept token that is
    ``0 * -inf``, NaN in the first step. The replay names the multiplication on its line, the
    literal -inf it was given, and masked_fill (or a finite large negative) as the fix."""
    ev, bundle = fire("make_colbert_additive", M.colbert_loss, tmp_path)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "forward", "", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "", "aten.mul", "nan", [0, 1, 2, 3]), o
    assert o["source"] == line_of('sim = sim + (1.0 - mask.float())[None, :, None, :] * float('), o
    assert rep["cause"] == "invalid" and "literal -inf" in rep["hint"], rep["hint"]
    assert "masked_fill(mask, float('-inf'))" in rep["hint"], rep["hint"]


def test_dense_blank_passage_normalised_without_eps_names_the_division_and_the_passage(
        tmp_path):
    """DPR with mean pooling over content tokens: a passage of punctuation only pools to the
    zero vector (``sum / clamp(count, 1e-9)`` is 0 / 1e-9), and ``x / x.norm()`` makes it 0/0.
    The NaN passage embedding makes every query's score row NaN; the replay names the
    division on its line, 0/0 with the eps advice, and row 5 of the passages (``args[1]``)."""
    ev, bundle = fire("make_dense", M.contrastive_loss, tmp_path, plant={"blank": 5})
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (3, "forward", "", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "", "aten.div", "nan", [0, 1, 2, 3]), o
    assert o["source"] == line_of("return pooled / pooled.norm(dim=-1, keepdim=True)"), o
    assert o["input_rows"] == {"tensor": "args[1]", "rows": [5]}, o
    assert any("rows [5] of args[1] are where it comes from" in p for p in rep["problems"])
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert "add an eps to the denominator" in rep["hint"], rep["hint"]


def test_eps_outside_a_hand_written_norm_names_the_sqrt_backward_and_the_passage_encoder(
        tmp_path):
    """The same blank passage, normalised by ``x / (sqrt(sum(x ** 2)) + 1e-6)``: the forward is
    finite (0 / 1e-6), but sqrt's slope at 0 is inf, times the zero vector's 0 in backward:
    NaN gradients, which clip_grad_norm_ spreads to every parameter of both encoders. The
    replay names SqrtBackward0 on that line, the passage encoder's parameters only, row 5 of
    the passages (its gradient's rows are passages, not queries), and vector_norm or an eps
    under the sqrt as the fix."""
    ev, bundle = fire("make_dense_eps_outside", M.contrastive_loss, tmp_path,
                      plant={"blank": 5})
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "backward", "nan"), ev
    assert any(p.startswith("q_encoder.") for p in ev["params"]), ev["params"]  # (clipping)
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["op"], o["made"]) == ("backward", "SqrtBackward0", "nan"), o
    assert o["params"] and all(p.startswith("d_encoder.") for p in o["params"]), o["params"]
    assert o["source"] == line_of("pooled.pow(2).sum(-1, keepdim=True).sqrt() + 1e-6"), o
    assert (o["samples"], o["input_rows"]) == ([], {"tensor": "args[1]", "rows": [5]}), o
    assert any("rows [5] of args[1] are where it comes from" in p for p in rep["problems"])
    assert rep["cause"] == "invalid" and "torch.linalg.vector_norm" in rep["hint"], rep["hint"]


def test_distillation_from_an_underflowing_teacher_names_the_log_and_its_queries(tmp_path):
    """KL from a cross-encoder written out as ``p * (log p - log q)``: at step 3 the teacher's
    scores come in three times their spread, and its softmax at temperature 0.05 underflows
    to exact zeros, whose log is -inf and ``0 * -inf`` NaN. A loss event; the replay names
    the log on the KL's line, the queries whose teacher distribution holds a 0 (counted here
    independently), underflow, and the log-space fix (``log_target=True``)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        M.batch(g)
    t = M.batch(g, teacher_scale=3.0)[3]
    zeros = torch.nonzero((torch.softmax(t / 0.05, -1) == 0).any(1)).flatten().tolist()
    assert 0 < len(zeros) < len(t), zeros
    ev, bundle = fire("make_colbert", M.distill_loss, tmp_path, teacher=True,
                      plant={"teacher_scale": 3.0})
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "loss", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["made"], o["samples"]) == (
        "loss", "<loss>", "aten.log", "-inf", zeros), o
    assert o["source"] == line_of("kl = (p * (p.log() - log_q)).sum(-1).mean()"), o
    assert rep["cause"] == "underflow" and "log_target=True" in rep["hint"], rep["hint"]


def test_kl_in_log_space_over_an_unscored_passage_names_the_teacher_scores_row(tmp_path):
    """The cross-encoder did not score query 1's hard negative 6 (left -inf in its scores,
    a loss argument): log_softmax keeps the -inf, and ``F.kl_div(..., log_target=True)``'s
    ``exp(t) * (t - s)`` is ``0 * -inf``. An input event on the teacher scores, query 1; the
    hint names the product on the kl_div line and a finite floor as the fix."""
    ev, bundle = fire("make_colbert", M.kl_distill_loss, tmp_path, teacher=True,
                      plant={"unscored": (1, 6)})
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"], ev["kind"]) == (
        3, "input", "loss_args[2]", [1], "-inf"), ev
    rep = nanreplay_json(bundle)
    assert (rep["origin"]["tensor"], rep["origin"]["samples"], rep["cause"]) == (
        "loss_args[2]", [1], "input"), rep
    kl_line = line_of('kl = F.kl_div(log_q, log_p, reduction="batchmean", log_target=True)')
    assert f"aten.mul ({kl_line}) computed 0 * inf" in rep["hint"], rep["hint"]
    assert "finite floor" in rep["hint"], rep["hint"]


def test_splade_dense_term_weights_under_float16_autocast_overflow_the_score_matmul(tmp_path):
    """SPLADE starting from a pretrained MLM head (logits about 8 over BERT's 30522 terms):
    every term weight is about log(9) before the FLOPS regulariser sparsifies them, and the
    dot product over the vocabulary, about 1.6e5, is past float16's range under float16
    autocast. The replay names the score matmul on its line, float16, and overflow with the
    advice to compute it in float32."""
    ev, bundle = fire("make_splade_mlm", M.splade_loss, tmp_path, amp=torch.float16)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "forward", "", "+inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["dtype"], o["samples"]) == (
        "", "aten.mm", "+inf", "float16", [0, 1, 2, 3]), o
    assert o["source"] == line_of("return q @ d.T, q, d"), o
    assert rep["cause"] == "overflow" and "float16's largest value" in rep["hint"], rep["hint"]
    assert "compute this op in float32" in rep["hint"], rep["hint"]


HEALTHY = {
    "colbert_accumulated": ("make_colbert", M.colbert_loss, {"accum": 2}),
    "dense_eps_blank": ("make_dense_eps", M.contrastive_loss, {"plant": {"blank": 5}}),
    "distill_kl_div": ("make_colbert", M.stable_distill_loss,
                       {"teacher": True, "plant": {"teacher_scale": 3.0}}),
    "splade_bf16": ("make_splade", M.splade_loss, {"amp": torch.bfloat16, "plant": {"blank": 3}}),
}


@pytest.mark.parametrize("name", sorted(HEALTHY))
def test_healthy_runs_raise_nothing_and_train_the_same(tmp_path, name):
    """ColBERT with -inf-masked padding and punctuation in every passage under accumulation;
    the dense retriever's F.normalize over a blank passage's zero vector; F.kl_div from the
    underflowing teacher (its xlogy takes 0 * log 0 as 0); SPLADE under bfloat16 autocast
    with a blank passage (its term weights all 0) and the FLOPS regulariser: no event, and
    bit-identical weights with and without the recorder."""
    make, loss, kw = HEALTHY[name]
    recorded = train(make, loss, tmp_path, **kw)
    plain = train(make, loss, tmp_path, record=False, **kw)
    assert not list(tmp_path.glob("*.nan"))
    same_weights(recorded, plain)

"""Knowledge-graph embeddings trained under the flight recorder (``knowledge_graphs_models``):
TransE renormalised in place with sparse embeddings, SparseAdam and corrupted triples from a
DataLoader's workers; RotatE's self-adversarial loss over filtered negatives, with a filtered
MRR evaluation in the loop; kbc's ComplEx with N3 over its ``sqrt(re^2 + im^2)`` factors,
reciprocal relations and Adagrad; a hand-written 1-N binary cross entropy over DistMult."""

from __future__ import annotations

from pathlib import Path

import knowledge_graphs_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

HERE = Path(__file__).parent


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("knowledge_graphs_models.py", text)


def _train_transe(out_dir, pad: int) -> M.TransE:
    model = M.make_transe(pad)
    opt = torch.optim.SparseAdam(list(model.parameters()), lr=0.01)
    loader = torch.utils.data.DataLoader(
        M.CorruptedTriples(), batch_size=M.BATCH, shuffle=True, num_workers=2,
        generator=torch.Generator().manual_seed(0))
    with FlightRecorder(model, opt, loss_fn=M.MarginRankingLoss(), out_dir=out_dir,
                        factory="knowledge_graphs_models:make_transe",
                        factory_kwargs={"pad": pad}) as rec:
        for _ in range(2):
            for pos, neg in loader:
                opt.zero_grad()
                rec.loss_fn(model(pos, M.with_tails(pos, neg))).backward()
                opt.step()
        assert rec.health.internal_errors == 0
    return model


def test_transe_renormalised_in_place_with_a_zero_pad_row_names_the_division(tmp_path):
    """TransE-PyTorch renormalises ``weight.data[:-1]`` in its forward, keeping its padding
    entity (the last row, all 0) out; a vocabulary with "<pad>" first puts it at row 0, which
    the renorm divides by its norm of 0. No output, loss or gradient is non-finite: the
    recorder said 'non-finite statistic with no identifiable source', and the replay re-ran
    from the bundle's NaN row (written in place through ``.data``, which bumps no version, so
    each re-run renormalised the last one's weights again): 'two re-runs of the step disagree:
    nondeterminism'."""
    with pytest.raises(NonFiniteError) as info:
        _train_transe(tmp_path, pad=0)
    ev = info.value.event
    assert (ev["step"], ev["params"], ev["kind"]) == (0, ["entities_emb.weight"], "nan"), ev
    assert "no identifiable source" not in ev["detail"], ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["phase"], o["module"], o["op"]) == (
        True, "invalid", "forward", "", "aten.div_"), rep
    assert (o["param"], o["rows"], o["rows_of"], o["samples"]) == (
        "entities_emb.weight", [0], M.N_ENT, []), o
    assert o["source"] == line_of("w.div_(w.norm("), o
    assert "clamp_min(eps)" in rep["hint"] and "F.normalize" in rep["hint"], rep["hint"]
    notes = " ".join(rep["problems"])
    assert "nondeterminism" not in notes and "ActNorm" not in notes, notes


def test_transe_with_its_pad_row_kept_out_of_the_renorm_trains_without_events(tmp_path):
    """The repository's own layout (the padding entity last, kept out of the renorm): sparse
    gradients, SparseAdam, the forward's in-place writes and the workers' batches raise no
    event, and the recorded run trains as an unrecorded one."""
    model = _train_transe(tmp_path, pad=M.N_ENT - 1)
    assert not list(tmp_path.glob("*.nan"))
    assert torch.isfinite(model.entities_emb.weight).all()
    assert bool((model.entities_emb.weight[-1] == 0).all())  # (padding_idx: never trained)


def test_rotate_filtered_negatives_all_false_name_the_softmax_row(tmp_path):
    """RotatE's self-adversarial weights ``softmax(score * alpha).detach()`` over negatives
    filtered against the known triples (false negatives set to -inf): a row whose every
    sampled tail is a known true tail is a softmax of all -inf. A filtered MRR evaluation
    (scores of the other true tails at -inf) runs in the loop and raises nothing."""
    model = M.make_rotate()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    known = torch.zeros(M.N_ENT, M.N_REL, M.N_ENT, dtype=torch.bool)
    mrr = []
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.self_adversarial_loss, out_dir=tmp_path,
                            factory="knowledge_graphs_models:make_rotate") as rec:
            for step in range(6):
                pos = M.triples(g)
                neg = torch.randint(1, M.N_ENT, (M.BATCH, M.NEG), generator=g)
                known[pos[:, 0], pos[:, 1], pos[:, 2]] = True
                if step == 3:
                    neg[2] = pos[2, 2]  # every sampled tail of row 2 is its true tail
                false_negative = known[pos[:, 0, None], pos[:, 1, None], neg]
                opt.zero_grad()
                rec.loss_fn(model(pos, neg), false_negative).backward()
                opt.step()
                test = M.triples(g)
                mrr.append(M.filtered_mrr(model, test, known[test[:, 0], test[:, 1]]))
    assert len(mrr) == 3 and all(0 < m <= 1 for m in mrr), mrr
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "loss", "<loss>"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["phase"], o["op"], o["samples"]) == (
        True, "invalid", "loss", "aten._softmax", [2]), rep
    assert o["source"] == line_of("F.softmax(negative_score * temperature"), o
    assert o["chain"][0]["op"] == "aten.masked_fill" and o["chain"][0]["intentional"], o
    assert "every entry is -inf" in rep["hint"], rep["hint"]
    assert "large finite negative" in rep["hint"], rep["hint"]


def test_a_filtered_ranking_evaluation_returning_minus_inf_scores_is_no_event(tmp_path):
    """Filtered MRR between steps, the model scoring the known true tails -inf in its own
    forward (gradients off, eval mode): the recorder raised 'inf first in the output of
    <root>' in the evaluation, in the middle of the user's metric code, though nothing takes
    those scores but the ranking that wants them; a row whose every other tail is known
    (a small graph) is fine too. Training is checked as before."""
    model = M.make_rotate()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    known = torch.zeros(M.N_ENT, M.N_REL, M.N_ENT, dtype=torch.bool)
    with FlightRecorder(model, opt, loss_fn=M.self_adversarial_loss, out_dir=tmp_path,
                        factory="knowledge_graphs_models:make_rotate") as rec:
        for _ in range(4):
            pos = M.triples(g)
            neg = torch.randint(1, M.N_ENT, (M.BATCH, M.NEG), generator=g)
            known[pos[:, 0], pos[:, 1], pos[:, 2]] = True
            opt.zero_grad()
            rec.loss_fn(model(pos, neg), known[pos[:, 0, None], pos[:, 1, None], neg]).backward()
            opt.step()
            filtered = known[pos[:, 0], pos[:, 1]].clone()
            filtered[0] = True  # (every tail of the first (h, r) known)
            mrr = M.filtered_mrr(model, pos, filtered)
            assert 0 < mrr <= 1
        assert rec.health.internal_errors == 0 and rec.event is None
    assert not list(tmp_path.glob("*.nan"))


def test_complex_n3_of_a_modulus_dropped_to_0_is_sqrts_backward(tmp_path):
    """kbc's ComplEx returns ``sqrt(re^2 + im^2)`` of the head and tail for N3 (``|x|^3``);
    with dropout on the looked-up embeddings (LibKGE's), a coordinate whose real and
    imaginary parts are both dropped is a modulus of exactly 0: N3's gradient there is 0, but
    sqrt's derivative is infinite, and 0 * inf is NaN. The samples are the (reciprocal
    doubled) rows with such a coordinate in the tail."""
    model = M.make_complex(dropout=0.3)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    dropped: list[torch.Tensor] = []

    def zero_moduli(_m, _args, out):
        re, im = out[:, :M.DIM], out[:, M.DIM:]
        dropped.append(((re == 0) & (im == 0)).any(1))

    model.dropout.register_forward_hook(zero_moduli)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.N3Loss(), out_dir=tmp_path,
                            factory="knowledge_graphs_models:make_complex",
                            factory_kwargs={"dropout": 0.3}) as rec:
            for _ in range(4):
                x = M.reciprocal(M.triples(g))
                dropped.clear()
                opt.zero_grad()
                rec.loss_fn(model(x), x[:, 2]).backward()
                opt.step()
    # (the tail's sqrt, the last made, is the first its backward runs: its rows are named)
    rows = dropped[1].nonzero().flatten().tolist()
    assert 0 < len(rows) < 2 * M.BATCH, rows
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["params"]) == (0, "backward", ["embeddings.0.weight"])
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["phase"], o["op"], o["samples"]) == (
        True, "invalid", "backward", "SqrtBackward0", rows), rep
    assert o["source"] == line_of("torch.sqrt(rhs[0] ** 2 + rhs[1] ** 2)"), o
    # (was: only "torch.linalg.vector_norm(d, dim=-1)", which sums the rank dimension away)
    assert "torch.complex(re, im).abs()" in rep["hint"], rep["hint"]
    # the head's sqrt makes NaN too, in its own rows: named, and dropped with the tail's
    # (was: only the tail's rows, and --try auto's drop of them came back NaN)
    head = dropped[0].nonzero().flatten().tolist()
    assert head != rows and o["also"] == [{"node": "SqrtBackward0", "source": line_of(
        "torch.sqrt(lhs[0] ** 2 + lhs[1] ** 2)"), "samples": head}], o.get("also")
    assert any("the fix is needed there too" in p for p in rep["problems"]), rep["problems"]
    assert "dropout zeroed every term" in rep["hint"] and "sqrt(x + eps)" in rep["hint"]


def test_a_renorm_in_the_loop_after_the_update_is_not_blamed_on_the_next_update(tmp_path):
    """The loop renormalises the entities after each ``optimizer.step()``
    (``w.data = w / w.norm(dim=1)``); the padding entity's zero row is 0/0. The recorder
    checks an update's weights with the next step's read, so the NaN is seen after the next
    update: 'optimizer.step() made entities_emb.weight non-finite', and the replay said the
    update could not be re-run and to 'check the learning rate and schedule, eps, and clip
    gradients'. Adam's state and the gradient are finite on that row: the row was NaN
    before the update."""
    model = M.make_transe(pad=0, in_forward=False)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.MarginRankingLoss(), out_dir=tmp_path,
                            factory="knowledge_graphs_models:make_transe",
                            factory_kwargs={"pad": 0, "in_forward": False}) as rec:
            for _ in range(4):
                pos = M.triples(g)
                neg = torch.randint(1, M.N_ENT, (M.BATCH, M.NEG), generator=g)
                opt.zero_grad()
                rec.loss_fn(model(pos, M.with_tails(pos, neg))).backward()
                opt.step()
                sched.step()
                M.renormalise(model.entities_emb)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["params"]) == (1, "optimizer", ["entities_emb.weight"])
    rep = nanreplay_json(info.value.bundle_path, code=1)
    o = rep["origin"]
    assert (rep["cause"], o["phase"], o["param"], o["rows"], o["rows_of"]) == (
        "weights", "weights", "entities_emb.weight", [0], M.N_ENT), rep
    assert "before the update at step 1" in rep["hint"], rep["hint"]
    assert "after optimizer.step()" in rep["hint"] and "F.normalize" in rep["hint"]
    assert "learning rate" not in rep["hint"], rep["hint"]


def test_a_hand_written_1_n_bce_of_a_sigmoid_rounded_to_1_points_at_the_logits(tmp_path):
    """ConvE's 1-N scoring (``sigmoid`` of DistMult's scores against every entity) with its
    binary cross entropy written out: a confident score rounds sigmoid to exactly 1.0 in
    float32, and ``log(1 - pred)`` is log(0). The report names the log, the rows, the
    rounding (precision, not a learning-rate problem) and the loss on the logits."""
    model = M.make_distmult()
    opt = torch.optim.Adam(model.parameters(), lr=1.0)
    g = torch.Generator().manual_seed(0)
    preds: list[torch.Tensor] = []
    model.register_forward_hook(lambda _m, _a, out: preds.append(out.detach()))
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.bce_by_hand, out_dir=tmp_path,
                            factory="knowledge_graphs_models:make_distmult") as rec:
            for _ in range(30):
                x = M.triples(g)
                e2_multi = torch.zeros(M.BATCH, M.N_ENT)
                e2_multi[torch.arange(M.BATCH), x[:, 2]] = 1
                opt.zero_grad()
                rec.loss_fn(model(x[:, :1], x[:, 1:2]), M.smoothed(e2_multi, 0.0)).backward()
                opt.step()
    rows = (preds[-1] == 1).any(1).nonzero().flatten().tolist()
    assert rows and not (preds[-1] == 0).any(), rows  # (log(pred) is finite: log(1 - pred))
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (len(preds) - 1, "loss", "<loss>"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["phase"], o["op"], o["made"], o["samples"]) == (
        True, "precision", "loss", "aten.log", "-inf", rows), rep
    assert o["source"] == line_of("torch.log(1 - pred)"), o
    assert "binary_cross_entropy_with_logits" in rep["hint"], rep["hint"]
    assert "learning rate" not in rep["hint"], rep["hint"]


def test_transe_validated_before_training_names_the_forward_that_wrote_its_weights(tmp_path):
    """The same renorm in the forward, first run by a validation before training (gradients
    off): the evaluation's check reads no weights, so step 0 began with the NaN row, and the
    report said it 'came in so, with the state_dict loaded before (a checkpoint...)'. Re-run
    from the factory's values for that row, the forward writes the NaN again: its op is
    named."""
    model = M.make_transe(pad=0)
    opt = torch.optim.SparseAdam(list(model.parameters()), lr=0.01)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.MarginRankingLoss(), out_dir=tmp_path,
                            factory="knowledge_graphs_models:make_transe",
                            factory_kwargs={"pad": 0}) as rec:
            model.eval()
            with torch.no_grad():
                test = M.triples(g)
                model(test, M.with_tails(test, torch.randint(1, M.N_ENT, (M.BATCH, M.NEG),
                                                             generator=g)))
            model.train()
            for _ in range(3):
                pos = M.triples(g)
                neg = torch.randint(1, M.N_ENT, (M.BATCH, M.NEG), generator=g)
                opt.zero_grad()
                rec.loss_fn(model(pos, M.with_tails(pos, neg))).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["params"]) == (0, "weights", ["entities_emb.weight"])
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["phase"], o["module"], o["op"]) == (
        True, "invalid", "forward", "", "aten.div_"), rep
    assert (o["param"], o["rows"], o["source"]) == (
        "entities_emb.weight", [0], line_of("w.div_(w.norm(")), o
    assert "clamp_min(eps)" in rep["hint"] and "checkpoint" not in rep["hint"], rep["hint"]
    assert any("an earlier forward did" in p for p in rep["problems"]), rep["problems"]

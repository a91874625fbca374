"""End to end: word embeddings and large-vocabulary output layers (``embeddings_training_models``:
skip-gram with negative sampling, GloVe, sampled softmax with the log-Q correction, a fastText
subword bag, an adaptive softmax head), trained with their usual optimizers (SparseAdam beside
Adam, Adagrad, a linear learning-rate decay to 0) over a small synthetic corpus until a planted
bug fires, then replayed with the CLI; and healthy runs, which must raise nothing."""

from __future__ import annotations

import embeddings_training_models as M
import pytest
import torch
from bundles import line_number, nanreplay_json

from recorder import FlightRecorder, NonFiniteError

FACTORY = "embeddings_training_models:"


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> int:
    return line_number("embeddings_training_models.py", text)


def pairs_loader(seed: int = 0):
    return torch.utils.data.DataLoader(M.SkipGramPairs(), batch_size=M.BATCH, shuffle=True,
                                       generator=torch.Generator().manual_seed(seed))


def train_sgns(out_dir, lr: float, decay, epochs: int, **kw):
    """theeluwin/pytorch-sgns's loop: SparseAdam over both sparse tables, the learning rate
    decayed linearly by ``decay(step)``; the model returns the loss."""
    model = M.make_sgns()
    opt = torch.optim.SparseAdam(list(model.parameters()), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, decay)
    with FlightRecorder(model, opt, out_dir=out_dir, factory=FACTORY + "make_sgns",
                        lr_scheduler=sched, **kw):
        for _ in range(epochs):
            for center, context in pairs_loader():
                loss = model(center, context)
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
    return loss


def test_sgns_linear_decay_past_its_end_names_the_negative_learning_rate(tmp_path):
    # BUG: the decay's total is 4 steps, not the run's 32 per epoch, and the factor is not
    # stopped at 0: from step 5 the rate is below 0, SparseAdam climbs the loss, the dot
    # products grow and sigmoid(-|s|) underflows to 0 under log
    with pytest.raises(NonFiniteError) as info:
        train_sgns(tmp_path, 0.5, lambda s: 1 - s / 4, epochs=4)
    err = info.value
    assert err.event["phase"] == "forward", err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"]) == (
        True, "underflow", "", "aten.log", "-inf"), rep
    assert rep["event"]["step"] == err.event["step"]
    assert o["source"] == f"embeddings_training_models.py:{line_of('oloss = torch.bmm(')}" \
        or o["source"] == f"embeddings_training_models.py:{line_of('nloss = torch.bmm(')}", o
    assert o["samples"], o
    # (was: "the run was diverging ... lower the learning rate or clip the gradients" only,
    # which leaves the schedule's ascent in place)
    assert "learning rate was below 0 from step 5" in rep["hint"], rep["hint"]
    assert "the run was diverging" not in rep["hint"], rep["hint"]  # (a smaller rate: no fix)
    assert "max(0.0, 1 - step / total)" in rep["hint"], rep["hint"]
    assert "logsigmoid" in rep["hint"], rep["hint"]


def test_auto_tries_the_last_rate_above_zero_for_a_decay_run_past_its_end(tmp_path):
    with pytest.raises(NonFiniteError) as info:
        train_sgns(tmp_path, 0.5, lambda s: 1 - s / 4, epochs=4, rewind=8)
    rep = nanreplay_json(info.value.bundle_path, "--try", "auto")
    tries = {t["try"]: t for t in rep["what_if"]}
    # step 3's rate, the last above 0 (0.5 * (1 - 3 / 4)); was: no rate tried (the cause is
    # the log's underflow), and a tenth of the rate at the event (-1) climbs the loss too
    assert "lr=0.125" in tries and "lr=0.1x" not in tries, tries
    assert tries["lr=0.125"]["finite"] and not tries["lr=0.125"]["inconclusive"], tries


def test_sgns_without_a_schedule_bug_raises_nothing(tmp_path):
    # the counts hold 0 for ten tokens never seen (multinomial never draws them), the rate
    # decays to exactly 0 and stays there: no event
    loss = train_sgns(tmp_path, 0.01, lambda s: max(0.0, 1 - s / 40), epochs=2)
    assert torch.isfinite(loss) and not list(tmp_path.iterdir())


def glove_data(keep_zeros: bool):
    g = torch.Generator().manual_seed(0)
    x = torch.poisson(torch.rand(M.VOCAB, M.VOCAB, generator=g) * 3, generator=g).flatten()
    i, j = (t.flatten() for t in torch.meshgrid(torch.arange(M.VOCAB), torch.arange(M.VOCAB),
                                               indexing="ij"))
    keep = torch.ones_like(x, dtype=torch.bool) if keep_zeros else x > 0
    ds = torch.utils.data.TensorDataset(i[keep], j[keep], x[keep])
    return torch.utils.data.DataLoader(ds, batch_size=64, shuffle=True,
                                       generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("keep_zeros", [True, False])
def test_glove_with_the_zero_counts_kept_names_log_of_the_data(tmp_path, keep_zeros):
    # BUG: the dense co-occurrence matrix is batched whole, zeros kept: log(0) = -inf, and the
    # weighting (0 / x_max) ** alpha = 0 turns it into NaN (0 * inf); GloVe trains on the
    # nonzero entries only
    model = M.make_glove()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
    loader = glove_data(keep_zeros)
    first = next(iter(glove_data(keep_zeros)))[2]
    with FlightRecorder(model, opt, out_dir=tmp_path, factory=FACTORY + "make_glove"):
        try:
            for step, (i, j, x) in enumerate(loader):
                loss = model(i, j, x).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                if step == 5:
                    break
        except NonFiniteError as e:
            err = e
        else:
            assert not keep_zeros and not list(tmp_path.iterdir())
            return
    assert keep_zeros
    zeros = (first == 0).nonzero().flatten().tolist()
    assert (err.event["step"], err.event["phase"], err.event["samples"]) == (0, "forward", zeros)
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["made"], o["samples"]) == (
        True, "invalid", "aten.log", "-inf", zeros), rep
    assert o["source"] == f"embeddings_training_models.py:{line_of('torch.log(x)')}"
    assert "the batch's own data" in rep["hint"] and "drop or mask the sample" in rep["hint"]


def test_sampled_softmax_target_the_sampler_cannot_draw_is_named(tmp_path):
    # BUG: the log-Q correction divides by the unigram frequency of the training counts, and a
    # target of step 3 is a word those counts never saw: q = 0, logit - log(0) = +inf
    model = M.make_sampled_softmax()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    counts = M.unigram_counts()
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=tmp_path, loss_fn=M.cross_entropy_true_first,
                            factory=FACTORY + "make_sampled_softmax") as rec:
            for step in range(6):
                ids = torch.multinomial(counts, M.BATCH * 6, True, generator=g).view(M.BATCH, 6)
                targets = torch.multinomial(counts, M.BATCH, True, generator=g)
                if step == 3:
                    targets[5] = M.VOCAB - 1
                sampled = torch.multinomial(counts, 10, replacement=False, generator=g)
                loss = rec.loss_fn(model(ids, targets, sampled))
                opt.zero_grad()
                loss.backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"], err.event["samples"]) == (3, "forward", [5])
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "invalid", "", "aten.log", "-inf", [5]), rep
    assert o["source"] == \
        f"embeddings_training_models.py:{line_of('- torch.log(self.q[targets])')}"
    # (was: "clamp the op's input away from the pole (x.clamp_min(eps)) or add an eps", which
    # gives the unseen word a logit correction of -log(eps) and never names the table)
    assert "looked up in the buffer q" in rep["hint"], rep["hint"]
    assert "exactly 0 at 10 of its 60 entries (50, 51, 52" in rep["hint"], rep["hint"]
    assert "counts + 1" in rep["hint"] and "add an eps" not in rep["hint"], rep["hint"]


def test_fasttext_empty_bag_divided_by_its_length_names_the_sentence(tmp_path):
    # BUG: a sentence of only unknown words has no subwords: its bag is empty (EmbeddingBag
    # gives a row of 0s) and the hand-written mean divides it by its length 0: 0/0
    model = M.make_fasttext()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=tmp_path, loss_fn=crit,
                            factory=FACTORY + "make_fasttext"):
            for step in range(6):
                lengths = torch.randint(1, 6, (M.BATCH,), generator=g)
                if step == 3:
                    lengths[6] = 0
                sub = torch.randint(0, 200, (int(lengths.sum()),), generator=g)
                offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]])
                y = torch.randint(0, 4, (M.BATCH,), generator=g)
                loss = crit(model(sub, offsets), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"], err.event["samples"]) == (3, "forward", [6])
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["made"], o["samples"]) == (
        True, "invalid", "aten.div", "nan", [6]), rep
    assert o["source"] == f"embeddings_training_models.py:{line_of('/ lengths[:, None]')}"
    assert "0/0" in rep["hint"], rep["hint"]


def test_adaptive_softmax_under_sparse_adam_and_adam_raises_nothing(tmp_path):
    # a sparse input embedding stepped by SparseAdam after the recorded Adam of the head
    model = M.make_adaptive()
    sparse = torch.optim.SparseAdam(list(model.embed.parameters()), lr=1e-2)
    opt = torch.optim.Adam(model.head.parameters(), lr=1e-2)
    with FlightRecorder(model, opt, out_dir=tmp_path, factory=FACTORY + "make_adaptive"):
        for center, context in pairs_loader():
            loss = model(context, center)
            sparse.zero_grad()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sparse.step()
    assert torch.isfinite(loss) and not list(tmp_path.iterdir())


def test_sampled_softmax_accidental_hits_masked_to_minus_inf_asks_for_allow_inf(tmp_path):
    # remove_accidental_hits fills a sampled word equal to the row's true word with -inf in
    # the logits the model returns: an infinity at the root output, an event by default; the
    # report says it is an intended fill and which allow_inf pattern lets it through, and
    # with that pattern the run trains
    counts = M.unigram_counts()

    def run(**kw):
        model = M.make_sampled_softmax_without_hits()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(0)
        with FlightRecorder(model, opt, out_dir=tmp_path, loss_fn=M.cross_entropy_true_first,
                            factory=FACTORY + "make_sampled_softmax_without_hits", **kw) as rec:
            for _ in range(4):
                ids = torch.multinomial(counts, M.BATCH * 6, True, generator=g).view(M.BATCH, 6)
                targets = torch.multinomial(counts, M.BATCH, True, generator=g)
                sampled = torch.multinomial(counts, 10, replacement=False, generator=g)
                loss = rec.loss_fn(model(ids, targets, sampled))
                opt.zero_grad()
                loss.backward()
                opt.step()
        return loss

    with pytest.raises(NonFiniteError) as info:
        run()
    assert (info.value.event["step"], info.value.event["phase"]) == (0, "forward")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["op"], o["made"], o["chain"][0]["intentional"]) == (
        "aten.masked_fill", "-inf", True), rep
    assert o["source"] == f"embeddings_training_models.py:{line_of('masked_fill(hits')}"
    assert any("allow_inf=['']" in p for p in rep["problems"]), rep["problems"]
    for f in tmp_path.iterdir():
        f.unlink()
    assert torch.isfinite(run(allow_inf=[""])) and not list(tmp_path.iterdir())


def test_hierarchical_softmax_product_of_a_deep_path_underflows_in_float16(tmp_path):
    # BUG: the model was cast to float16 to fit a large vocabulary; a rare word's Huffman path
    # of 30 sigmoids multiplies to about 2 ** -30, below float16's range: log(0) = -inf
    model = M.make_hs_half()
    opt = torch.optim.SGD(model.parameters(), lr=0.025)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=tmp_path, factory=FACTORY + "make_hs_half"):
            for step in range(6):
                center = torch.randint(0, M.VOCAB, (M.BATCH,), generator=g)
                lengths = torch.randint(3, 12, (M.BATCH,), generator=g)
                if step == 3:
                    lengths[2] = 30  # a rare word deep in the tree
                points, codes = M.huffman_paths(center, lengths, step)
                loss = model(center, points, codes)
                opt.zero_grad()
                loss.backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (3, "forward"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"], o["samples"],
            o["dtype"]) == (True, "underflow", "", "aten.log", "-inf", [2], "float16"), rep
    assert o["source"] == f"embeddings_training_models.py:{line_of('torch.log(torch.prod(')}"
    assert "float32 holds it" in rep["hint"] and "logsigmoid" in rep["hint"], rep["hint"]


def test_fasttext_infinite_idf_weight_is_named_in_its_bag_after_an_empty_one(tmp_path):
    # BUG: tf-idf weights log(N / df) for EmbeddingBag(per_sample_weights=): a subword no
    # training document holds has df = 0 and an idf of +inf, in sample 6's bag at step 3;
    # sample 2's bag is empty at every step (offsets repeat), which must not shift the bags
    model = M.make_fasttext()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    df = torch.randint(1, 50, (200,), generator=g).float()
    df[17] = 0
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=tmp_path, loss_fn=crit,
                            factory=FACTORY + "make_fasttext"):
            for step in range(6):
                lengths = torch.randint(1, 6, (M.BATCH,), generator=g)
                lengths[2] = 0
                sub = torch.randint(0, 200, (int(lengths.sum()),), generator=g)
                sub[sub == 17] = 18
                offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]])
                if step == 3:
                    sub[offsets[6]] = 17
                idf = torch.log(1000 / df[sub])
                y = torch.randint(0, 4, (M.BATCH,), generator=g)
                loss = crit(model(sub, offsets, idf), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"], err.event["tensor"], err.event["samples"]) \
        == (3, "input", "args[2]", [6]), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["phase"], o["tensor"], o["made"],
            o["samples"]) == (True, "input", "input", "args[2]", "+inf", [6]), rep


def test_fasttext_mean_bags_with_empty_ones_under_sparse_adam_raise_nothing(tmp_path):
    # EmbeddingBag(mode="mean", sparse=True) of bags of which some are empty (a row of 0s,
    # finite gradients), SparseAdam beside the recorded Adam, both decayed linearly to 0
    model = M.make_fasttext_mean()
    sparse = torch.optim.SparseAdam(list(model.bag.parameters()), lr=0.05)
    opt = torch.optim.Adam(model.fc.parameters(), lr=0.05)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: max(0.0, 1 - s / 6))
              for o in (opt, sparse)]
    crit = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    with FlightRecorder(model, opt, out_dir=tmp_path, loss_fn=crit, lr_scheduler=scheds[0],
                        factory=FACTORY + "make_fasttext_mean"):
        for _ in range(8):
            lengths = torch.randint(0, 4, (M.BATCH,), generator=g)
            sub = torch.randint(0, 200, (int(lengths.sum()),), generator=g)
            offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]])
            loss = crit(model(sub, offsets), torch.randint(0, 4, (M.BATCH,), generator=g))
            sparse.zero_grad()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sparse.step()
            for s in scheds:
                s.step()
    assert torch.isfinite(loss) and not list(tmp_path.iterdir())


def test_nce_ratio_of_an_overflowing_model_probability_underflows_under_log(tmp_path):
    # BUG: Adam at lr=1.0: scores grow until p_model = exp(score - norm_term) dwarfs a noise
    # word's k * q, and q_noise / (p_model + q_noise) rounds to 0 under log
    model = M.make_nce()
    opt = torch.optim.Adam(model.parameters(), lr=1.0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=tmp_path, factory=FACTORY + "make_nce"):
            for _ in range(3):
                for center, context in pairs_loader():
                    loss = model(context, center)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
    err = info.value
    assert err.event["phase"] == "forward", err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"]) == (
        True, "underflow", "", "aten.log", "-inf"), rep
    assert rep["event"]["step"] == err.event["step"] and len(o["samples"]) == 1, rep
    assert o["source"] == f"embeddings_training_models.py:{line_of('torch.log(p_true)')}"
    assert "compute in log space" in rep["hint"], rep["hint"]

"""End to end: contrastive retrieval trained with GradCache (``gradient_caching_models``): the
batch embedded chunk by chunk under ``torch.no_grad()``, the loss on detached reps with its
gradient cached, each chunk re-run with grad under its saved RNG state and backpropagated with
``torch.dot(reps, cached)`` (or ``reps.backward(gradient=cached)``), as luyug/GradCache and
sentence-transformers' CachedMultipleNegativesRankingLoss (re-runs inside ``loss.backward()``)
write it; InfoNCE with CLIP's learned ``logit_scale``, SigLIP, VICReg, and Barlow Twins over two
views. Planted bugs must be named by the replay; healthy runs must raise nothing and train bit
for bit as without the recorder."""

from __future__ import annotations

import math

import gradient_caching_models as M
import pytest
import torch
import torch.nn.functional as F
from bundles import line_number, nanreplay_json

from recorder import FlightRecorder, NonFiniteError

FACTORY = "gradient_caching_models:"
CHUNK, BATCH = 4, 8

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> int:
    return line_number("gradient_caching_models.py", text)


def pairs(n: int = 32, empty=()):
    """Query/passage token ids (a query is its passage's first tokens), padded with 0 and
    masked; passages ``empty`` are all padding (a blank document in the corpus)."""
    g = torch.Generator().manual_seed(0)
    p = torch.randint(1, M.VOCAB, (n, M.SEQ), generator=g)
    pm = (torch.arange(M.SEQ) < torch.randint(3, M.SEQ + 1, (n, 1), generator=g)).long()
    p = p * pm
    q, qm = p.clone(), pm.clone()
    q[:, 4:], qm[:, 4:] = 0, 0
    p[list(empty)], pm[list(empty)] = 0, 0
    ds = torch.utils.data.TensorDataset(q, qm, p, pm)
    return torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=True,
                                       generator=torch.Generator().manual_seed(1))


def train_gradcache(out_dir, *, steps: int, record: bool = True, init=None, scale_lr=1e-3,
                    surrogate="dot", eps_pool=True, empty=()):
    """luyug/GradCache's loop: ``cache_step`` on the query and passage batches, then the
    optimizer; the loss's ``logit_scale`` trained in its own parameter group."""
    model = M.make_encoder(eps_pool)
    loss_fn = M.InfoNCE(clamp=False) if init is not None else M.InfoNCE()
    if init is not None:
        loss_fn.logit_scale.data.fill_(init)  # (a run resumed with the scale it had learned)
    opt = torch.optim.AdamW([{"params": model.parameters()},
                             {"params": loss_fn.parameters(), "lr": scale_lr}], lr=1e-3)
    gc = M.GradCache(model, CHUNK, loss_fn, surrogate)
    rec = FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir,
                         factory=FACTORY + "make_encoder", factory_kwargs={"eps_pool": eps_pool}
                         ) if record else None
    losses = []
    with rec or torch.enable_grad():
        if record:
            gc.loss_fn = rec.loss_fn
        for q, qm, p, pm in pairs(empty=empty):
            opt.zero_grad()
            losses.append(gc.cache_step({"input_ids": q, "attention_mask": qm},
                                        {"input_ids": p, "attention_mask": pm}))
            opt.step()
            if len(losses) == steps:
                break
    return model, loss_fn, losses


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                   b.state_dict().values(), strict=True))


@pytest.mark.parametrize("surrogate", ["dot", "gradient"])
def test_healthy_gradcache_raises_nothing_and_trains_as_without_the_recorder(tmp_path,
                                                                             surrogate):
    # the no-grad pass, the loss on detached reps and the chunks' backward with the cached
    # gradient, dropout redrawn under each chunk's restored RNG state: nothing to report, and
    # the recorder draws from no generator the RandContext restores
    model, loss_fn, losses = train_gradcache(tmp_path, steps=3, surrogate=surrogate)
    bare, bare_loss, bare_losses = train_gradcache(None, steps=3, record=False,
                                                   surrogate=surrogate)
    assert not list(tmp_path.iterdir())
    assert same(model, bare) and same(loss_fn, bare_loss)
    assert torch.equal(torch.stack(losses), torch.stack(bare_losses))


def test_huge_but_finite_cached_gradients_then_the_no_grad_pass_raise_nothing(tmp_path):
    # exp(50) = 5.2e21: every cached gradient is finite but its squared norm overflows, which
    # the recorder rightly lets pass (AdamW's state, checked after such an update, stays
    # finite). The +inf norms stayed in its slots, and the next step's no-grad forwards (an
    # evaluation to the recorder, which writes no gradient norm) read them back: "non-finite
    # statistic with no identifiable source" at step 5, not reproduced
    model, loss_fn, losses = train_gradcache(tmp_path, steps=7, init=50.0, scale_lr=0.1)
    assert not list(tmp_path.iterdir())
    assert all(torch.isfinite(v) for v in losses), losses
    assert loss_fn.logit_scale.item() < 50.0  # (the scale did learn down)
    bare, bare_loss, _ = train_gradcache(None, steps=7, record=False, init=50.0, scale_lr=0.1)
    assert same(model, bare) and same(loss_fn, bare_loss)


def test_cached_gradients_whose_squares_overflow_adams_state_are_an_optimizer_event(tmp_path):
    # exp(88) = 1.7e38: the gradients are finite, AdamW's (1 - beta2) g ** 2 is not, and every
    # later update of those entries would be 0 (the weights frozen, silently): the update of
    # step 0 is the event, naming the state
    with pytest.raises(NonFiniteError) as info:
        train_gradcache(tmp_path, steps=7, init=88.0, scale_lr=0.1)
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (0, "optimizer"), ev
    assert ev["state"]["embed.weight"] == ["exp_avg_sq"], ev["state"]


def test_unclamped_logit_scale_past_float32_names_the_exp_on_the_detached_reps(tmp_path):
    # BUG: open_clip clamps logit_scale.exp() at 100; without it a scale learned to 89 makes
    # exp overflow in the loss GradCache computes between its no-grad pass and the re-runs
    with pytest.raises(NonFiniteError) as info:
        train_gradcache(tmp_path, steps=3, init=89.0)
    err = info.value
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "loss", "<loss>", "nan")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"]) == (
        True, "overflow", "<loss>", "aten.exp", "+inf"), rep
    assert o["source"] == f"gradient_caching_models.py:{line_of('scale = self.logit_scale.exp()')}"
    assert "<loss>.logit_scale" in rep["hint"] and "clamp(max=" in rep["hint"], rep["hint"]


def test_blank_passage_in_the_no_grad_pass_names_its_row_of_the_loaders_batch(tmp_path):
    # BUG: mean pooling divides by the token count without sentence-transformers' clamp at
    # 1e-9: a passage of padding only is 0/0. GradCache's first pass runs the model on chunks
    # of the batch under no_grad (an evaluation forward to the recorder), so the bundle holds
    # one chunk, whose sample 0 is not the loader's: the report says which row it was
    with pytest.raises(NonFiniteError) as info:
        train_gradcache(tmp_path, steps=4, eps_pool=False, empty=[5, 21])
    err = info.value
    ev = err.event
    batches = list(pairs(empty=[5, 21]))
    blank = (batches[ev["step"]][3].sum(1) == 0).nonzero().flatten().tolist()
    first = blank[0] // CHUNK  # (queries first, then the passage chunks in order)
    rows = [r for r in blank if r // CHUNK == first]
    chunk_rows = [r - first * CHUNK for r in rows]
    assert (ev["phase"], ev["module"], ev["evaluation"], ev["samples"]) == (
        "forward", "", True, chunk_rows), ev
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["made"], o["samples"]) == (
        True, "invalid", "aten.div", "nan", chunk_rows), rep
    assert o["source"] == f"gradient_caching_models.py:{line_of('pooled = (h * m).sum(1) / count')}"
    assert o["batch_rows"] == rows, o
    assert first > 0, blank  # (a chunk after the first: its rows are not the batch's)
    note = next(p for p in rep["problems"] if "sliced them from" in p)
    assert (f"rows {first * CHUNK} to {first * CHUNK + CHUNK - 1} of a {BATCH}-row tensor"
            in note), note


@pytest.mark.parametrize(("surrogate", "given"), [("dot", True), ("gradient", True),
                                                  ("dot", False)])
def test_nan_cached_gradient_of_a_blank_passage_is_said_to_come_from_the_cached_loss(
        tmp_path, surrogate, given):
    # BUG: the loss normalises by hand, sqrt(sum x^2).clamp(min=eps): a blank passage pools to
    # exactly 0 (sentence-transformers' clamp keeps the pooling finite, and there is no Dense
    # layer after it), so the loss is finite but its backward is 0 * inf at the sqrt. GradCache
    # caches that NaN gradient and feeds it to the passage chunk's re-run. The loss ran before
    # the step's first forward (the recorder checked it as the no-grad pass's): the replay
    # said it "was not called in this step" and to "compute the step's loss with the loss
    # module given as loss_fn", which the loop did
    model = M.make_encoder(True, False)
    loss_fn = M.InfoNCE(normalize=M.l2_normalize)
    # (without loss_fn, as most loops record: the optimizer holds the model's parameters)
    opt = torch.optim.AdamW([*model.parameters(), *loss_fn.parameters()] if given
                            else model.parameters(), lr=1e-3)
    gc = M.GradCache(model, CHUNK, loss_fn, surrogate)
    batches = list(pairs(empty=[5, 21]))
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=loss_fn if given else None, out_dir=tmp_path,
                            factory=FACTORY + "make_encoder",
                            factory_kwargs={"project": False}) as rec:
            gc.loss_fn = rec.loss_fn if given else loss_fn
            for q, qm, p, pm in batches:
                opt.zero_grad()
                gc.cache_step({"input_ids": q, "attention_mask": qm},
                              {"input_ids": p, "attention_mask": pm})
                opt.step()
    err = info.value
    ev = err.event
    blank = (batches[ev["step"]][3].sum(1) == 0).nonzero().flatten().tolist()
    assert blank and ev["phase"] == "backward" and ev["kind"] == "nan", ev
    first = blank[0] // CHUNK
    rows = [r for r in blank if r // CHUNK == first]
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    mb = BATCH // CHUNK + first  # (the query chunks re-run first)
    assert (rep["reproduced"], o["micro_batch"], o["tensor"], o["samples"], o["batch_rows"]) == (
        True, mb, "grad of the model output", [r - first * CHUNK for r in rows], rows), rep
    assert f"cached gradient of micro-batch {mb}" in rep["hint"], rep["hint"]
    assert "compute the step's loss with the loss module" not in rep["hint"], rep["hint"]
    if not given:  # (the chunks may be an accumulation's with its loss inline: both said)
        assert "pass it as FlightRecorder(..., loss_fn=...)" in rep["hint"], rep["hint"]
        assert "GradCache" in rep["hint"] and "is not re-run" in rep["hint"], rep["hint"]
        return
    note = next(p for p in rep["problems"] if "was not called in this step" in p)
    assert "gradient_caching_models.InfoNCE" in note and "GradCache" in note, note


@pytest.mark.filterwarnings("ignore:var.*degrees of freedom:UserWarning")
def test_vicreg_over_a_last_batch_of_one_names_var_of_too_few_values(tmp_path):
    # BUG: 33 pairs in batches of 8 without drop_last: the last batch holds one pair, and
    # VICReg's variance (correction 1) of one sample is 0/0 in the cached loss
    model = M.make_encoder()
    loss_fn = M.VICRegLoss()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gc = M.GradCache(model, CHUNK, loss_fn)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=tmp_path,
                            factory=FACTORY + "make_encoder") as rec:
            gc.loss_fn = rec.loss_fn
            for q, qm, p, pm in pairs(n=33):
                opt.zero_grad()
                gc.cache_step({"input_ids": q, "attention_mask": qm},
                              {"input_ids": p, "attention_mask": pm})
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["evaluation"]) == (4, "loss", "<loss>", True)
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"]) == (
        True, "invalid", "<loss>", "aten.var"), rep
    assert o["source"] == f"gradient_caching_models.py:{line_of('std_x = torch.sqrt(x.var(')}"
    assert "a batch of 1" in rep["hint"], rep["hint"]


def train_cached_mnrl(out_dir, *, steps: int, record: bool = True, **kw):
    """sentence-transformers' loop with CachedMultipleNegativesRankingLoss: the loss module
    holds the model, and the chunks' re-runs run inside the loop's loss.backward()."""
    model = M.make_encoder(**kw)
    hand = kw.get("project") is False  # (with the hand-written normalisation)
    loss_fn = M.CachedMNRL(model, normalize=M.l2_normalize if hand else F.normalize)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rec = FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir,
                         factory=FACTORY + "make_encoder", factory_kwargs=kw) if record else None
    losses = []
    with rec or torch.enable_grad():
        for q, qm, p, pm in pairs(empty=[5, 21]):
            opt.zero_grad()
            loss = loss_fn([{"input_ids": q, "attention_mask": qm},
                            {"input_ids": p, "attention_mask": pm}])
            loss.backward()
            opt.step()
            losses.append(loss.detach())
            if len(losses) == steps:
                break
    return model, losses


def test_healthy_cached_mnrl_whose_re_runs_run_inside_backward_raises_nothing(tmp_path):
    model, losses = train_cached_mnrl(tmp_path, steps=3)
    bare, bare_losses = train_cached_mnrl(None, steps=3, record=False)
    assert not list(tmp_path.iterdir())
    assert same(model, bare) and torch.equal(torch.stack(losses), torch.stack(bare_losses))


def test_cached_mnrl_nan_cached_gradient_names_the_chunk_and_its_batch_row(tmp_path):
    # the same hand-written normalisation at a blank passage's zero embedding, with the
    # re-runs inside loss.backward()'s hook (nested backward() per mini-batch)
    with pytest.raises(NonFiniteError) as info:
        train_cached_mnrl(tmp_path, steps=4, project=False)
    ev = info.value.event
    assert (ev["phase"], ev["kind"]) == ("backward", "nan"), ev
    blank = (list(pairs(empty=[5, 21]))[ev["step"]][3].sum(1) == 0).nonzero().flatten().tolist()
    first = blank[0] // CHUNK
    rows = [r for r in blank if r // CHUNK == first]
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    mb = BATCH // CHUNK + first
    assert (rep["reproduced"], o["micro_batch"], o["samples"], o["batch_rows"]) == (
        True, mb, [r - first * CHUNK for r in rows], rows), rep
    assert f"cached gradient of micro-batch {mb}" in rep["hint"], rep["hint"]


def two_views(n: int = 256):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 10, generator=g)
    noise = torch.randn(2, n, 10, generator=g)
    ds = torch.utils.data.TensorDataset(x + 0.1 * noise[0], x + 0.1 * noise[1])
    return torch.utils.data.DataLoader(ds, batch_size=32, shuffle=True,
                                       generator=torch.Generator().manual_seed(1))


def test_barlow_twins_dead_feature_names_its_column_not_the_rows(tmp_path):
    # BUG: the paper's pseudo-code standardises each feature by its batch std with no eps, and
    # this projector ends in a ReLU; at a learning rate too high a unit dies (0 for every
    # sample), its std is 0 and (z - mean) / std is 0/0 in that column of every row. The
    # report said "all 32 rows" and "skip the rows where it is 0": no row is to blame
    model = M.make_twins(relu_out=True)
    loss_fn = M.BarlowTwinsLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9, weight_decay=1e-6)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=tmp_path,
                            factory=FACTORY + "make_twins", factory_kwargs={"relu_out": True}):
            for _ in range(3):
                for y1, y2 in two_views():
                    z1, z2 = model(y1, y2)
                    loss = loss_fn(z1, z2)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
    ev = info.value.event
    assert (ev["phase"], ev["module"]) == ("loss", "<loss>"), ev
    dead = [(z == z[:1]).all(0).nonzero().flatten().tolist() for z in (z1, z2)]
    first = 0 if dead[0] else 1
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["made"], o["all_samples"]) == (
        True, "invalid", "aten.div", "nan", True), rep
    line = f"z{first + 1} = (z{first + 1} - z{first + 1}.mean(0)) / z{first + 1}.std(0)"
    assert o["source"] == f"gradient_caching_models.py:{line_of(line)}", o
    assert f"in the same column(s) {dead[first]} of every one of the 32 rows" in rep["hint"]
    assert "no sample is to blame" in rep["hint"] and "skip the rows" not in rep["hint"]


def test_siglip_log_of_sigmoid_under_gradcache_names_the_underflow(tmp_path):
    # BUG: SigLIP's loss written -log(sigmoid(z)) instead of -logsigmoid(z): with the learned
    # temperature at 300 a hard negative's sigmoid underflows to 0 in the cached loss
    model = M.make_encoder()
    loss_fn = M.SigLipLoss(log_sigmoid=False)
    loss_fn.t_prime.data.fill_(math.log(300.0))  # (resumed with the temperature it learned)
    opt = torch.optim.AdamW([*model.parameters(), *loss_fn.parameters()], lr=1e-3)
    gc = M.GradCache(model, CHUNK, loss_fn)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=tmp_path,
                            factory=FACTORY + "make_encoder") as rec:
            gc.loss_fn = rec.loss_fn
            for q, qm, p, pm in pairs():
                opt.zero_grad()
                gc.cache_step({"input_ids": q, "attention_mask": qm},
                              {"input_ids": p, "attention_mask": pm})
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["evaluation"]) == (0, "loss", "<loss>", True)
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"]) == (
        True, "underflow", "<loss>", "aten.log", "-inf"), rep
    assert o["source"] == f"gradient_caching_models.py:{line_of('-torch.log(torch.sigmoid(')}"
    assert "logsigmoid" in rep["hint"], rep["hint"]


def test_duplicate_positive_mask_that_also_masks_the_target_names_the_masked_target(tmp_path):
    # BUG: popular passages repeat in a batch, so duplicates are masked out of the negatives
    # with -inf, but the mask forgets ``& ~eye``: every query's own positive is -inf too, and
    # cross-entropy of a -inf target logit is +inf
    g = torch.Generator().manual_seed(0)
    docs = torch.randint(0, 24, (32,), generator=g)
    p = torch.randint(1, M.VOCAB, (24, M.SEQ), generator=g)[docs]
    q = p.clone()
    q[:, 4:] = 0
    ds = torch.utils.data.TensorDataset(q, (q > 0).long(), p, torch.ones_like(p), docs)
    model, loss_fn = M.make_encoder(), M.DedupInfoNCE(keep_own=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=tmp_path,
                            factory=FACTORY + "make_encoder") as rec:
            for q, qm, p, pm, d in torch.utils.data.DataLoader(ds, batch_size=BATCH):
                opt.zero_grad()
                rec.loss_fn(model(q, qm), model(p, pm), d).backward()
                opt.step()
    ev = info.value.event
    # (the query and the passage forwards are the step's two micro-batches)
    assert (ev["step"], ev["phase"], ev["micro_batch"]) == (0, "loss", 1), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["made"], o["all_samples"]) == (
        True, "invalid", "aten.nll_loss_forward", "+inf", True), rep
    assert [(c["op"], c["intentional"]) for c in o["chain"]] == [
        ("aten.masked_fill", True), ("aten.nll_loss_forward", False)], o["chain"]
    assert o["chain"][0]["source"] == (
        f"gradient_caching_models.py:{line_of('scores = scores.masked_fill(same')}")
    assert "a target on a masked class" in rep["hint"], rep["hint"]

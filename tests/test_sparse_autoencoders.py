"""End to end on sparse autoencoders trained on a frozen transformer's cached activations
(``sparse_autoencoders_models``): SAELens's ReLU SAE (decoder-norm-weighted L1, unit-norm
decoder rows re-applied after each step, the gradient's parallel component removed before
it, ghost grads for dead latents given to ``forward`` as a mask), OpenAI's TopK SAE with
AuxK and normalised MSE, and Gemma Scope's JumpReLU with straight-through threshold
estimators. Each planted bug of the domain fires under the recorder and is replayed with the
CLI; the healthy versions raise no event and train bit-identically with and without the
recorder."""

from __future__ import annotations

import contextlib

import pytest
import sparse_autoencoders_models as M
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

BATCH, SEQS = 64, 32


def line_of(text: str) -> str:
    return source_line("sparse_autoencoders_models.py", text)


def batches(steps: int, short_last: bool = False, bos_last: bool = False,
            short_at: int | None = None, dry_last: bool = False, dry_first: bool = False):
    """(batch, buffer) of each step: the buffer refilled with ``SEQS`` contexts, then one
    shuffled batch drawn; the last refill (or that of step ``short_at``) short of contexts
    (its draws reach rows left zero) or empty (the token stream ran dry: every row zero), or
    the last keeping the BOS position."""
    g = torch.Generator().manual_seed(0)
    buffer = M.ActivationBuffer(M.frozen_lm(), SEQS, g)
    for step in range(steps):
        last = step == steps - 1
        short = short_last and last or step == short_at
        dry = dry_last and last or dry_first and step == 0
        n = 0 if dry else SEQS - 4 if short else SEQS
        buffer.fill(n, keep_bos=bos_last and last)
        yield buffer.next_batch(BATCH), buffer


def step_outputs(model, loss_fn, x, dead):
    """The loss of one batch, and the latents that fired, as each SAE's loop computes them."""
    if isinstance(model, M.ReLUSAE):
        x_hat, f, norms, ghost_out = model(x, dead)
        return loss_fn(x_hat, f, norms, ghost_out, x), f
    if isinstance(model, M.TopKSAE):
        x_hat, f, aux, seen = model(x, dead)
        return loss_fn(x_hat, f, aux, seen), f
    x_hat, f, l0 = model(x)
    return loss_fn(x_hat, f, l0, x), f


def train(make: str, out_dir, steps: int = 4, record: bool = True, ghost: bool = False,
          normalized: str | None = None, resample_at: int | None = None,
          median_init: bool = False, **plant):
    """SAELens's loop: Adam, a warm-up of the learning rate, gradient clipping, the parallel
    component of W_dec's gradient removed before the step and its rows set to unit norm
    after; latents not fired in the last step are dead (ghost grads, AuxK), resampled from
    the buffer's next inputs after step ``resample_at``."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=4e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))
    crit = {"make_topk": M.topk_loss, "make_topk_standardized": M.topk_loss,
            "make_jumprelu": M.jumprelu_loss}.get(
        make, M.SAELoss(normalized=normalized))
    relu = isinstance(model, M.ReLUSAE)
    since_fired = torch.zeros(M.N_LATENTS)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"sparse_autoencoders_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step, (x, buffer) in enumerate(batches(steps, **plant)):
            if step == 0 and median_init:  # (SAELens: b_dec from the first buffer's median)
                model.b_dec.data = M.geometric_median(buffer.acts)
            if step == 0 and median_init:  # (SAELens: b_dec from the first buffer's median)
                model.b_dec.data = M.geometric_median(buffer.acts).to(model.b_dec.dtype)
            dead = since_fired >= 1 if ghost or make.startswith("make_topk") else None
            loss, f = step_outputs(model, loss_fn, x, dead)
            opt.zero_grad()
            loss.backward()
            if relu:
                model.remove_gradient_parallel_to_decoder_directions()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if relu:
                model.set_decoder_norm_to_unit_norm()
            since_fired += 1
            since_fired[(f.detach() > 0).any(0)] = 0
            if step == resample_at:
                model.resample_dead(since_fired >= 1, buffer.next_batch(M.N_LATENTS))
                model.reset_adam_state(opt, since_fired >= 1)
    return model


def fire(make: str, tmp_path, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(make, tmp_path, **kw)
    return info.value.event, info.value.bundle_path


def last_batch(**plant) -> torch.Tensor:
    return list(batches(4, **plant))[-1][0]


def test_normalized_mse_of_unfilled_buffer_rows_names_the_division_and_the_empty_rows(tmp_path):
    """A short refill of the activation buffer (fewer contexts than it holds) leaves rows of
    its fresh ``torch.zeros`` that the shuffled draw still reaches; OpenAI's normalised MSE
    divides each row's error by its input's mean square, 0 there: a loss event, named at that
    division on exactly the all-zero rows, and the hint says the divisor is the data's (an
    eps would weight those rows' error by 1/eps) and to drop or mask such records."""
    x = last_batch(short_last=True)
    empty = torch.nonzero((x == 0).all(1)).flatten().tolist()
    assert 0 < len(empty) < len(x), empty
    ev, bundle = fire("make_relu", tmp_path, normalized="rows", short_last=True)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (3, "loss", "<loss>", "+inf")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["op"], o["samples"]) == (True, "aten.div", empty), o
    assert o["source"] == line_of("/ (x ** 2).mean(dim=1)).mean()"), o
    hint = rep["hint"]
    assert rep["cause"] == "invalid" and "divisor there was computed from the batch's data " \
        "alone" in hint and "weight their error by 1/eps" in hint, hint
    assert "leave them out of the loss" in hint, hint


def test_ghost_grads_exp_of_a_bos_massive_activation_names_the_exp_and_the_bos_rows(tmp_path):
    """The buffer keeps the BOS position, whose attention-sink activation is ~1e3 in a few
    dimensions; SAELens's ghost grads take ``exp`` of the dead latents' pre-activations, which
    overflows on those rows (then ``inf * 0`` of the norm scaling is NaN). The replay names
    the exp in the root module on exactly the BOS rows, overflow, and the rows' out-of-scale
    data with the drop that re-runs the step finite."""
    x = last_batch(bos_last=True)
    bos = torch.nonzero(x.norm(dim=1) > 100).flatten().tolist()
    assert 0 < len(bos) < len(x), bos
    ev, bundle = fire("make_relu", tmp_path, ghost=True, bos_last=True)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "", bos), ev
    which = ",".join(map(str, bos))
    rep = nanreplay_json(bundle, "--try", f"drop={which}")
    o = rep["origin"]
    assert (o["module"], o["call"], o["op"], o["made"], o["samples"]) == (
        "", 0, "aten.exp", "+inf", bos), o
    assert o["source"] == line_of("ghost = torch.exp(pre[:, dead_mask]) @ W_dec[dead_mask]"), o
    assert rep["cause"] == "overflow" and "out of scale" in rep["hint"], rep["hint"]
    assert f"--try drop={which}" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_unrecorded_ghost_grads_overflow_turns_every_weight_nan(tmp_path):
    """Without the recorder the ghost loss's NaN reaches Adam, and the decoder is NaN after
    the step: the event above is the bug, not a false alarm."""
    model = train("make_relu", tmp_path, record=False, ghost=True, bos_last=True)
    assert not torch.isfinite(model.W_dec).all()


@pytest.mark.parametrize("make,kw", [("make_relu", {"ghost": True}),
                                     ("make_relu", {"normalized": "rows"}),
                                     ("make_relu", {"normalized": "fvu"}),
                                     ("make_topk", {}), ("make_jumprelu", {})])
def test_healthy_saes_raise_nothing_and_train_the_same(tmp_path, make, kw):
    """Ghost grads on sound activations, the normalised MSE, TopK's scatter with AuxK's
    ``-inf`` fill of the live latents (it stays inside the forward) and JumpReLU's
    straight-through threshold Functions: no event, and bit-identical weights with and
    without the recorder (the loop's gradient projection and renormalisation included)."""
    recorded = train(make, tmp_path, **kw)
    plain = train(make, tmp_path, record=False, **kw)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_resampled_dead_latent_from_an_empty_row_names_the_zero_decoder_row(tmp_path):
    """Anthropic's resampling after step 2 writes each dead latent's decoder row from the
    buffer's next inputs, not normalised (the forward divides each row by its norm); a short
    refill left zero rows there, so one decoder row is all 0 and the forward's
    ``W_dec / W_dec.norm(dim=-1, keepdim=True)`` is 0/0 in that row, NaN in every sample's
    reconstruction. The replay names the division on its line, every sample, and the
    parameter's zero row (the one an unrecorded copy of the run leaves 0) as written by code,
    not by a gradient step."""
    before = train("make_relu_normalized", tmp_path, steps=3, record=False, resample_at=2,
                   short_at=2)
    zero = torch.nonzero((before.W_dec == 0).all(1)).flatten().tolist()
    assert len(zero) == 1, zero
    ev, bundle = fire("make_relu_normalized", tmp_path, resample_at=2, short_at=2)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (3, "forward", "", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["all_samples"]) == (
        True, "", "aten.div", "nan", True), o
    assert o["source"] == line_of("return self.W_dec / self.W_dec.norm(dim=-1, keepdim=True)")
    hint = rep["hint"]
    assert rep["cause"] == "invalid" and f"parameter W_dec is 0 in whole slices along dim 0 " \
        f"({zero[0]})" in hint, hint
    assert "code wrote it" in hint and "clamp_min(eps)" in hint, hint


def test_variance_normalised_mse_of_a_dry_stream_blames_no_row_and_skips_the_batch(tmp_path):
    """The token stream runs dry: the last refill caches nothing and the whole batch is the
    fresh buffer's zeros. The fraction of variance unexplained divides the batch's error by
    its variance about the mean, a 0-d 0: the replay names that division with no sample to
    blame, and says to skip such batches or guard the statistic, not to drop rows."""
    assert bool((last_batch(dry_last=True) == 0).all())
    ev, bundle = fire("make_relu", tmp_path, normalized="fvu", dry_last=True)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (3, "loss", "<loss>", "+inf")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["op"], o["samples"]) == (True, "aten.div", []), o
    assert o["source"] == line_of("/ ((x - x.mean(0)) ** 2).sum()"), o
    assert rep["cause"] == "invalid" and "no row is to blame" in rep["hint"], rep["hint"]
    assert "skip such batches" in rep["hint"], rep["hint"]


def test_unit_norm_constraint_of_a_resampled_zero_row_names_the_loops_write(tmp_path):
    """Without the forward's normalisation, the zero decoder row the resampling wrote (its
    Adam moments reset, its encoder column 0, so it never fires and no update moves it)
    reaches SAELens's ``set_decoder_norm_to_unit_norm`` after step 3's update: 0/0 writes
    NaN into that row outside the optimizer. The recorder stops step 4 on W_dec; the replay
    says the loop wrote it between step 3's update and step 4 (dead units re-initialised, a
    norm of zero) and names the very row."""
    before = train("make_relu", tmp_path, steps=3, record=False, resample_at=2, short_at=2)
    zero = torch.nonzero((before.W_dec == 0).all(1)).flatten().tolist()
    assert len(zero) == 1, zero
    ev, bundle = fire("make_relu", tmp_path, steps=5, resample_at=2, short_at=2)
    assert (ev["step"], ev["phase"], ev["params"], ev["kind"]) == (4, "weights", ["W_dec"],
                                                                  "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["param"], rep["cause"]) == (True, "W_dec", "weights"), rep
    hint = rep["hint"]
    assert "the loop wrote it between that update and step 4" in hint, hint
    assert "dead units re-initialised" in hint, hint
    assert f"only row(s) {zero[0]} of 128 of W_dec are non-finite" in hint, hint


def test_geometric_median_init_of_an_empty_buffer_names_b_dec_as_it_came_in(tmp_path):
    """SAELens initialises ``b_dec`` to the first buffer's geometric median; with the stream
    dry at the first refill every point is 0, Weiszfeld's inverse distances are 1/0 and the
    median inf/inf: b_dec is NaN before the first step. The recorder stops step 0 on b_dec
    (no update ran), and the replay names it, read by the first op of the forward, as come in
    non-finite, made before the recorder attached by a data-dependent init (not an update)."""
    assert bool(torch.isnan(M.geometric_median(torch.zeros(8, M.D_MODEL))).all())
    ev, bundle = fire("make_relu", tmp_path, median_init=True, dry_first=True)
    assert (ev["step"], ev["phase"], ev["params"], ev["kind"]) == (0, "weights", ["b_dec"],
                                                                  "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["param"], rep["cause"], o["all_samples"]) == ("b_dec", "weights", True), rep
    assert o["source"] == line_of("pre = (x - self.b_dec) @ self.W_enc + self.b_enc"), o
    hint = rep["hint"]
    assert "non-finite at the first step the recorder saw" in hint, hint
    assert "geometric median" in hint and "every element of it is non-finite" in hint, hint


def train_bf16(out_dir, record: bool = True, steps: int = 3, accum: int = 2):
    """OpenAI's TopK SAE trained as large runs are: the forward under bfloat16 autocast, the
    batch split into ``accum`` micro-batches whose losses accumulate into one update,
    AdamW and clipping; AuxK's dead latents from the firing counts."""
    model = M.make_topk()
    opt = torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=0.0)
    since_fired = torch.zeros(M.N_LATENTS)
    rec = FlightRecorder(model, opt, loss_fn=M.topk_loss, out_dir=out_dir,
                         factory="sparse_autoencoders_models:make_topk") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else M.topk_loss
        for x, _ in batches(steps):
            opt.zero_grad()
            for part in x.chunk(accum):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    x_hat, f, aux, seen = model(part, since_fired >= 1)
                loss = loss_fn(x_hat.float(), f, aux.float(), seen) / accum
                loss.backward()
                since_fired[(f.detach() > 0).any(0)] = -1
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            since_fired += 1
    return model


def test_bf16_topk_with_accumulation_raises_nothing_and_trains_the_same(tmp_path):
    """bfloat16 autocast, two micro-batches per update, AuxK's ``-inf`` fill of the live
    latents inside the forward: no event, and the same weights with and without the
    recorder."""
    recorded = train_bf16(tmp_path)
    plain = train_bf16(tmp_path, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_input_standardisation_of_unfilled_buffer_rows_names_the_std_division(tmp_path):
    """OpenAI's preprocessing standardises each input row in the forward; written without
    its eps, the unfilled buffer's zero rows are 0/0 there. The replay names that division
    on its line in the root's call, exactly the all-zero rows, and to guard the std."""
    x = last_batch(short_last=True)
    empty = torch.nonzero((x == 0).all(1)).flatten().tolist()
    ev, bundle = fire("make_topk_standardized", tmp_path, short_last=True)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "", empty)
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["call"], o["op"], o["made"], o["samples"]) == (
        "", 0, "aten.div", "nan", empty), o
    assert o["source"] == line_of("x = (x - mu) / x.std(-1, keepdim=True)"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert "std + eps" in rep["hint"], rep["hint"]

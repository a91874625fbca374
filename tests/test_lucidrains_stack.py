"""End to end on research models built on lucidrains' libraries (``lucidrains_stack_models``):
x-transformers' ``AutoregressiveWrapper`` language model fine-tuned under float16 autocast with
a GradScaler (an LR range test on it too; told the padding id; with the attention z-loss over a
left-padded batch), an ``Encoder`` text classifier given its padding mask, a VQ-VAE on
``VectorQuantize``'s k-means initialised EMA codebook (updated in place in its forward) and an
``LFQ`` autoencoder with the user's codebook-usage entropy. Each planted bug fires under the
recorder and is replayed with the CLI; the healthy versions raise no event and train
bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib
import logging

import lucidrains_stack_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

STEPS = 3


def line_of(text: str) -> str:
    return source_line("lucidrains_stack_models.py", text)


@pytest.fixture(autouse=True)
def quiet_kmeans():
    """vector-quantize-pytorch warns through loguru at each k-means init of a codebook larger
    than the batch's vectors (each re-run of the replay too)."""
    try:
        from loguru import logger
    except ImportError:  # (it logs through the standard logging then)
        logging.getLogger("vector_quantize_pytorch").setLevel(logging.ERROR)
        yield
        return
    logger.disable("vector_quantize_pytorch")
    yield
    logger.enable("vector_quantize_pytorch")


def train(kind: str, make: str, out_dir, record: bool = True, empty=(), nan_row=None):
    """AdamW with gradient clipping; the language model under float16 autocast with a
    GradScaler (unscaled before clipping), as x-transformers' enwik8 example fine-tunes; the
    spherical-distance VQ-VAE under bfloat16 autocast."""
    model = getattr(M, make)()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amp = kind == "lm"
    half = torch.bfloat16 if kind == "sphere" else torch.float16
    scaler = torch.amp.GradScaler("cpu", enabled=amp)
    crit = {"lm": None, "cls": torch.nn.CrossEntropyLoss()}.get(kind, M.vqvae_loss)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(1)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         scaler=scaler if amp else None,
                         factory=f"lucidrains_stack_models:{make}") if record else None
    # (the classifier's documents through a DataLoader and its padding collate_fn; the
    # empty rows are those of the last batch)
    docs = iter(DataLoader(M.Documents(8 * STEPS, empty={8 * (STEPS - 1) + r for r in empty}),
                           batch_size=8, collate_fn=M.pad_collate))
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None and crit is not None else crit
        for step in range(STEPS):
            last = step == STEPS - 1
            opt.zero_grad()
            with torch.autocast("cpu", dtype=half, enabled=amp or kind == "sphere"):
                if kind == "lm":
                    loss = model(M.token_batch(g))  # (the wrapper's own cross-entropy)
                elif kind == "cls":
                    ids, mask, y = next(docs)
                    loss = loss_fn(model(ids, mask), y)
                else:
                    img = M.images(g)
                    if last and nan_row is not None:  # (a corrupt file's decoded pixel)
                        img[nan_row, 0, 2, 3] = float("nan")
                    loss = loss_fn(*model(img), img)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
    return model


def fire(kind: str, make: str, tmp_path, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(kind, make, tmp_path, **kw)
    return info.value.event, info.value.bundle_path


def test_float16_attention_logits_of_grown_query_key_weights_overflow_in_the_einsum(tmp_path):
    """A checkpoint whose query and key projections grew, fine-tuned under float16 autocast:
    x-transformers' ``einsum('b h i d, b h j d -> b h i j', q, k)`` (a bmm) overflows float16
    in the first batch, and the softmax makes NaN. Of sequences 0, 2, 3 and 6, whose scores
    hold an infinity, only sequence 3's is at a position the causal mask keeps (the others'
    are future positions, filled before the softmax). The replay names the bmm in the first
    layer's ``attend``, overflow, sample 3, and (the softmax next in the chain) attention
    scores with x-transformers' own fix, QK-norm."""
    ev, bundle = fire("lm", "make_grown_lm", tmp_path)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (
        0, "forward", "net.attn_layers.layers.0.1.attend", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "net.attn_layers.layers.0.1.attend", "aten.bmm", "+inf", [3]), o
    assert o["source"].endswith("x_transformers/attend.py:552"), o
    assert rep["cause"] == "overflow", rep["cause"]
    hint = rep["hint"]
    assert "beyond float16's largest value" in hint, hint
    assert "attention scores" in hint and "attn_qk_norm=True" in hint, hint


def test_learning_rate_range_test_blows_up_the_weights_until_float16_overflows(tmp_path):
    """An LR range test (the learning rate multiplied by 10 each step from 1e-2, as users run
    one to pick the peak rate) under float16 autocast: by step 4 the weights have grown, the
    first layer's attention scores overflow float16. The replay names the bmm and overflow,
    and says the learning rate had jumped at step 2, that the run was diverging (a wider type
    only postpones it), with AdamW's decay factor 1 - lr * wd gone below -1."""
    model = M.make_lm()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sweep = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 10.0 ** s)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=tmp_path, scaler=scaler,
                            factory="lucidrains_stack_models:make_lm"):
            for _ in range(8):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(M.token_batch(g))
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
                sweep.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (
        4, "forward", "net.attn_layers.layers.0.1.attend"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "net.attn_layers.layers.0.1.attend", "aten.bmm", "+inf", list(range(8))), o
    assert rep["cause"] == "overflow", rep["cause"]
    hint = rep["hint"]
    assert "the learning rate had jumped at step 2" in hint and "diverging" in hint, hint
    assert "1 - lr * weight_decay" in hint, hint
    assert any(p["step"] == 2 and p["kind"] == "lr_jump" for p in rep["precursors"]), \
        rep["precursors"]


def test_padding_only_micro_batch_in_the_wrappers_own_loss_names_the_padded_batch(tmp_path):
    """Gradient accumulation over two micro-batches cut from a padded stream; the wrapper
    told ``ignore_index=PAD`` averages its cross-entropy over the targets that are not padding
    (``loss.sum() / valid.sum()``, inside ``model(seq)``). Step 1's second micro-batch is
    padding throughout: 0/0 in the model's own loss, no sample to blame. The replay names the
    division on the wrapper's loss line and the micro-batch that is 0 everywhere, with the
    advice to skip it."""
    model = M.make_lm_padded()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=tmp_path,
                            factory="lucidrains_stack_models:make_lm_padded"):
            for step in range(3):
                opt.zero_grad()
                for micro in range(2):
                    blank = step == 1 and micro == 1
                    seq = M.token_batch(g, n=4, lengths=[0 if blank else 17] * 4)
                    (model(seq) / 2).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["micro_batch"], ev["phase"], ev["module"], ev["samples"]) == (
        1, 1, "forward", "", []), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], o["micro_batch"], o["module"], o["op"], o["made"], o["samples"]) \
        == (True, 1, "", "aten.div", "nan", []), o
    assert o["source"].endswith("x_transformers/autoregressive_wrapper.py:676"), o
    assert rep["cause"] == "invalid", rep["cause"]
    hint = rep["hint"]
    assert "0 everywhere in micro-batch 1 of the step, in every sample: it is padding " \
        "throughout" in hint and "skip a micro-batch with no target" in hint, hint


def test_attention_z_loss_of_a_left_padded_row_overflows_the_mask_fill(tmp_path):
    """``add_attn_z_loss=True`` with the padding mask passed as ``mask=``: sequences 2 and 5
    of the last batch are left-padded, so under the causal mask their first queries see no
    valid key. x-transformers fills masked scores with -finfo(float32).max, the logsumexp of
    such a row is that fill, and ``calc_z_loss`` sums the two layers' (then squares): -inf.
    The replay names the add on that line and rows 2 and 5, and says the number is the type's
    edge written as a mask fill by a fully masked row, not iterates that diverged."""
    model = M.make_lm_z_loss()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=tmp_path,
                            factory="lucidrains_stack_models:make_lm_z_loss"):
            for step in range(STEPS):
                opt.zero_grad()
                seq = M.token_batch(g)
                if step == STEPS - 1:  # (left padding, as a batch for generation is padded)
                    seq[2, :5] = M.PAD
                    seq[5, :3] = M.PAD
                loss = model(seq, mask=seq != M.PAD)
                loss.backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (2, "forward", "net", "+inf"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "net", "aten.add", "-inf", [2, 5]), o
    assert o["source"].endswith("x_transformers/x_transformers.py:295"), o
    assert rep["cause"] == "overflow", rep["cause"]
    hint = rep["hint"]
    assert "the largest finite value of its type itself" in hint and "mask's fill" in hint, hint
    assert "add_attn_z_loss=True" in hint and "diverging" not in hint, hint


def test_empty_text_in_the_masked_mean_pooling_is_0_by_0_on_its_row(tmp_path):
    """The tokenizer's cleaning left document 3 of the last batch empty: its padding mask is
    all False. x-transformers' attention copes with the fully masked row (it zeroes it), the
    hand-written ``masked_mean`` divides its zero sum by its zero count. The replay names the
    division on that line, sample 3, and the empty record."""
    ev, bundle = fire("cls", "make_classifier", tmp_path, empty=[3])
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"], ev["samples"]) == (
        2, "forward", "", "nan", [3]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "", "aten.div", "nan", [3]), o
    assert o["source"] == line_of("return t.sum(dim=dim) / mask.sum(dim=dim)[..., None]"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "empty records" in rep["hint"] and "clamp_min(1)" in rep["hint"], rep["hint"]


def test_codebook_without_laplace_smoothing_divides_an_empty_clusters_sum_by_0_in_forward(
        tmp_path):
    """``VectorQuantize(eps=0, kmeans_init=True)`` with a codebook larger than the first
    batch's 128 vectors: k-means leaves clusters empty, and the EMA update inside the
    quantiser's forward (``embed_avg / cluster_size``, written into the ``embed`` buffer in
    place, no optimizer involved) is 0/0 at step 0. The replay names the division in
    ``vq._codebook``, the user's line that called the quantiser, and says which buffers the
    forward wrote and that the count is 0 there, not a parametrisation."""
    ev, bundle = fire("vq", "make_vqvae_no_eps", tmp_path)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (
        0, "forward", "vq._codebook", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"]) == (
        True, "vq._codebook", "aten.div", "nan"), o
    assert o["source"].endswith("vector_quantize_pytorch/vector_quantize_pytorch.py:602"), o
    assert o["called_from"] == line_of("quantized, indices, commit_loss = self.vq(z)"), o
    assert rep["cause"] == "invalid", rep["cause"]
    hint = rep["hint"]
    assert "0 by 0" in hint and "vq._codebook.cluster_size" in hint, hint
    assert "parametrisation" not in hint, hint


def test_pairwise_latent_distance_as_sqrt_is_nan_in_backward_only(tmp_path):
    """The user's spread term ``(p[:, None] - p[None]).pow(2).sum(-1).sqrt()`` is 0 on the
    diagonal: the forward is finite, sqrt's derivative there is inf, and the pow's backward
    makes NaN. The replay names SqrtBackward0 on that line and the vector_norm advice."""
    ev, bundle = fire("vq", "make_vqvae_distance", tmp_path)
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "backward", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["module"], o["op"], o["made"]) == (
        True, "backward", "", "SqrtBackward0", "-inf"), o
    assert o["source"] == line_of("dist = (pooled[:, None] - pooled[None]).pow(2)"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "vector_norm" in rep["hint"], rep["hint"]


def test_lfq_usage_entropy_without_a_floor_is_log_of_an_underflowed_probability(tmp_path):
    """The usage entropy ``-(p * p.log())`` over ``softmax(2 x . c * 100)``: the far codes'
    probabilities underflow float32 to 0, log makes -inf and ``0 * -inf`` NaN. The replay
    names the log (not the mul) and underflow with the log-space advice."""
    ev, bundle = fire("lfq", "make_lfq", tmp_path)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "forward", "", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"]) == (
        True, "", "aten.log", "-inf"), o
    assert o["source"] == line_of("return -(p * p.log()).sum(-1)"), o
    assert rep["cause"] == "underflow", rep["cause"]
    assert "clamp_min(eps)" in rep["hint"], rep["hint"]


def test_spherical_distance_under_bfloat16_is_a_sqrt_of_a_rounded_negative(tmp_path):
    """A cosine-similarity codebook, k-means initialised, and the user's ``sqrt(2 - 2 cos)``
    to each vector's code, under bfloat16 autocast (no GradScaler): the encoder's bfloat16
    output normalised in bfloat16 has a cosine above 1 with its own code, so the sqrt takes a
    negative number in every image. The replay names the sqrt on that line, precision (float64
    is at the edge, not past it), and the bfloat16 ops before it."""
    ev, bundle = fire("sphere", "make_vqvae_spherical", tmp_path)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "forward", "", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "", "aten.sqrt", "nan", list(range(8))), o
    assert o["source"] == line_of("dist = (2 - 2 * cos).sqrt()"), o
    assert rep["cause"] == "precision", rep["cause"]
    assert "ops before it computed in bfloat16" in rep["hint"], rep["hint"]


def test_nan_pixel_of_a_corrupt_image_is_an_input_event_on_its_row(tmp_path):
    ev, bundle = fire("vq", "make_vqvae", tmp_path, nan_row=5)
    assert (ev["step"], ev["phase"], ev["kind"], ev["samples"]) == (2, "input", "nan", [5]), ev
    rep = nanreplay_json(bundle)
    assert (rep["reproduced"], rep["origin"]["samples"], rep["cause"]) == (True, [5], "input")


@pytest.mark.parametrize(("kind", "make"), [
    ("lm", "make_grown_lm_qk_norm"), ("cls", "make_classifier_clamped"), ("vq", "make_vqvae"),
    ("lfq", "make_lfq_floored")])
def test_healthy_runs_raise_nothing_and_train_bit_identically(tmp_path, kind, make):
    """With the fixes (``attn_qk_norm``, the clamped count, the codebook's default eps, the
    floored entropy) the same data raises no event, the codebooks the forward updates in place
    included, and every parameter and buffer matches an unrecorded run's bit for bit."""
    kw = {"empty": [3]} if kind == "cls" else {}
    recorded = train(kind, make, tmp_path, **kw)
    plain = train(kind, make, tmp_path, record=False, **kw)
    assert not list(tmp_path.glob("*.nan"))
    a, b = recorded.state_dict(), plain.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name

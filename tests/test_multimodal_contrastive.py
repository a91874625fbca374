"""End to end on image-text contrastive training (``multimodal_contrastive_models``): a ViT or
CNN image tower and a masked text transformer pooled at EOS, OpenCLIP's symmetric
cross-entropy (with duplicate captions masked out of the negatives by ``-inf``) and SigLIP's
sigmoid loss with a learned bias, a hand-written InfoNCE under fp16 autocast and a GradScaler,
trained by AdamW with OpenCLIP's parameter groups, its warmup and cosine schedule, gradient
clipping and ``logit_scale`` clamped to log(100). Each planted
failure of the domain fires under the recorder and is replayed with the CLI; the healthy runs
raise no event and train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib
import math

import multimodal_contrastive_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("multimodal_contrastive_models.py", text)


def cosine_lr(opt, base_lr: float, warmup: int, total: int):
    """OpenCLIP's ``cosine_lr``: called with the step before each update, it sets every
    group's lr (linear warmup, then a cosine decay to 0)."""
    def adjust(step: int) -> None:
        if step < warmup:
            lr = base_lr * (step + 1) / warmup
        else:
            lr = 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup))) * base_lr
        for group in opt.param_groups:
            group["lr"] = lr
    return adjust


def optimizer(model):
    """OpenCLIP's groups: no weight decay on gains, biases and the temperature."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.2},
                              {"params": rest, "weight_decay": 0.0}],
                             lr=3e-3, betas=(0.9, 0.98), eps=1e-6)


def train(make: str, loss, out_dir, plant=None, steps: int = 3, record: bool = True,
          distinct: bool = True, amp: torch.dtype | None = None, resume: float | None = None):
    """``plant(images, text)`` edits the last step's batch in place; ``amp``: autocast to that
    dtype, with a GradScaler for float16; ``resume``: the checkpoint's ``logit_scale``, from a
    run that never clamped it (nor does this one then). Returns the model."""
    model = getattr(M, make)()
    if resume is not None:
        with torch.no_grad():
            model.logit_scale.fill_(resume)
    opt = optimizer(model)
    scheduler = cosine_lr(opt, 3e-3, 2, steps)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 13, enabled=amp == torch.float16)
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=loss, out_dir=out_dir, scaler=scaler,
                         factory=f"multimodal_contrastive_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else loss
        for step in range(steps):
            images, text, ids = M.pairs(g, distinct=distinct)
            if plant is not None and step == steps - 1:
                plant(images, text)
            scheduler(step)
            with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
                out = model(images, text)
                total = loss_fn(*out, ids)
            opt.zero_grad()
            scaler.scale(total).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            if resume is None:
                with torch.no_grad():
                    model.logit_scale.clamp_(0, math.log(100))
    return model


def fire(make: str, loss, tmp_path, plant):
    with pytest.raises(NonFiniteError) as info:
        train(make, loss, tmp_path, plant)
    return info.value.event, info.value.bundle_path


def empty_caption(row: int):
    def plant(images, text):
        text[row] = M.PAD  # a caption the tokenizer dropped, collated as padding only
    return plant


def black_image(row: int):
    def plant(images, text):
        images[row] = 0.0  # a decode failure the loader replaced with zeros
    return plant


def test_empty_caption_names_the_fully_masked_attention_softmax_and_its_record(tmp_path):
    """A caption the tokenizer dropped, collated as padding only: the padding mask combined
    with the causal one leaves its every query without a key, the eager attention's softmax
    over ``-inf`` only is 0/0, and EOS pooling (``argmax`` of all-0 ids) takes position 0's
    NaN into the text embedding. The event and the replay name the first block's attention,
    the softmax on its line, step 2 and record 5 only, and say to keep a key per row;
    dropping the record makes the step finite."""
    ev, bundle = fire("make_clip", M.ClipLoss(), tmp_path, empty_caption(5))
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"], ev["kind"]) == (
        2, "forward", "transformer.blocks.0.attn", [5], "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["samples"]) == (
        True, "transformer.blocks.0.attn", "aten._softmax", [5]), o
    assert o["source"] == line_of("attn = scores.softmax(dim=-1)"), o
    assert [c["op"] for c in o["chain"]] == ["aten.masked_fill", "aten._softmax"], o["chain"]
    assert rep["cause"] == "invalid" and "fully masked row" in rep["hint"], rep["hint"]
    assert "keep at least one key per row" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_black_image_names_the_hand_written_normalisation_without_its_matrix_advice(tmp_path):
    """A decode failure the loader replaced with a black image: the bias-free conv tower
    (ReLU, mean pool, linear projection without bias) maps it to an all-0 embedding, and
    ``x / x.norm()`` written without eps is 0/0 on that record. The replay names the division
    in the root's ``encode_image``, record 3, invalid with the eps advice, and not a
    'transition matrix estimated from counts' (the 0 row is the projection's input, the
    sample's own activations)."""
    ev, bundle = fire("make_clip_cnn", M.ClipLoss(), tmp_path, black_image(3))
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"], ev["kind"]) == (
        2, "forward", "", [3], "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=3")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["samples"]) == (
        True, "", "aten.div", [3]), o
    assert o["source"] == line_of("return x / x.norm(dim=-1, keepdim=True)"), o  # (image's)
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert "add an eps to the denominator" in rep["hint"], rep["hint"]
    assert "matrix" not in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_duplicate_captions_masked_out_of_the_negatives_raise_nothing_and_train_the_same(
        tmp_path):
    """Classes drawn with repeats, so captions repeat within a batch: their other pairs are
    masked out of each row's negatives with ``-inf`` (the positive stays finite, so no row is
    fully masked), in both directions of the loss. No event, and the weights are
    bit-identical with and without the recorder."""
    _, _, ids = M.pairs(torch.Generator().manual_seed(0), distinct=False)
    assert len(set(ids.tolist())) < len(ids), ids  # (the first batch repeats a caption)
    loss = M.ClipLoss(mask_duplicates=True)
    recorded = train("make_clip", loss, tmp_path, distinct=False)
    plain = train("make_clip", loss, tmp_path, distinct=False, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_fp16_hand_written_infonce_names_the_exp_of_half_logits_at_scale_100(tmp_path):
    """Fine-tuning from a checkpoint whose temperature sits at the clamp (100) with a
    hand-written InfoNCE, ``exp(logits)`` over the rows, under fp16 autocast: the logits are a
    matmul's, so half, and ``exp`` of anything past 11.09 (a cosine above 0.11) overflows; the
    loss is inf / inf. A loss event at step 0; the replay names the exp on its line in float16
    and says to compute it in float32 or rescale (the exact result is finite)."""
    with pytest.raises(NonFiniteError) as info:
        train("make_clip_finetune", M.InfoNCE(), tmp_path, amp=torch.float16)
    ev, bundle = info.value.event, info.value.bundle_path
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["op"], o["made"], o["dtype"]) == (
        True, "loss", "aten.exp", "+inf", "float16"), o
    assert o["source"] == line_of("sim = torch.exp(logits)"), o
    assert rep["cause"] == "overflow" and "beyond float16's largest value" in rep["hint"], rep
    assert "compute this op in float32" in rep["hint"], rep["hint"]


def test_fp16_infonce_computed_in_float32_raises_nothing_and_trains_the_same(tmp_path):
    """The hint's fix: the same fine-tuning with the logits cast to float32 before ``exp``.
    No event, though the GradScaler skips the first and last steps (their scaled half
    gradients overflow) and updates the second; bit-identical weights with and without the
    recorder, and not those of the checkpoint."""
    recorded = train("make_clip_finetune", M.InfoNCE(fp32=True), tmp_path, amp=torch.float16)
    plain = train("make_clip_finetune", M.InfoNCE(fp32=True), tmp_path, amp=torch.float16,
                  record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name
    start = M.make_clip_finetune().transformer.text_projection
    assert not torch.equal(plain.transformer.text_projection, start)


@pytest.mark.parametrize("make,loss", [("make_siglip", M.SigLipLoss()),
                                       ("make_clip_cnn", M.ClipLoss(mask_duplicates=True))])
def test_bf16_siglip_and_clip_raise_nothing_and_train_the_same(tmp_path, make, loss):
    """SigLIP's sigmoid loss (learned bias at -10, labels ``2 * eye - 1``) and the CNN CLIP
    with duplicate captions masked by ``-inf``, both under bf16 autocast: no event, and
    bit-identical weights with and without the recorder."""
    recorded = train(make, loss, tmp_path, distinct=False, amp=torch.bfloat16)
    plain = train(make, loss, tmp_path, distinct=False, amp=torch.bfloat16, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_resumed_unclamped_logit_scale_names_the_exp_and_the_parameter_to_bound(tmp_path):
    """Resuming a run that never clamped the temperature, whose ``logit_scale`` had drifted
    to 89: OpenCLIP's forward returns ``logit_scale.exp()``, e^89 is past float32's largest
    value, and the model's output holds +inf (every logit then inf or NaN). A forward event
    at step 0 in the root; the replay names the exp on its line, overflow, and the parameter
    with the bound to put on it."""
    with pytest.raises(NonFiniteError) as info:
        train("make_clip", M.ClipLoss(), tmp_path, resume=89.0)
    ev, bundle = info.value.event, info.value.bundle_path
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "forward", "", "+inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["input_range"]) == (
        True, "", "aten.exp", [89.0, 89.0]), o
    assert o["source"] == line_of("self.logit_scale.exp())"), o
    assert rep["cause"] == "overflow", rep["cause"]
    assert "the parameter logit_scale (89)" in rep["hint"], rep["hint"]
    assert "logit_scale.clamp(max=...)" in rep["hint"], rep["hint"]


def test_empty_caption_through_torch_attention_raises_nothing_and_trains_the_same(tmp_path):
    """The same empty caption through ``nn.MultiheadAttention`` (``need_weights=False``,
    ``key_padding_mask``): PyTorch's scaled-dot-product kernel gives a query without keys 0,
    not NaN, so the run stays finite (checked without the recorder too): no event, and
    bit-identical weights with and without the recorder."""
    recorded = train("make_clip_mha", M.ClipLoss(), tmp_path, empty_caption(2))
    plain = train("make_clip_mha", M.ClipLoss(), tmp_path, empty_caption(2), record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.isfinite(b).all() and torch.equal(a, b), name


def test_negclip_empty_hard_negative_caption_names_its_row_of_the_text_input(tmp_path):
    """NegCLIP: each step's text batch is the 8 captions then their 8 word-swapped hard
    negatives, 16 rows beside 8 images. One hard negative collated empty (row 11) makes its
    attention rows 0/0; the NaN is in no image's row, so no sample is named, and the replay
    names row 11 of the text input (``args[1]``) as where it comes from, with the softmax on
    its line and the fully masked row's advice."""
    model, loss = M.make_clip(), M.NegClipLoss()
    opt = optimizer(model)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=loss, out_dir=tmp_path,
                            factory="multimodal_contrastive_models:make_clip") as rec:
            for step in range(3):
                images, text, ids = M.pairs(g)
                text = torch.cat([text, M.hard_negatives(text, g)])
                if step == 2:
                    text[11] = M.PAD
                opt.zero_grad()
                rec.loss_fn(*model(images, text), ids).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["module"], ev["samples"]) == (2, "transformer.blocks.0.attn", []), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], o["input_rows"]) == (
        "transformer.blocks.0.attn", "aten._softmax", [], {"tensor": "args[1]", "rows": [11]}), o
    assert o["source"] == line_of("attn = scores.softmax(dim=-1)"), o
    assert any("rows [11] of args[1] are where it comes from" in p for p in rep["problems"])
    assert rep["cause"] == "invalid" and "fully masked row" in rep["hint"], rep["hint"]


def left_padded(images, text):
    for row in text:  # a decoder LM's tokenizer (padding_side="left") fed to the text tower
        n = int((row != M.PAD).sum())
        row[:] = torch.cat([row[n:], row[:n]])


def test_left_padded_captions_under_a_causal_padding_mask_name_every_padded_record(tmp_path):
    """Captions padded on the left under the causal mask combined with the padding one: each
    pad query attends only earlier pads, none allowed, so its softmax row is 0/0 in every
    caption shorter than the context (all 8 here), though EOS pooling reads a real token. The
    replay names the softmax in the first block, every record, and the fully masked row."""
    ev, bundle = fire("make_clip", M.ClipLoss(), tmp_path, left_padded)
    assert (ev["step"], ev["module"], ev["samples"]) == (
        2, "transformer.blocks.0.attn", list(range(8))), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["all_samples"], o["batch_size"]) == (
        "transformer.blocks.0.attn", "aten._softmax", True, 8), o
    assert o["source"] == line_of("attn = scores.softmax(dim=-1)"), o
    assert rep["cause"] == "invalid" and "fully masked row" in rep["hint"], rep["hint"]

"""End to end on DETR-style set prediction (``set_prediction_models``): object queries through
a transformer decoder, Hungarian matching of the predictions to each image's targets,
DETR's losses over the matched pairs with auxiliary losses from every decoder layer, images of
different sizes padded into a batch with their padding mask passed into ``forward``, images
without objects, AdamW with a lower backbone learning rate and gradient clipping at 0.1. Each
planted bug of the domain fires under the recorder and is replayed with the CLI; the healthy
run raises no event and trains bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import pytest
import set_prediction_models as M
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("set_prediction_models.py", text)


def train(ds, crit, out_dir, collate=M.collate_fn, steps: int = 6, record: bool = True,
          make: str = "make_detr", accum: int = 1, bf16: bool = False):
    """DETR's main.py loop, small: AdamW (backbone at a tenth of the learning rate), gradient
    clipping at 0.1, a step schedule; ``accum`` batches per update, ``bf16`` the forward under
    autocast (detrex's AMP). Returns the model."""
    model = getattr(M, make)()
    opt = torch.optim.AdamW(M.param_groups(model), lr=1e-4, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, 200)
    torch.manual_seed(1)  # (the transformer's dropout)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"set_prediction_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for i, (images, mask, targets) in enumerate(M.loader(ds, collate=collate)):
            if i == steps * accum:
                break
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = loss_fn(model(images, mask), targets) / accum
            loss.backward()
            if (i + 1) % accum == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
                opt.step()
                sched.step()
                opt.zero_grad()
    return model


def fire(ds, crit, tmp_path, collate=M.collate_fn):
    with pytest.raises(NonFiniteError) as info:
        train(ds, crit, tmp_path, collate)
    return info.value.event, info.value.bundle_path


def test_healthy_detr_with_padding_and_empty_images_raises_nothing_and_trains_the_same(
        tmp_path):
    """Padding masks in every batch (the -inf of ``key_padding_mask`` stays inside each
    attention's softmax), images without objects (the matcher's empty matches, the
    no-object class weighted by eos_coef), num_boxes clamped to 1: no event, and the weights
    are bit-identical with and without the recorder."""
    ds = M.Shapes(empty=(1, 5, 9))
    recorded = train(ds, M.SetCriterion(), tmp_path)
    plain = train(ds, M.SetCriterion(), tmp_path, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_healthy_bf16_detr_with_accumulation_raises_nothing_and_trains_the_same(tmp_path):
    """The same under bf16 autocast, two batches accumulated per update: the attention's
    -inf padding fill in bfloat16 and the matcher's float32 costs of bfloat16 boxes raise no
    event, and the recorder changes nothing the run computes."""
    ds = M.Shapes(empty=(1, 5, 9))
    recorded = train(ds, M.SetCriterion(), tmp_path, steps=3, accum=2, bf16=True)
    plain = train(ds, M.SetCriterion(), tmp_path, steps=3, accum=2, bf16=True, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_unclamped_num_boxes_of_a_batch_without_objects_is_a_count_read_by_item(tmp_path):
    """DETR's ``num_boxes`` without its ``torch.clamp(num_boxes, min=1)``, read by ``.item()``
    as DETR reads it, and a batch (images 8-11) with no object: the L1 sum over no matched
    pair is 0, divided by the Python number 0. The hint called that number a setting ('a drop
    probability of 1, a temperature annealed to 0'); the replay now sees that ``.item()``
    read it from a tensor of the step, blames no image, and says to clamp the count."""
    ev, bundle = fire(M.Shapes(empty=(1, 8, 9, 10, 11)), M.SetCriterion(clamp_num_boxes=False),
                      tmp_path)
    assert (ev["step"], ev["phase"], ev["kind"]) == (2, "loss", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "<loss>", "aten.div", "nan", []), o
    assert o["source"] == line_of("return loss_bbox.sum() / num_boxes, loss_giou.sum()"), o
    assert rep["cause"] == "invalid", rep["hint"]
    assert ".item() read from a tensor" in rep["hint"], rep["hint"]
    assert "clamp_min(1)" in rep["hint"] and "temperature" not in rep["hint"], rep["hint"]


def test_a_per_image_mean_over_an_image_without_objects_names_that_image(tmp_path):
    """Box losses averaged per image, then over the images (a common rewrite of DETR's
    num_boxes normalisation): image 1 has no object, and the mean of its empty set of matched
    pairs is 0/0. The replay names the mean, its line, image 1 alone, step 0; dropping image 1
    (and its target dict) makes the step finite, dropping image 0 does not."""
    ev, bundle = fire(M.Shapes(empty=(1, 9)), M.SetCriterion(per_image=True), tmp_path)
    assert (ev["step"], ev["phase"]) == (0, "loss"), ev
    rep = nanreplay_json(bundle, "--try", "drop=1", "--try", "drop=0")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "<loss>", "aten.mean", "nan", [1]), o
    assert o["source"] == line_of('l1.append(F.l1_loss(src_b, tgt_b, reduction="none")'), o
    assert rep["cause"] == "invalid" and "empty" in rep["hint"], rep["hint"]
    # (the image goes with its target dict: the step is finite without image 1 only)
    assert [(w["try"], w["finite"]) for w in rep["what_if"]] == [
        ("drop=1", True), ("drop=0", False)], rep["what_if"]


def test_eos_coef_zero_and_a_batch_without_objects_has_no_target_weight(tmp_path):
    """``eos_coef=0`` (the no-object class ignored) and a batch whose every query is matched
    to no-object: the class weight vector gives the weighted cross-entropy a total weight of
    0, and its mean is 0/0. The replay names nll_loss2d in the loss, on the cross-entropy's
    line, and says the targets are all of the class whose weight is 0."""
    ev, bundle = fire(M.Shapes(empty=(1, 8, 9, 10, 11)), M.SetCriterion(eos_coef=0.0), tmp_path)
    assert (ev["step"], ev["phase"]) == (2, "loss"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    # (a total target weight of 0: the whole batch, "all 4 rows", as an ignored one)
    assert (o["module"], o["op"], o["made"], o["samples"], o["all_samples"]) == (
        "<loss>", "aten.nll_loss2d_forward", "nan", [0, 1, 2, 3], True), o
    assert o["source"] == line_of("return F.cross_entropy(logits.transpose(1, 2)"), o
    assert rep["cause"] == "invalid", rep["hint"]
    assert f"are all of class {M.CLASSES}, whose weight is 0" in rep["hint"], rep["hint"]


def unpadded_images(ds, step: int) -> list[int]:
    """The images of batch ``step`` whose feature map has no padding at all, by the
    backbone's own mask downsampling (the rows an inverted mask covers whole)."""
    images, mask, _ = list(M.loader(ds))[step]
    _, m = M.make_detr().backbone(images, mask)
    return torch.nonzero(~m.flatten(1).any(1)).flatten().tolist()


def test_a_pixel_mask_passed_as_the_padding_mask_covers_the_unpadded_images(tmp_path):
    """Hugging Face's ``pixel_mask`` (1 on the image) handed to DETR's own model, whose
    ``key_padding_mask`` is True on padding: an image with no padding is masked at every key,
    and the encoder's first self-attention softmax is NaN for exactly those images. The
    event and the replay name that attention, its softmax, and those images. The hint said
    to keep a key per row or fill with a finite number; it now names the argument that masked
    those images whole and says a mask of the keep convention must be inverted."""
    ds = M.Shapes()
    rows = unpadded_images(ds, 0)
    assert 0 < len(rows) < 4, rows
    ev, bundle = fire(ds, M.SetCriterion(), tmp_path, collate=M.hf_collate_fn)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        0, "forward", "encoder.0.self_attn", rows), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "encoder.0.self_attn", "aten._softmax", "nan", rows), o
    assert o["source"] == line_of("src2 = self.self_attn(q, k, value=src, key_padding_mask"), o
    assert rep["cause"] == "invalid" and "fully masked row" in rep["hint"], rep["hint"]
    assert f"key_padding_mask is True (masked) at every position of samples {rows}" \
        in rep["hint"] and "must be inverted" in rep["hint"], rep["hint"]


def padded_feature_rows(ds, step: int) -> list[int]:
    """The images of batch ``step`` with a feature-map row of padding only (a position
    embedding's 0 count of unpadded columns there)."""
    images, mask, _ = list(M.loader(ds))[step]
    _, m = M.make_detr().backbone(images, mask)
    return torch.nonzero(m.all(2).any(1)).flatten().tolist()


def test_a_position_embedding_without_its_eps_divides_a_padded_row_by_zero(tmp_path):
    """DETR's PositionEmbeddingSine normalises each position's count of unpadded columns by
    its row's total, plus eps = 1e-6; a rewrite with eps 0 divides 0 by 0 in every feature
    row of padding only. The model's own code (no submodule) makes the NaN: the event and the
    replay name the root, the division's line and the images with such a row. The hint said
    the divisor came from ``backbone.body.1.bias`` (a BatchNorm bias, 0 at init), 'all 0 as
    the step began: with random values in its place the call is finite': the trial read the
    model's dict of outputs as holding no tensor, so finite. It now says the eps is 0."""
    ds = M.Shapes()
    rows = padded_feature_rows(ds, 0)
    assert 0 < len(rows) < 4, rows
    with pytest.raises(NonFiniteError) as info:
        train(ds, M.SetCriterion(), tmp_path, make="make_detr_no_eps")
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (0, "forward", "", rows), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.div", "nan", rows), o
    assert o["source"] == line_of("x_embed = x_embed / (x_embed[:, :, -1:] + eps)"), o
    assert rep["cause"] == "invalid", rep["hint"]
    assert "0 by 0" in rep["hint"] and "exactly 0" in rep["hint"], rep["hint"]
    assert "bias" not in rep["hint"], rep["hint"]


def test_healthy_deformable_detr_raises_nothing_and_trains_the_same(tmp_path):
    """Deformable DETR's encoder: valid ratios of the padding mask, reference points
    normalised by them, the value map's padding filled with 0 and sampled by grid_sample
    (sampling points off the map read the zero padding): no event, bit-identical weights."""
    ds = M.Shapes(empty=(1, 5))
    recorded = train(ds, M.SetCriterion(), tmp_path, make="make_deformable_detr", steps=4)
    plain = train(ds, M.SetCriterion(), tmp_path, make="make_deformable_detr", steps=4,
                  record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_a_pixel_mask_given_to_deformable_detr_zeroes_the_valid_ratios(tmp_path):
    """The keep-convention pixel_mask again, into Deformable DETR: its valid ratios count
    the unpadded rows and columns as ``~mask`` on the first column and row, which the
    inverted mask makes 0 for every image with no padding along that side (each image of a
    batch is as tall or as wide as the batch). The reference points divide by them: +inf, then
    inf * 0 = NaN. The replay names the division on its line in the model's own code, and
    every image of the batch. The hint called the images degenerate records (the division's
    own rows, images 1 and 3, were some of the batch; the x division made the other two);
    rows widened to every image are the code's, as the op finder's own rule has it."""
    ds = M.Shapes()
    images, mask, _ = next(iter(M.loader(ds, collate=M.hf_collate_fn)))
    ratios = M.get_valid_ratio(M.make_detr().backbone(images, mask)[1])
    assert bool((ratios == 0).any(1).all()) and not bool((ratios == 0).all()), ratios
    with pytest.raises(NonFiniteError) as info:
        train(ds, M.SetCriterion(), tmp_path, collate=M.hf_collate_fn,
              make="make_deformable_detr")
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        0, "forward", "", [0, 1, 2, 3]), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["all_samples"]) == (
        "", "aten.div", "+inf", True), o
    assert o["source"] == line_of("ref_y = ref_y.reshape(-1)[None] / (valid_ratios"), o
    assert rep["cause"] == "invalid" and "by 0" in rep["hint"], rep["hint"]
    assert "degenerate" not in rep["hint"], rep["hint"]

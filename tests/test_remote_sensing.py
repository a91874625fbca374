"""End to end on remote sensing training (``remote_sensing_models``): a land-cover U-Net on
Sentinel-2 DN tiles (scaled to reflectance, NDVI/NDWI inside the model, per-band
normalisation), a cloud-masked per-pixel cross entropy, inverse-frequency class weights, a
Sentinel-1 flood mapper on dB backscatter and a Siamese change detector, trained with AdamW, a
cosine schedule, gradient clipping and random crops and flips. Each planted failure of the
domain fires under the recorder and is replayed with the CLI; the healthy versions raise no
event and train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import pytest
import remote_sensing_models as M
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

N = 6  # tiles per batch


def line_of(text: str) -> str:
    return source_line("remote_sensing_models.py", text)


def s2_batch(g, plant: str | None, bad: int):
    dn, labels, clear = M.s2_tile(g, N)
    if plant == "swath":
        M.outside_swath(dn, clear, bad)
    elif plant == "cloud":
        clear[bad] = 0  # QA60 says opaque cloud over the whole tile
    dn, labels, clear = M.random_flip_crop(g, dn, labels, clear)
    return (dn,), (labels, clear)


def reflectance_batch(g, plant: str | None, bad: int):
    """The dataset scales DN to reflectance; with ``unscaled`` tile ``bad`` comes from the
    tile cache, written before the scale was applied, and stays in DN (x 1e4)."""
    (dn,), targets = s2_batch(g, None, bad)
    refl = dn * 1e-4
    if plant == "unscaled":
        refl[bad] = dn[bad]
    return (refl,), targets


def s1_batch(g, plant: str | None, bad: int):
    sigma0, water = M.s1_tile(g, N)
    if plant == "zero":
        sigma0[bad, :, 3:5, 3:5] = 0.0  # border-noise removal zeroed these pixels
    elif plant == "fill":
        sigma0[bad, :, 4:10, 4:10] = 0.1  # the terrain correction's layover fill, a constant
    sigma0, water = M.random_flip_crop(g, sigma0, water)
    return (sigma0,), (water,)


def change_batch(g, plant: str | None, bad: int):
    dn1, _, _ = M.s2_tile(g, N)
    dn2, _, _ = M.s2_tile(g, N)
    change = (dn1[:, 3] - dn2[:, 3]).abs().gt(1500).long()
    dn1, dn2, change = M.random_flip_crop(g, dn1, dn2, change)
    return (dn1, dn2), (change,)


def scene_batch(g, plant: str | None, bad: int):
    """Tiles, their cloud masks (a forward argument) and one land-cover label per scene."""
    (dn,), (labels, clear) = s2_batch(g, plant, bad)
    return (dn, clear), (labels.flatten(1).mode(1).values,)


def cirrus_batch(g, plant: str | None, bad: int):
    (dn,), targets = s2_batch(g, plant, bad)
    return (M.with_cirrus(dn),), targets


def removal_batch(g, plant: str | None, bad: int):
    """Cloudy tiles and their SAR pairs; the target is the clear acquisition of the same
    place, which with ``swath`` lies partly outside its own swath (DN 0)."""
    dn, _, clear = M.s2_tile(g, N)
    target, _, _ = M.s2_tile(g, N)
    sigma0, _ = M.s1_tile(g, N)
    if plant == "swath":
        M.outside_swath(target, clear, bad)
    dn, sigma0, target = M.random_flip_crop(g, dn, sigma0, target)
    return (dn, sigma0), (target,)


def sar_change_batch(g, plant: str | None, bad: int):
    """Two co-registered dates of Sentinel-1 cropped alike; with ``zero`` the first date's
    tile ``bad`` has pixels that border-noise removal zeroed. Change: |log-ratio| > 1."""
    t1, t2 = M.s1_tile(g, N)[0], M.s1_tile(g, N)[0]
    change = (t2 / t1).log().abs().gt(1).long()
    if plant == "zero":
        t1[bad, :, 3:5, 3:5] = 0.0
    t1, t2, change = M.random_flip_crop(g, t1, t2, change[:, 0])
    return (t1, t2), (change,)


KINDS = {"sar_change": sar_change_batch, "removal": removal_batch, "scene": scene_batch, "cirrus": cirrus_batch, "s2": s2_batch, "refl": reflectance_batch, "s1": s1_batch, "change": change_batch}


def make_loss(loss: str):
    if loss == "masked":
        return M.masked_ce
    if loss == "masked_guarded":
        return M.masked_ce_guarded
    if loss == "removal":
        return M.cloud_removal_loss
    if loss == "balanced":
        return M.batch_balanced_ce
    if loss == "weighted":
        g = torch.Generator().manual_seed(5)
        labels = torch.cat([M.s2_tile(g, 8)[1] for _ in range(4)])  # the training set's maps
        return M.CloudMaskedCE(M.inverse_frequency_weights(labels))
    return torch.nn.CrossEntropyLoss()


def train(kind: str, make: str, loss: str, out_dir, plant: str | None = None, bad: int = 2,
          steps: int = 4, record: bool = True, amp=False, accum: int = 1):
    """AdamW with a cosine schedule and gradient clipping (the torchgeo trainers' recipe),
    ``accum`` micro-batches a step, autocast to ``amp``'s dtype (True: float16); ``plant`` is
    applied to tile ``bad`` of the last step's batch. Returns the model."""
    model = getattr(M, make)()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    crit = make_loss(loss)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(1)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"remote_sensing_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step in range(steps):
            args, targets = KINDS[kind](g, plant if step == steps - 1 else None, bad)
            opt.zero_grad()
            for k in range(accum):  # (gradient accumulation over equal chunks of tiles)
                part = slice(k * N // accum, (k + 1) * N // accum)
                with torch.autocast("cpu", dtype=torch.float16 if amp is True else amp) \
                        if amp else contextlib.nullcontext():
                    out = model(*(a[part] for a in args))
                loss_v = loss_fn(out.float(), *(t[part] for t in targets)) / accum
                loss_v.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    return model


def fire(*args, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(*args, **kw)
    return info.value.event, info.value.bundle_path


def test_ndvi_over_nodata_pixels_names_the_division_and_the_tile(tmp_path):
    """A tile crossing the swath edge holds DN 0 in every band there: NDVI's
    ``(nir - red) / (nir + red)`` is 0/0 on those pixels. BatchNorm spreads the NaN to every
    tile's output, but the replay names the indices module's division, its line, tile 2
    alone, invalid math, and an eps or a skip of those values."""
    ev, bundle = fire("s2", "make_landcover", "masked_guarded", tmp_path, plant="swath")
    assert (ev["step"], ev["phase"], ev["module"], ev["call"], ev["kind"]) == (
        3, "forward", "indices", 0, "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=2")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "indices", "aten.div", "nan", [2]), o
    assert o["source"] == line_of("ndvi = (nir - red) / (nir + red)"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert "eps to the denominator" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_fully_clouded_tile_names_the_masked_mean_and_the_empty_mask(tmp_path):
    """QA60 flags a whole tile as cloud: its masked mean over valid pixels divides 0 by 0 in
    the loss. The replay names the division on its line, tile 2, and the cloud mask (the
    loss's third argument) as a mask with no valid position, to filter or floor."""
    ev, bundle = fire("s2", "make_landcover_guarded", "masked", tmp_path, plant="cloud")
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["op"], o["made"], o["samples"]) == ("loss", "aten.div", "nan", [2]), o
    assert o["source"] == line_of("per_tile = (ce * valid).sum((1, 2)) / valid.sum((1, 2))"), o
    assert rep["cause"] == "invalid", rep
    assert "loss_args[2]" in rep["hint"] and "no valid position" in rep["hint"], rep["hint"]
    assert "count.clamp_min(1)" in rep["hint"], rep["hint"]


def test_unrecorded_clouded_tile_makes_every_weight_nan(tmp_path):
    """Without the recorder the same step's NaN loss goes through clip_grad_norm_ into every
    weight: the event above is the bug, not a false alarm."""
    model = train("s2", "make_landcover_guarded", "masked", tmp_path, plant="cloud",
                  record=False)
    assert not any(torch.isfinite(p).any() for p in model.unet.head.parameters())


def test_inverse_frequency_weight_of_an_absent_class_names_the_loss_weight(tmp_path):
    """Built-up pixels are absent from the AOI: 1/0 = inf, and normalising the weights to sum
    to n_classes makes them 0 for the present classes and inf/inf = NaN for the absent one.
    The first step's loss is NaN; the replay blames the loss's ``ce.weight`` (index 3), made
    before the step, with the class-count fix."""
    ev, bundle = fire("s2", "make_landcover_guarded", "weighted", tmp_path)
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["op"], o["made"]) == ("loss", "aten.nll_loss2d_forward", "nan"), o
    assert rep["cause"] == "weights", rep
    assert "'ce.weight' holding nan at index 3" in rep["hint"], rep["hint"]
    assert "class absent" in rep["hint"] and "count.clamp_min(1)" in rep["hint"], rep["hint"]


def test_zero_backscatter_names_the_log10_and_the_nodata_record(tmp_path):
    """Border-noise removal zeroed four pixels of one Sentinel-1 tile: ``10 * log10(0)`` is
    -inf dB and the per-tile standardisation turns it into NaN (-inf - -inf). The replay
    names the log10 (not the subtraction after it) on its line, tile 2, the batch's own 0,
    and masking the nodata entries rather than an eps."""
    ev, bundle = fire("s1", "make_sar", "ce", tmp_path, plant="zero")
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (3, "forward", "", "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=2")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.log10", "-inf", [2]), o
    assert o["source"] == line_of("db = 10 * torch.log10(sigma0)"), o
    assert [c["op"] for c in o["chain"]] == ["aten.log10", "aten.sub"], o["chain"]
    assert rep["cause"] == "invalid" and "the batch's own data" in rep["hint"], rep["hint"]
    assert "nodata" in rep["hint"] and "mask its nodata entries" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_unscaled_tile_under_fp16_autocast_names_the_cast_and_the_out_of_scale_tile(tmp_path):
    """One tile comes from a cache written before the 1e-4 scale: normalised by the
    reflectance mean/std it reaches 1e5, past float16's 65504, where autocast casts the
    first conv's input. The replay names that cast in ``unet.enc1.0``, tile 2, overflow, and
    the tile as out of scale (a wrong unit) rather than float32 alone."""
    ev, bundle = fire("refl", "make_landcover_reflectance", "masked_guarded", tmp_path,
                      plant="unscaled", amp=True)
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "forward", "unet.enc1.0"), ev
    rep = nanreplay_json(bundle, "--try", "drop=2")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "unet.enc1.0", "aten._to_copy", "+inf", [2]), o
    assert rep["cause"] == "overflow" and "float16" in rep["hint"], rep["hint"]
    assert "out of scale" in rep["hint"] and "sample(s) 2" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_fully_clouded_scene_names_the_softmax_over_a_fully_masked_row(tmp_path):
    """Attention pooling over clear pixels: cloudy pixels' scores are -inf, which the softmax
    keeps inside for partly clouded tiles; for the fully clouded tile 2 every score is -inf
    and the softmax is NaN. The event and the replay name the softmax on its line, tile 2
    alone, and keeping one key per row or a finite mask value."""
    ev, bundle = fire("scene", "make_scene", "ce", tmp_path, plant="cloud")
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "", [2]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten._softmax", "nan", [2]), o
    assert o["source"] == line_of("a = s.softmax(1)"), o
    assert rep["cause"] == "invalid" and "every entry is -inf" in rep["hint"], rep["hint"]
    assert "keep at least one key per row" in rep["hint"], rep["hint"]


def test_zero_padded_cirrus_band_names_the_band_std_buffer(tmp_path):
    """B10 (cirrus) is missing from L2A and padded with zeros, so its std over the dataset
    is 0 and every tile's normalisation divides 0 by 0 from the first step. The replay names
    the division, every sample (no record to drop), and the ``std`` buffer's band 4 as a
    statistic of the data to floor or a feature to drop."""
    ev, bundle = fire("cirrus", "make_band_stats", "masked_guarded", tmp_path)
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "forward", ""), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["all_samples"]) == ("", "aten.div", "nan", True), o
    assert o["source"] == line_of("x = (self.indices(refl) - self.mean) / self.std"), o
    assert rep["cause"] == "invalid", rep
    assert "the buffer std" in rep["hint"] and "(0, 4, 0, 0)" in rep["hint"], rep["hint"]
    assert "no rows to drop" in rep["hint"] and "std.clamp_min(eps)" in rep["hint"], rep["hint"]


def test_lee_filter_variance_cancellation_names_the_sqrt_as_precision(tmp_path):
    """A constant patch (the terrain correction's layover fill) makes the Lee filter's local
    variance ``E[x^2] - E[x]^2`` round to -9.3e-10 in float32: its sqrt is NaN. The replay
    names the sqrt in ``lee``, tile 2, the cause as precision (float64 has 0 there), and a
    stable variance or a clamp to the domain."""
    ev, bundle = fire("s1", "make_lee", "ce", tmp_path, plant="fill")
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (3, "forward", "lee", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("lee", "aten.sqrt", "nan", [2]), o
    assert o["source"] == line_of("ci = var.sqrt() / mean"), o
    assert rep["cause"] == "precision" and "catastrophic cancellation" in rep["hint"], rep
    assert "float64 has 0 there" in rep["hint"] and "clamp" in rep["hint"], rep["hint"]


def test_ndvi_consistency_over_a_nodata_target_says_mask_it_out_of_the_loss(tmp_path):
    """Cloud removal with an NDVI consistency term, ``l1(ndvi(pred), ndvi(target))``: the
    clear reference acquisition of tile 2 is partly outside its swath, so the target's NDVI
    is 0/0 there. The replay names the division on the target in the loss, tile 2, and,
    since the loss compares it with the same ratio of the model's output, says to leave the
    nodata pixels out of the loss with a mask, not to drop the record as degenerate."""
    ev, bundle = fire("removal", "make_cloud_removal", "removal", tmp_path, plant="swath")
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["op"], o["made"], o["samples"]) == ("loss", "aten.div", "nan", [2]), o
    assert o["source"] == line_of("return (nir - red) / (nir + red)"), o
    assert rep["cause"] == "invalid" and "same op of the model's output" in rep["hint"], rep
    assert "nodata pixels" in rep["hint"] and "with a mask" in rep["hint"], rep["hint"]
    assert "degenerate" not in rep["hint"] and "made-up" not in rep["hint"], rep["hint"]


def test_clouded_tile_in_the_second_micro_batch_under_bf16_names_its_row(tmp_path):
    """Gradient accumulation over two micro-batches of three tiles under bfloat16 autocast:
    the fully clouded tile 4 is row 1 of micro-batch 1, which the event and the replay
    name, with the empty cloud mask."""
    ev, bundle = fire("s2", "make_landcover_guarded", "masked", tmp_path, plant="cloud", bad=4,
                      accum=2, amp=torch.bfloat16)
    assert (ev["step"], ev["phase"], ev["micro_batch"]) == (3, "loss", 1), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["micro_batch"], o["samples"], rep["cause"]) == (
        "aten.div", 1, [1], "invalid"), o
    assert "loss_args[2]" in rep["hint"] and "count.clamp_min(1)" in rep["hint"], rep["hint"]


def test_log_ratio_over_zeroed_backscatter_names_the_ratio_and_the_nodata_entries(tmp_path):
    """SAR change detection's log-ratio ``log(t2 / t1)`` where border-noise removal zeroed
    pixels of the first date: t2 / 0 = +inf before the log. The replay names the division
    in the root's forward, tile 2, the batch's own 0 in the divisor, and masking the nodata
    entries, not an eps."""
    ev, bundle = fire("sar_change", "make_log_ratio", "ce", tmp_path, plant="zero")
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "forward", ""), ev
    rep = nanreplay_json(bundle, "--try", "drop=2")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.div", "+inf", [2]), o
    assert o["source"] == line_of("return self.unet(torch.log(s1_t2 / s1_t1))"), o
    assert rep["cause"] == "invalid" and "its divisor is the batch's own data" in rep["hint"]
    assert "mask its nodata entries" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_batch_inverse_frequency_of_an_absent_class_names_the_reciprocal(tmp_path):
    """Class weights from the batch's own clear pixels: built-up is absent, its count is 0,
    ``1 / counts`` is +inf and the normalisation inf/inf. A loss event at the first step,
    named at the reciprocal on its line (no sample: the counts are per class). The hint
    named a pole to skip rows of; it now names the per-class count of the batch's labels
    and weights counted over the training set, smoothed or floored."""
    ev, bundle = fire("s2", "make_landcover_guarded", "balanced", tmp_path)
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["op"], o["made"], o["samples"]) == (
        "loss", "aten.reciprocal", "+inf", []), o
    assert o["source"] == line_of("w = 1.0 / counts"), o
    assert [c["op"] for c in o["chain"]] == ["aten.reciprocal", "aten.div"], o["chain"]
    assert rep["cause"] == "invalid", rep
    assert "a count per class (or bin) of the batch's labels" in rep["hint"], rep["hint"]
    assert "over the training set" in rep["hint"] and "counts.clamp_min(1)" in rep["hint"]
    assert "skip the rows" not in rep["hint"], rep["hint"]


@pytest.mark.parametrize("kind,make,loss,plant,amp", [
    ("sar_change", "make_log_ratio", "ce", None, False),
    ("removal", "make_cloud_removal", "removal", None, torch.bfloat16),
    ("s1", "make_lee_guarded", "ce", "fill", False),
    ("scene", "make_scene", "ce", None, False),
    ("scene", "make_scene_guarded", "ce", "cloud", False),
    ("s2", "make_landcover_guarded", "masked_guarded", "swath", False),
    ("s2", "make_landcover_guarded", "masked_guarded", "cloud", True),
    ("s1", "make_sar_guarded", "ce", "zero", False),
    ("change", "make_change", "ce", None, False),
    ("refl", "make_landcover_reflectance", "masked_guarded", None, True)])
def test_guarded_runs_raise_nothing_and_train_the_same(tmp_path, kind, make, loss, plant, amp):
    """The guarded code on the same data conditions (floored NDVI denominators over nodata,
    a count floored at 1 for a clouded tile, backscatter clamped at the noise floor, the Lee
    filter's variance clamped at 0, uniform attention for a fully clouded scene), -inf
    scores of cloudy pixels that the spatial softmax keeps inside, the Siamese change
    detector, cloud removal under bfloat16 and fp16 autocast on reflectances: no event, and
    bit-identical weights and BatchNorm statistics with and without the recorder."""
    recorded = train(kind, make, loss, tmp_path, plant=plant, amp=amp)
    plain = train(kind, make, loss, tmp_path, plant=plant, amp=amp, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name

"""End to end on hyperspectral unmixing (``hyperspectral_unmixing_models``): pixel autoencoders
whose decoder weight holds the endmembers, abundances from a softmax (or one written out) or
ReLU + sum-to-one, the spectral angle distance, the spectral information divergence, an L1/2
sparsity penalty, per-band standardisation, and a 3-D CNN over band x height x width patches
under bfloat16 autocast; Adam, gradient clipping, pixels from a shuffling DataLoader. Each
planted failure of the domain fires under the recorder and is replayed with the CLI; the
healthy version raises no event and trains bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import hyperspectral_unmixing_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

N = 8  # pixels (or patches) a batch
BAD = 2


def line_of(text: str) -> str:
    return source_line("hyperspectral_unmixing_models.py", text)


def pixel_batches(g, plant: str | None, steps: int):
    """The scene's pixels through a shuffling DataLoader; ``plant`` breaks pixel ``BAD`` of
    the last batch (or, for ``radiance``, gives every batch in radiance DN)."""
    x, _ = M.scene(g, N * steps)
    loader = M.DataLoader(M.TensorDataset(x), batch_size=N, shuffle=True)
    for step, (xb,) in enumerate(loader):
        if step == steps - 1 and plant == "dead":
            xb[BAD] = 0.0  # a dead pixel: the detector read nothing in any band
        elif step == steps - 1 and plant == "dn":
            xb[BAD] = xb[BAD] * 1e4  # a tile the loader never scaled to reflectance
        elif step == steps - 1 and plant == "percent":
            xb[BAD] = xb[BAD] * 100  # a scene delivered in percent reflectance
        elif step == steps - 1 and plant == "nodata":
            xb[BAD] = -9999.0  # ENVI's data ignore value outside the flight line
        if plant == "radiance":  # DN; the water bands read the dark-current level
            xb = xb * 1e4
            xb[:, M.WATER] = 1000.3 + 0.01 * torch.randn(N, len(M.WATER), generator=g)
        yield (xb,), (xb,)


def patch_batches(g, plant: str | None, steps: int):
    for step in range(steps):
        cube, labels = M.patches(g, N)
        if plant == "edge" and step == steps - 1:
            cube[BAD, :, :, :2] = float("nan")  # a patch past the scene's edge, NaN-filled
        yield (cube,), (labels,)


def train(make: str, loss, out_dir, plant: str | None = None, steps: int = 4,
          record: bool = True, amp=None, eps: float = 1e-8, patches: bool = False,
          accum: int = 1, guard: bool = False):
    """Adam with gradient clipping; ``amp``: autocast's dtype; ``accum`` equal micro-batches
    a step (gradient accumulation). Returns the model."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=eps)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(1)
    rec = FlightRecorder(model, opt, loss_fn=loss, out_dir=out_dir,
                         factory=f"hyperspectral_unmixing_models:{make}",
                         guard_optimizer=guard) if record else None
    batches = patch_batches if patches else pixel_batches
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else loss
        for args, targets in batches(g, plant, steps):
            opt.zero_grad()
            for k in range(accum):  # (the whole batch, the autoencoder's x itself, at 1)
                part = slice(k * N // accum, (k + 1) * N // accum)
                x, y = (args, targets) if accum == 1 else (
                    [a[part] for a in args], [t[part] for t in targets])
                with torch.autocast("cpu", dtype=amp) if amp else contextlib.nullcontext():
                    out = model(*x)
                (loss_fn(out, *y) / accum).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
    return model


def fire(*args, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(*args, **kw)
    return info.value.event, info.value.bundle_path


def test_healthy_unmixing_and_3d_cnn_train_bit_identically(tmp_path):
    """SAD + L1/2 + entropy on softmax abundances, the water bands masked out of the loss, and the
    3-D CNN under bfloat16 autocast: no event, and the same weights as without the recorder."""
    loss = M.UnmixingLoss(lam=0.01, mask=M.band_mask(), entropy=0.01)
    a = train("make_sharp_ae", loss, tmp_path / "a")
    b = train("make_sharp_ae", loss, tmp_path / "b", record=False)
    cnn_a = train("make_cnn3d", torch.nn.CrossEntropyLoss(), tmp_path / "c", amp=torch.bfloat16,
                  patches=True)
    cnn_b = train("make_cnn3d", torch.nn.CrossEntropyLoss(), tmp_path / "d", amp=torch.bfloat16,
                  patches=True, record=False)
    for x, y in ((a, b), (cnn_a, cnn_b)):
        for (name, p), q in zip(x.state_dict().items(), y.state_dict().values(), strict=True):
            assert torch.equal(p, q), name
    assert not any(tmp_path.rglob("*.nan"))


def test_dead_pixel_in_the_spectral_angle_names_the_division_and_the_blank_pixel(tmp_path):
    """An all-zero pixel has |x| = 0: the SAD's cosine is 0/0. The autoencoder's target is its
    own input, so the loss's data is a model input: the hint names it, as the blank record."""
    ev, bundle = fire("make_softmax_ae", M.sad_loss, tmp_path, plant="dead")
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["op"], o["made"], o["samples"]) == (
        True, "loss", "aten.div", "nan", [BAD]), o
    assert o["source"] == line_of(
        "cos = (x_hat * x).sum(-1) / (x_hat.norm(dim=-1) * x.norm(dim=-1))"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert "batch (also loss_args[1]) is 0 everywhere in sample(s) 2" in rep["hint"], \
        rep["hint"]
    assert "--try drop=2" in rep["hint"], rep["hint"]


def test_dead_pixel_through_relu_and_sum_to_one_names_the_asc_layer(tmp_path):
    """Without encoder biases a zero pixel gives zero pre-abundances: ReLU leaves 0 and the
    sum-to-one layer divides 0 by 0 on that pixel alone."""
    ev, bundle = fire("make_asc_ae", M.UnmixingLoss(), tmp_path, plant="dead")
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (
        3, "forward", "abundance", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == (
        "abundance", "aten.div", [BAD], "invalid"), rep
    assert o["source"] == line_of("return a / a.sum(1, keepdim=True)"), o
    assert "is 0 everywhere in sample(s) 2" in rep["hint"], rep["hint"]


def test_dead_pixel_in_an_accumulated_micro_batch_names_its_row_there(tmp_path, monkeypatch):
    """Two micro-batches of 4 pixels: the dead pixel 6 of the batch is row 2 of the second."""
    monkeypatch.setattr(__import__(__name__), "BAD", 6)
    ev, bundle = fire("make_asc_ae", M.UnmixingLoss(), tmp_path, plant="dead", accum=2)
    assert (ev["step"], ev["module"], ev["micro_batch"]) == (3, "abundance", 1), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["micro_batch"], o["samples"], rep["cause"]) == (
        "aten.div", 1, [2], "invalid"), rep
    assert "loss_args[1] is 0 everywhere in sample(s) 2" in rep["hint"], rep["hint"]


def test_endmember_left_zero_by_the_extraction_names_the_weight_slice(tmp_path):
    """Endmembers scaled to unit norm in the decoder's forward, one initialised to 0 (VCA
    found three of four): 0/0 in every pixel's reconstruction, at that weight column."""
    ev, bundle = fire("make_vca_ae", M.UnmixingLoss(), tmp_path)
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "forward", "decoder"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["samples"], rep["cause"]) == ("aten.div", list(range(N)), "invalid"), rep
    assert o["source"] == line_of("e = self.weight / self.weight.norm(dim=0, keepdim=True)"), o
    assert "decoder.weight is 0 in whole slices along dim 1 (3)" in rep["hint"], rep["hint"]


def test_band_standardisation_over_water_absorption_bands_names_the_zero_columns(tmp_path):
    """The water-absorption bands are 0 in every pixel: their std over the batch is 0 and
    per-band standardisation makes 0/0 in those columns of every pixel, at the first step."""
    ev, bundle = fire("make_band_norm_ae", M.UnmixingLoss(), tmp_path)
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "forward", "norm"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["samples"], rep["cause"]) == ("aten.div", list(range(N)), "invalid"), rep
    assert o["source"] == line_of("return (x - x.mean(0, keepdim=True)) / x.std(0, keepdim=True)")
    assert "column(s) 9, 10, 17 of batch hold 0 in every row" in rep["hint"], rep["hint"]


def test_spectral_information_divergence_over_zero_bands_names_the_log_and_xlogy(tmp_path):
    """SID's p * log(p / q) over the water bands: p = 0 there, log(0) = -inf, 0 * -inf = NaN."""
    ev, bundle = fire("make_softmax_ae", M.sid_loss, tmp_path)
    assert (ev["step"], ev["phase"]) == (0, "loss"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"], rep["cause"]) == (
        "aten.log", "-inf", list(range(N)), "invalid"), rep
    assert o["source"] == line_of("return (p * torch.log(p / q) + q * torch.log(q / p))"), o
    assert "xlogy" in rep["hint"], rep["hint"]


def test_l_half_sparsity_on_relu_abundances_names_the_sqrt_backward(tmp_path):
    """sum(sqrt(a)) on ReLU + ASC abundances: every pixel has an abundance of exactly 0, where
    sqrt's derivative is infinite; the forward is finite, the backward NaN."""
    ev, bundle = fire("make_relu_asc_ae", M.UnmixingLoss(lam=0.05), tmp_path)
    assert (ev["step"], ev["phase"]) == (0, "backward"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == (
        "backward", "<loss>", "SqrtBackward0", list(range(N)), "invalid"), rep
    assert o["source"] == line_of("loss = loss + self.lam * a.sqrt().sum(1).mean()"), o
    assert "sqrt(x + eps)" in rep["hint"], rep["hint"]


def test_unscaled_pixel_overflows_the_hand_written_softmax(tmp_path):
    """A pixel left in DN (x 1e4) drives exp(h / T) past float32: overflow, that pixel, the
    data out of scale, and torch.softmax for the hand-written one."""
    ev, bundle = fire("make_exp_ae", M.UnmixingLoss(), tmp_path, plant="dn")
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "forward", "abundance"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"], rep["cause"]) == (
        "aten.exp", "+inf", [BAD], "overflow"), rep
    assert o["source"] == line_of("e = torch.exp(h / self.temperature)"), o
    assert "torch.softmax" in rep["hint"] and "out of scale" in rep["hint"], rep["hint"]
    assert "fill code" not in rep["hint"], rep["hint"]


def test_nodata_pixel_is_named_as_a_fill_code(tmp_path):
    """A pixel outside the flight line holds -9999 in every band: the same overflow, and the
    hint says the record is one fill value, not a measurement."""
    ev, bundle = fire("make_exp_ae", M.UnmixingLoss(), tmp_path, plant="nodata")
    assert (ev["step"], ev["module"]) == (3, "abundance"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["samples"], rep["cause"]) == ("aten.exp", [BAD], "overflow"), rep
    assert "every entry of them is exactly -9999: a fill code" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("term", ["entropy", "l_half"])
def test_percent_pixel_underflows_the_sharpened_softmax(tmp_path, term):
    """A pixel in percent reflectance through softmax(h / 0.2): its minor abundances underflow
    to exactly 0 in float32 (positive in float64). The abundance entropy's log(a) is -inf in
    the loss; L1/2's sqrt(a) is finite but its derivative infinite, a backward NaN."""
    loss = M.UnmixingLoss(entropy=0.01) if term == "entropy" else M.UnmixingLoss(lam=0.01)
    ev, bundle = fire("make_sharp_ae", loss, tmp_path, plant="percent")
    assert (ev["step"], ev["phase"]) == (3, "loss" if term == "entropy" else "backward"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    op, text = (("aten.log", "loss = loss - self.entropy * (a * torch.log(a))")
                if term == "entropy" else
                ("SqrtBackward0", "loss = loss + self.lam * a.sqrt().sum(1).mean()"))
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == (
        "<loss>", op, [BAD], "underflow"), rep
    assert o["source"] == line_of(text), o
    assert "log_softmax" in rep["hint"] and "out of scale" in rep["hint"], rep["hint"]


def test_one_pass_band_variance_on_radiance_is_precision(tmp_path):
    """E[x^2] - E[x]^2 of the dark-current bands (~1000 DN, spread 0.01) cancels below 0 in
    float32: sqrt of a negative, finite in float64."""
    ev, bundle = fire("make_radiance_ae", M.UnmixingLoss(), tmp_path, plant="radiance")
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "forward", "norm"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["made"], rep["cause"]) == ("aten.sqrt", "nan", "precision"), rep
    assert o["source"] == line_of("return (x - mean) / torch.sqrt(var + 1e-6)"), o
    assert "catastrophic cancellation" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("guard", [False, True])
def test_adam_without_eps_on_never_lit_bands_names_the_columns_and_the_bands(tmp_path, guard):
    """The encoder's weights on the water bands (0 in every pixel) get gradients of exactly 0;
    Adam with eps=0 divides m = 0 by sqrt(v) = 0 at the first step, in those columns alone:
    the hint names them and the input's all-zero bands, with or without the update re-run."""
    ev, bundle = fire("make_softmax_ae", M.UnmixingLoss(mask=M.band_mask()), tmp_path, eps=0.0,
                      guard=guard)
    assert (ev["step"], ev["phase"]) == (0, "optimizer"), ev
    rep = nanreplay_json(bundle, code=None)
    assert (rep["cause"], rep["reproduced"]) == ("optimizer", guard), rep
    assert rep["origin"]["params"][0] == "encoder.0.weight", rep["origin"]
    assert "eps=0" in rep["hint"], rep["hint"]
    assert ("whole column(s) 9, 10, 17 of encoder.0.weight, the weights of feature(s) 9, 10, 17 "
            "of batch, which hold 0 in every sample") in rep["hint"], rep["hint"]


def test_nan_filled_edge_patch_is_an_input_event(tmp_path):
    """A patch cut past the scene's edge and NaN-filled reaches the 3-D CNN: input, patch 2."""
    ev, bundle = fire("make_cnn3d", torch.nn.CrossEntropyLoss(), tmp_path, plant="edge",
                      amp=torch.bfloat16, patches=True)
    assert (ev["step"], ev["phase"]) == (3, "input"), ev
    rep = nanreplay_json(bundle)
    assert (rep["cause"], rep["origin"]["samples"]) == ("input", [BAD]), rep


def scaled_cnn(out_dir, record: bool):
    """The 3-D CNN under float16 autocast with a GradScaler started at 2**24: its first steps'
    scaled gradients overflow and the scaler skips them (as it is built to)."""
    model = M.make_cnn3d()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)
    crit = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, scaler=scaler,
                         factory="hyperspectral_unmixing_models:make_cnn3d") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for (cube,), (labels,) in patch_batches(g, None, 4):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(cube)
            scaler.scale(loss_fn(out.float(), labels)).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(opt)
            scaler.update()
    return model, scaler.get_scale()


def test_grad_scaler_skips_of_the_float16_3d_cnn_raise_no_event(tmp_path):
    """The skipped steps' infinite gradients are the scaler's, not a bug: no event, and the
    same weights and scale as without the recorder."""
    (a, scale_a), (b, scale_b) = scaled_cnn(tmp_path, True), scaled_cnn(tmp_path, False)
    assert scale_a == scale_b < 2.0 ** 24
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    assert not any(tmp_path.rglob("*.nan"))

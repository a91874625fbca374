"""End to end on deep learning over FMCW radar (``radar_sensing_models``): raw ADC cubes served
by a ``DataLoader``, range-Doppler maps with ``torch.fft``, a hand-written focal loss, gradient
clipping. Planted: a corrupted ADC frame (NaN samples), a dropped frame whose ``20 log10 |x|`` is
-inf, a CFAR normaliser dividing the zeroed near-range bins by their local mean of 0, a corner
reflector's linear magnitude past float16 under autocast, a beamformer's power in dB whose
squares underflow float16 after ``norm="forward"`` FFTs, the ``hypot(re, im)`` of a zero-padded
antenna (NaN in backward only), a focal loss taking ``log(softmax)`` of linear-magnitude
logits, and Adam with ``eps=0`` on the calibration of an antenna a 3-RX sensor never fills.
Each fires under the recorder and is replayed with the CLI; the fixed versions raise no event
and train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import pytest
import radar_sensing_models as M
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

BATCH = 8


def line_of(text: str) -> str:
    return source_line("radar_sensing_models.py", text)


def dataset(steps: int, plant, every: bool) -> TensorDataset:
    """``steps`` batches of labelled ADC cubes; ``plant(cube, labels)`` edits the last batch
    (``every``: each batch) in place."""
    g = torch.Generator().manual_seed(0)
    xs, ys = [], []
    for step in range(steps):
        y = torch.randint(0, M.CLASSES, (BATCH,), generator=g)
        x = M.adc_batch(g, BATCH, y)
        if plant is not None and (every or step == steps - 1):
            plant(x, y)
        xs.append(x)
        ys.append(y)
    return TensorDataset(torch.cat(xs), torch.cat(ys))


def train(make: str, out_dir, plant=None, steps: int = 3, record: bool = True,
          every: bool = False, amp: bool = False, eps: float = 1e-8, accum: int = 1,
          stable: bool = True):
    """Adam, the focal loss, clipping at 1.0 as the RADDet/RadHAR code trains; ``amp``: float16
    autocast around the forward; ``accum`` micro-batches a step (the batch's rows split in
    order); ``stable=False``: the focal loss's ``log(softmax)`` written out. Returns the model."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=eps)
    crit = M.FocalLoss(stable=stable)
    loader = DataLoader(dataset(steps, plant, every), batch_size=BATCH)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"radar_sensing_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for adc, labels in loader:
            opt.zero_grad()
            for part in range(accum):
                rows = slice(part * BATCH // accum, (part + 1) * BATCH // accum)
                with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
                    logits = model(adc[rows])
                (loss_fn(logits.float(), labels[rows]) / accum).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    return model


def fire(make: str, tmp_path, plant=None, **how):
    with pytest.raises(NonFiniteError) as info:
        train(make, tmp_path, plant, **how)
    return info.value.event, info.value.bundle_path


def corrupt(x, y):
    x[6, 1, 3, 7:] = float("nan")   # a frame whose ADC read-out broke mid-chirp


def dropped(x, y):
    x[5] = 0                         # a dropped frame, stored as zeros


def reflector(x, y):
    x[3] *= 80                       # a corner reflector at close range


def padded(x, y):
    x[2, 3] = 0                      # a 3-RX recording padded to 4 antennas


def test_corrupted_adc_frame_is_named_as_the_input(tmp_path):
    """NaN samples in one antenna's chirp of frame 6: the recorder stops at the input, the
    replay names the batch, sample 6, cause input."""
    ev, bundle = fire("make_rd", tmp_path, corrupt)
    assert (ev["step"], ev["phase"], ev["kind"], ev["samples"]) == (2, "input", "nan", [6]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["tensor"], o["made"], o["samples"]) == (
        "input", "batch", "nan", [6]), o
    assert rep["cause"] == "input" and "data pipeline" in rep["hint"], rep["hint"]


def test_dropped_frame_names_log10_of_the_db_map_and_the_blank_record(tmp_path):
    """``20 log10 |x|`` of a frame of zeros is -inf (then NaN in the min-max): the replay names
    log10 in ``db`` on its line, sample 5, invalid, and the record being 0 everywhere."""
    ev, bundle = fire("make_rd", tmp_path, dropped)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"], ev["samples"]) == (
        2, "forward", "db", "-inf", [5]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "db", "aten.log10", "-inf", [5]), o
    assert o["source"] == line_of("return 20 * torch.log10(mag)"), o
    assert rep["cause"] == "invalid" and "clamp_min(eps)" in rep["hint"], rep["hint"]
    assert "0 everywhere in sample(s) 5" in rep["hint"], rep["hint"]


def test_floored_dropped_frame_names_the_min_max_written_with_an_eps_of_zero(tmp_path):
    """With a floor under the magnitude the dropped frame's dB map is constant, and a min-max
    configured with ``eps=0`` divides 0 by 0 there: the replay names the division in ``norm``,
    sample 5, and the eps of 0 that guarded nothing."""
    ev, bundle = fire("make_rd_floor_bare", tmp_path, dropped)
    assert (ev["step"], ev["module"], ev["kind"], ev["samples"]) == (2, "norm", "nan", [5]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("norm", "aten.div", "nan", [5])
    assert o["source"] == line_of("return (x - lo) / (hi - lo + self.eps)"), o
    assert rep["cause"] == "invalid" and "guarded nothing" in rep["hint"], rep["hint"]


def test_cfar_over_zeroed_near_range_names_the_division_and_its_zero_eps(tmp_path):
    """The near-range bins are zeroed before the CFAR normaliser, whose local noise mean is 0
    there: ``p / (noise + 0)`` is 0/0 at the first step in every frame. The replay names the
    division in ``cfar``, all rows, and the eps of 0 that guarded nothing."""
    ev, bundle = fire("make_cfar", tmp_path)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "forward", "cfar", "nan")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["all_samples"]) == (
        "cfar", "aten.div", "nan", True), o
    assert o["source"] == line_of("return p / (noise + self.eps)"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert "exactly 0" in rep["hint"], rep["hint"]


def test_corner_reflector_overflows_float16_and_the_hint_says_it_once(tmp_path):
    """A corner reflector at close range makes frame 3's linear magnitude 1.6e5, past float16:
    autocast's cast for the first linear is +inf. The replay names the cast in ``fc``, sample
    3, overflow, and that frame being out of scale, once: no generic "or keep this op in
    float32" beside "a wider type would only hide" (it said both)."""
    ev, bundle = fire("make_mag", tmp_path, reflector, amp=True)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        2, "forward", "fc", [3]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "fc", "aten._to_copy", "+inf", [3]), o
    h = rep["hint"]
    assert rep["cause"] == "overflow" and "float16" in h, h
    assert "made of the batch's data alone" in h, h
    assert "sample(s) 3 of batch reach" in h and "would only hide" in h, h
    assert "keep this op in float32" not in h, h


def test_beam_power_underflows_float16_before_the_db(tmp_path):
    """ADC counts scaled to full scale and ``norm="forward"`` FFTs leave noise cells near 3e-5;
    the beamformer's linear returns float16 under autocast and their squares (1e-10) round to
    0: ``10 log10`` is -inf in every frame at the first step. The replay names log10 in
    ``beam`` and underflow, with float32 as the remedy."""
    ev, bundle = fire("make_beam", tmp_path, amp=True)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "forward", "beam", "-inf")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["all_samples"]) == (
        "beam", "aten.log10", "-inf", True), o
    assert o["source"] == line_of("return 10 * torch.log10(power).permute(0, 3, 1, 2)"), o
    assert rep["cause"] == "underflow" and "float32" in rep["hint"], rep["hint"]


def test_focal_loss_of_linear_magnitudes_names_log_of_an_underflowed_softmax(tmp_path):
    """Linear (not dB) magnitudes into the classifier give logits in the hundreds, and the
    focal loss written as ``log(softmax(z)[y])`` takes the log of a probability float32 rounds
    to 0 (``log p`` is -309, -180 and -112 in float64) at the first step: the replay names the
    loss's log on its line, samples 2, 4 and 5, underflow, and log_softmax."""
    ev, bundle = fire("make_mag", tmp_path, stable=False)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "loss", "<loss>", "+inf")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "<loss>", "aten.log", "-inf", [2, 4, 5]), o
    assert o["source"] == line_of("logp = torch.log(F.softmax(logits, dim=-1)"), o
    assert rep["cause"] == "underflow" and "log_softmax instead of log(softmax)" in rep["hint"]


def test_hypot_of_a_padded_antenna_names_its_backward_and_the_complex_modulus(tmp_path):
    """Frame 2 comes from a 3-RX sensor, its fourth antenna zero-padded: ``hypot(re, im)`` of
    the calibrated antenna is 0 there, finite in forward, and its derivative ``re / hypot`` is
    0/0 in backward. The replay names HypotBackward0 in ``angle`` on its line, sample 2, and
    says hypot's pole and the spellings whose gradient at 0 is 0 (it named only sqrt, norms,
    logs and divisions)."""
    ev, bundle = fire("make_angle", tmp_path, padded)
    assert (ev["step"], ev["phase"], ev["kind"]) == (2, "backward", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["made"], o["samples"]) == (
        "backward", "angle", "HypotBackward0", "nan", [2]), o
    assert o["source"] == line_of("mag = torch.hypot(re, im)"), o
    h = rep["hint"]
    assert rep["cause"] == "invalid" and "hypot(a, b) is 0 where both" in h, h
    assert "torch.complex(a, b).abs()" in h, h


def test_padded_antenna_in_the_second_micro_batch_names_its_rows(tmp_path):
    """The same padded antenna in frame 6 with two micro-batches a step: the replay names the
    second micro-batch, its sample 2, and row 6 of the loop's batch."""
    ev, bundle = fire("make_angle", tmp_path, lambda x, y: x[6, 3].zero_(), accum=2)
    assert (ev["step"], ev["phase"], ev["kind"]) == (2, "backward", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["module"], o["micro_batch"], o["samples"], o["batch_rows"]) == (
        "HypotBackward0", "angle", 1, [2], [6]), o
    assert rep["cause"] == "invalid" and "hypot(a, b) is 0 where both" in rep["hint"]


def test_endfire_target_names_asin_backward_at_the_edge_of_its_domain(tmp_path):
    """A simulated target at endfire in the first batch's frame 3: neighbouring antennas are in
    exact antiphase, ``atan2`` gives pi, and the angle ``asin(dphi / pi)`` takes exactly 1,
    finite in forward, infinite derivative in backward. The replay names AsinBackward0 on its
    line, sample 3, invalid, and a clamp inside the domain."""
    ev, bundle = fire("make_aoa", tmp_path, endfire_first, steps=1)
    assert (ev["step"], ev["phase"]) == (0, "backward"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["op"], o["made"], o["samples"]) == (
        "backward", "AsinBackward0", "+inf", [3]), o
    assert o["source"] == line_of("return self.fc(torch.asin(sine))"), o
    assert rep["cause"] == "invalid" and "exactly +-1" in rep["hint"], rep["hint"]
    assert "clamp(-1 + eps, 1 - eps)" in rep["hint"], rep["hint"]


def test_adam_without_eps_names_the_never_filled_antennas_calibration(tmp_path):
    """A 3-RX dataset padded to 4 antennas: antenna 3's calibration never gets a gradient, and
    Adam with ``eps=0`` divides its m = 0 by sqrt(v) = 0 at the first update. The replay names
    the optimizer, the parameter, its row 3 and eps."""
    ev, bundle = fire("make_angle_stable", tmp_path, lambda x, y: x[:, 3].zero_(),
                      every=True, eps=0.0)
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "optimizer", "nan"), ev
    rep = nanreplay_json(bundle, code=None)
    assert rep["cause"] == "optimizer", rep["cause"]
    assert "angle.w_re" in rep["hint"] and "eps=0" in rep["hint"], rep["hint"]
    assert "row(s) 3 of 4" in rep["hint"], rep["hint"]


def endfire_first(x, y):
    M.endfire(x, 3)                  # (in every batch: the calibration starts at 1 + 0j)


@pytest.mark.parametrize(("make", "plant", "amp"), [
    ("make_rd_floor", dropped, False), ("make_cfar_eps", None, False),
    ("make_beam_wide", None, True), ("make_angle_stable", padded, False),
    ("make_lstm", dropped, False), ("make_aoa_clamped", endfire_first, False)])
def test_fixed_models_raise_nothing_and_train_the_same(tmp_path, make, plant, amp):
    """The fixed versions (a magnitude floor, a CFAR eps, the beam power in float32, the
    complex modulus, the sine clamped inside asin's domain) on the same planted data (the
    endfire frame in every batch), and the micro-Doppler LSTM: no event, and the weights
    bit-identical with and without the recorder."""
    every = plant is endfire_first
    recorded = train(make, tmp_path, plant, amp=amp, every=every)
    plain = train(make, tmp_path, plant, amp=amp, record=False, every=every)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.isfinite(a).all() and torch.equal(a, b), name

"""End to end on seismic phase picking as PhaseNet writes it (``seismic_phase_picking_models``):
three-component windows at 100 Hz normalised per channel (in the data pipeline or in the
model), an FFT band-pass, a 1-D U-Net, softmax over P, S and noise against Gaussian soft labels
with class weights, a DataLoader over a tensor data set, Adam with ``ReduceLROnPlateau``,
gradient clipping, fp16 autocast where asked. Each planted bug of the domain fires under the
recorder and is replayed with the CLI; the healthy recipe raises no event and trains
bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import pytest
import seismic_phase_picking_models as M
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("seismic_phase_picking_models.py", text)


def train(make: str, out_dir, bad: dict | None = None, steps: int = 3, record: bool = True,
          loss=M.phasenet_loss, how: str | None = None, eps: float = 1e-10,
          amp: torch.dtype | None = None, accum: int = 1, masked: bool = False,
          noise: bool = False):
    """PhaseNet's recipe: Adam, ReduceLROnPlateau on the step loss, clip_grad_norm_(1), batches
    of 8 windows from a DataLoader, ``accum`` micro-batches each; ``bad`` plants a window in the
    last step's batch; ``how`` normalises in the data pipeline. Returns the model and losses."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=1)
    rec = FlightRecorder(model, opt, loss_fn=loss, out_dir=out_dir,
                         factory=f"seismic_phase_picking_models:{make}") if record else None
    losses = []
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else loss
        for step in range(steps):
            data = M.dataset(8, step, bad if step == steps - 1 else None, how, eps, masked,
                             noise)
            for *x, y in torch.utils.data.DataLoader(data, batch_size=8):
                opt.zero_grad()
                total = 0.0
                for *xb, yb in zip(*(t.chunk(accum) for t in x), y.chunk(accum)):
                    kw = {"noise": xb.pop()} if noise else {}  # (an extra keyword of forward)
                    with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
                        out = loss_fn(model(*xb, **kw), yb) / accum
                    out.backward()
                    total += out.item()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step(total)
                losses.append(total)
    return model, losses


def fire(make: str, tmp_path, bad: dict, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(make, tmp_path, bad, **kw)
    return info.value.event, info.value.bundle_path


def test_dead_component_normalised_by_its_std_without_eps_names_the_division(tmp_path):
    """A broken sensor's E component records only zeros; the model's per-channel
    normalisation divides it by its std of exactly 0 (eps = 0): 0/0 on that window alone. The
    replay names the division in ``norm``, the window, and the eps that is 0; dropping the
    window makes the step finite."""
    ev, bundle = fire("make_no_eps", tmp_path, {"dead": 5})
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (2, "forward", "norm", "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "norm", "aten.div", "nan", [5]), o
    assert o["source"] == line_of("return x / (scale + self.eps)"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert "eps added to that input is exactly 0" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_dead_component_normalised_by_its_peak_in_the_second_micro_batch(tmp_path):
    """Peak normalisation (divide by max |x|, eps = 0) of the dead component, the batch in two
    accumulated micro-batches of 4: window 6 is row 2 of micro-batch 1, mapped back to row 6."""
    ev, bundle = fire("make_peak_no_eps", tmp_path, {"dead": 6}, accum=2)
    assert (ev["step"], ev["phase"], ev["micro_batch"]) == (2, "forward", 1), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["micro_batch"], o["samples"], o["batch_rows"]) == (
        "norm", "aten.div", 1, [2], [6]), o
    assert rep["cause"] == "invalid" and "eps added to that input is exactly 0" in rep["hint"]


def test_dead_component_normalised_in_the_pipeline_names_its_channel(tmp_path):
    """SeisBench-style normalisation in the data pipeline (std, no eps): the dead component is
    NaN before the model. An input event on that window, and the hint names the channel that
    is NaN throughout, a per-channel standardisation of a flat channel, not a bad record."""
    ev, bundle = fire("make_raw", tmp_path, {"dead": 3}, how="std", eps=0.0)
    assert (ev["step"], ev["phase"], ev["kind"]) == (2, "input", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["cause"], o["phase"], o["samples"]) == ("input", "input", [3]), o
    assert "sample 3 at index 2 of dim 1" in rep["hint"], rep["hint"]
    assert "add an eps to the std" in rep["hint"], rep["hint"]


def test_gap_filled_with_nan_names_the_run_of_missing_samples(tmp_path):
    """A telemetry gap of 0.4 s that the merge filled with NaN: the window holds NaN on every
    component over samples 100..139 and is finite elsewhere. The replay said only "check the
    data pipeline for these samples (bad files, division by zero...)"; it now names the run
    along the time axis as a gap filled with NaN, and the fill that fixes it."""
    ev, bundle = fire("make_model", tmp_path, {"gap": 6})
    assert (ev["step"], ev["phase"], ev["kind"]) == (2, "input", "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=6")
    o = rep["origin"]
    assert (rep["cause"], o["phase"], o["samples"]) == ("input", "input", [6]), o
    h = rep["hint"]
    assert "sample 6 at positions 100..139 of dim 2, in 3 of its 3 rows" in h, h
    assert "a gap in the recording" in h and "fill the gap with a finite value" in h, h
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_noise_window_in_the_pick_focused_loss_names_the_division_by_its_pick_mass(tmp_path):
    """Augmentation by noise windows: a window without an event has soft labels of noise only,
    so its pick label mass is 0 and the pick-focused cross-entropy, averaged over that mass, is
    0/0: a loss event on that window, with the advice to guard the denominator or skip it."""
    ev, bundle = fire("make_model", tmp_path, {"noise_only": 2}, loss=M.pick_focused_loss)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (2, "loss", "<loss>", "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=2")
    o = rep["origin"]
    assert (o["phase"], o["op"], o["made"], o["samples"]) == ("loss", "aten.div", "nan", [2]), o
    assert o["source"] == line_of("return ((ce * mass).sum(1) / mass.sum(1)).mean()"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert "skip the rows where it is 0" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_stacked_events_labels_without_clamp_make_kl_div_nan_on_that_window(tmp_path):
    """Augmentation by stacking a second event whose P arrives on the first's S: the stacked
    labels' noise class 1 - P - S forgot the single-event builder's clamp, -1 at that sample,
    and ``kl_div``'s ``xlogy(y, y)`` of a negative target is NaN. The replay names xlogy in the
    loss on the stacked window, the target's -1 there as the batch gave it, outside xlogy's
    domain, and sends the user to fix the record where the data is made, not to an eps."""
    ev, bundle = fire("make_model", tmp_path, {"stacked": 4}, loss=M.kl_loss)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (2, "loss", "<loss>", "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=4")
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"]) == ("aten.xlogy", "nan", [4]), o
    assert o["source"] == line_of('return F.kl_div(F.log_softmax(logits, 1), y, reduction='), o
    h = rep["hint"]
    assert rep["cause"] == "invalid" and "xlogy of a negative number (as low as -1)" in h, h
    assert "(y) holds -1 at sample(s) 4 as the batch gave it" in h, h
    assert "takes values of 0 or more only" in h and "where the data is made" in h, h
    assert "an eps in the loss would train toward a made-up target" in h, h
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_noise_window_with_all_zero_labels_names_the_renormalisation_of_its_target(tmp_path):
    """A window of the noise data set whose label builder never ran (all zeros, not noise = 1),
    renormalised in the loss to sum to 1 per sample: 0/0 made of the labels alone. The replay
    names that division on the window, says the target holds no mass there, and sends the user
    to the code that built the target, not to an eps."""
    ev, bundle = fire("make_model", tmp_path, {"unlabelled": 5}, loss=M.normalised_label_loss)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (2, "loss", "<loss>", "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"]) == ("aten.div", "nan", [5]), o
    assert o["source"] == line_of("y = y / y.sum(1, keepdim=True)"), o
    h = rep["hint"]
    assert rep["cause"] == "invalid" and "computed from the batch's data alone" in h, h
    assert "holds no mass at sample(s) 5" in h and "check the code that built that target" in h
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_hand_written_bce_of_the_detection_head_names_log_of_one_minus_sigmoid(tmp_path):
    """EQTransformer's detection head with its BCE written by hand on ``sigmoid``, fed raw
    counts with no normalisation: the detection logits are so large that ``sigmoid`` rounds to
    1 and ``log(1 - det)`` is -inf on every window. The replay calls it precision, not data,
    and gives the stable complement (logsigmoid(-z))."""
    ev, bundle = fire("make_detector_raw", tmp_path, {}, loss=M.eqt_loss)
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"]) == ("aten.log", "-inf", list(range(8))), o
    assert o["source"] == line_of("bce = -(d * torch.log(det) + (1 - d) * torch.log(1 - det))")
    assert rep["cause"] == "precision", rep
    assert "log(1 − sigmoid(z)) = logsigmoid(−z)" in rep["hint"], rep["hint"]


def test_batch_class_weights_of_a_micro_batch_without_picks_name_the_class_mass(tmp_path):
    """Inverse-frequency class weights from each micro-batch's own soft-label mass, the batch
    in four micro-batches of 2: micro-batch 2 holds two noise windows, no P or S mass, so the
    weights of P and S are 1/0 and the labels' 0 times them NaN. No window is to blame: the
    replay names the division by a count per class of the batch's labels, no sample, and the
    fix (count over the training set, smooth or floor). It said "add an eps or skip the rows
    where it is 0", then blamed "a mask's 0" (the absent class's labels)."""
    ev, bundle = fire("make_model", tmp_path, {"noise_only": (4, 5)}, loss=M.balanced_loss,
                      accum=4)
    assert (ev["step"], ev["phase"], ev["micro_batch"], ev["kind"]) == (2, "loss", 2, "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["made"], o["micro_batch"], o["samples"]) == ("aten.div", "+inf", 2, []), o
    assert o["source"] == line_of("w = (mass.sum() / (3 * mass))[None, :, None]"), o
    h = rep["hint"]
    assert rep["cause"] == "invalid" and "of a count per class (or bin) of the batch's labels" in h
    assert "one-hot or soft labels summed over the batch" in h and "no sample is to blame" in h, h
    assert "count over the training set once" in h and "mask's 0" not in h, h


def test_noise_window_with_a_dead_component_at_a_target_snr_names_the_scale(tmp_path):
    """Augmentation by adding noise windows, passed to ``forward`` as a keyword, scaled to a
    target SNR by the ratio of the stds: a noise window from a station with a dead component
    has a std of 0 there, so the scale is x/0 = +inf (then inf * 0 = NaN). The replay names
    that division in the root module's forward on that window and the eps it lacks."""
    ev, bundle = fire("make_model", tmp_path, {"noise_dead": 3}, noise=True)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (2, "forward", "", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.div", "+inf", [3]), o
    assert o["source"] == line_of(
        "scale = x.std(-1, keepdim=True) / (noise.std(-1, keepdim=True) * 10 ** (snr_db / 20))")
    assert rep["cause"] == "invalid" and "by 0 (x/0, a pole)" in rep["hint"], rep["hint"]
    assert "add an eps to the denominator" in rep["hint"], rep["hint"]


def test_hand_written_log_of_softmax_underflows_on_raw_counts(tmp_path):
    """A model without any normalisation (no BatchNorm, no trace normalisation) fed raw counts:
    the logits are in the thousands and the softmax of the losing classes underflows to 0, so
    ``torch.log(softmax)`` is -inf from step 0 on every window. The replay names the log in the
    loss as an underflow and sends the user to log_softmax."""
    ev, bundle = fire("make_raw_no_bn", tmp_path, {}, loss=M.hand_log_loss)
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["op"], o["made"], o["samples"]) == (
        "loss", "aten.log", "-inf", list(range(8))), o
    assert o["source"] == line_of("return -(w * y * torch.log(p)).sum(1).mean()"), o
    assert rep["cause"] == "underflow", rep
    assert "log_softmax instead of log(softmax)" in rep["hint"], rep["hint"]


def test_clipped_trace_in_raw_counts_overflows_float16_autocast(tmp_path):
    """Raw counts under fp16 autocast: ordinary windows reach 1e4 counts, inside float16, but
    a trace clipped at the int32 digitiser limit (2**31 - 1) is +inf once the first conv casts
    it. The replay names the cast in ``inc.0`` on that window as an overflow, and says the data
    of that window is out of scale (drop it, or normalise the traces)."""
    ev, bundle = fire("make_raw", tmp_path, {"clipped": 4}, amp=torch.float16)
    assert (ev["step"], ev["phase"], ev["module"]) == (2, "forward", "inc.0"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "inc.0", "aten._to_copy", "+inf", [4]), o
    assert rep["cause"] == "overflow", rep
    assert "beyond float16's largest value" in rep["hint"], rep["hint"]
    assert "sample(s) 4 of batch reach 2.15e+09" in rep["hint"], rep["hint"]
    assert "--try drop=4" in rep["hint"], rep["hint"]


def test_station_outage_masks_every_key_of_the_bottleneck_attention(tmp_path):
    """Gaps filled with 0 and passed to ``forward`` as a mask that the bottleneck attention
    takes as its ``key_padding_mask``: a partial gap is harmless, but a window cut while the
    station was down is a gap throughout, every key is masked, and the softmax over a row of
    -inf is NaN. The replay names the softmax in ``attn`` on that window and the advice to keep
    a key per row or leave a window of padding only out of the batch."""
    ev, bundle = fire("make_attention", tmp_path, {"outage": 3, "gap": 5}, masked=True)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (2, "forward", "attn", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("attn", "aten._softmax", "nan",
                                                                [3]), o
    assert o["source"] == line_of("e2 = e2 + self.attn(h, h, h, key_padding_mask=masked)"), o
    assert rep["cause"] == "invalid" and "every entry is -inf" in rep["hint"], rep["hint"]
    assert "key_padding_mask is True (masked) at every position of samples [3]" in rep["hint"]
    assert "leave them out of the batch" in rep["hint"], rep["hint"]


def test_unrecorded_dead_component_turns_the_weights_nan(tmp_path):
    """Without the recorder the 0/0 of the dead component reaches every weight (clipping a
    NaN norm keeps NaN): the event above is the bug, not a false alarm."""
    model, _ = train("make_no_eps", tmp_path, {"dead": 5}, record=False)
    assert not torch.isfinite(model.inc[0].weight).all()


@pytest.mark.parametrize("make,bad,kw", [
    ("make_model", {"dead": 5, "noise_only": 2}, {"loss": M.pick_focused_guarded}),
    ("make_raw", {"dead": 3, "noise_only": 1}, {"how": "peak", "accum": 2}),
    ("make_model", {"dead": 1, "clipped": 6}, {"amp": torch.bfloat16}),
    ("make_attention", {"gap": 5, "noise_only": 0}, {"masked": True}),
    ("make_detector", {"dead": 2, "unlabelled": 7}, {"loss": M.eqt_loss}),
    ("make_model", {"dead": 4}, {"noise": True, "accum": 2}),
])
def test_guarded_runs_raise_nothing_and_train_the_same(tmp_path, make, bad, kw):
    """The guarded recipes (eps on the std or the peak, the pick mass floored, gaps filled and
    masked as attention keys: -inf scores that stay inside the softmax) on batches holding a
    dead component, a noise-only window, a clipped trace and a gap, under bf16 autocast or in
    two micro-batches: no event, and weights and losses bit-identical with and without the
    recorder."""
    recorded, losses = train(make, tmp_path, bad, **kw)
    plain, plain_losses = train(make, tmp_path, bad, record=False, **kw)
    assert losses == plain_losses and all(map(lambda v: v == v, losses)), (losses, plain_losses)
    for (name, a), b in zip(recorded.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name


def test_nan_runs_names_only_one_run_per_row_of_a_signal():
    """The gap finder speaks of a signal's gap only: one run per row of a (B, C, T) window;
    not of scattered NaN, two runs in a row, a row NaN throughout, an infinity, nor an image's
    rows (a 4-D tensor), nor counts (non-negative integers: a cell's genes, NaN in a few)."""
    from replay.nan_runs import nan_runs

    wave = torch.randn(4, 3, 64, generator=torch.Generator().manual_seed(0))
    x = wave.clone()
    x[1, :2, 10:20] = float("nan")
    assert nan_runs(x, 0) == "sample 1 at positions 10..19 of dim 2, in 2 of its 3 rows"
    for bad in ((1, 0, [3, 9]), (1, 0, [*range(3, 6), *range(9, 12)]), (1, 0, range(64))):
        y = wave.clone()
        y[bad[0], bad[1], list(bad[2])] = float("nan")
        assert nan_runs(y, 0) == "", bad
    counts = torch.zeros(8, 64)
    counts[:, ::7] = 3.0
    counts[5, 3:6] = float("nan")  # (a cell's stored values only)
    assert nan_runs(counts, 0) == ""
    y = x.clone()
    y[2, 0, 30:33] = float("inf")
    assert nan_runs(y, 0) == "" and nan_runs(x[:, None], 0) == ""

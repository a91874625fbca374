"""End to end on deep learning for the physical layer (``wireless_communications_models``):
an autoencoder transceiver whose power normalisation meets a zero-padded block, an OFDM
channel estimator under an NMSE loss meeting a user with no propagation path, an amplitude
loss written with ``sqrt(re^2 + im^2)`` at the nulled subcarriers, an LMMSE MIMO receiver
given a noise variance of 0 (``snr_db = inf``), and a hand-written 16-QAM demapper whose
``exp(-d / no)`` underflows at a high SNR. Each planted bug fires under the recorder and is
replayed with the CLI; the fixed versions raise no event and train bit-identically with and
without the recorder."""

from __future__ import annotations

import contextlib

import pytest
import torch
import wireless_communications_models as M
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

BATCH = 16


def line_of(text: str) -> str:
    return source_line("wireless_communications_models.py", text)


def snrs(g: torch.Generator, lo: float, hi: float, special: dict[int, float]) -> torch.Tensor:
    snr = torch.empty(BATCH).uniform_(lo, hi, generator=g)
    for row, value in special.items():
        snr[row] = value
    return snr


def batch(kind: str, g: torch.Generator, plant: dict[int, float] | None):
    """(model args, target) of one step; ``plant`` maps rows to their planted condition."""
    plant = plant or {}
    if kind in ("autoencoder", "rayleigh"):
        bits, ebno = M.bit_blocks(g, BATCH, next(iter(plant), None))
        return (bits, ebno), bits
    if kind == "snr":
        y, h = M.ofdm_received(g, BATCH, next(iter(plant), None))
        return (y,), h
    if kind == "ebno":  # (the planted rows' Eb/N0 in dB)
        bits, ebno = M.bit_blocks(g, BATCH)
        for row, value in plant.items():
            ebno[row] = value
        return (bits, ebno), bits
    if kind in ("ofdm", "muted"):
        row = next(iter(plant), None)
        h_ls, h = M.ofdm_batch(g, BATCH, *((row, None) if kind == "ofdm" else (None, row)))
        return (h_ls,), h
    if kind in ("mimo", "padded"):
        pad = next(iter(plant), None) if kind == "padded" else None
        return M.mimo_batch(g, BATCH, snrs(g, 0, 20, plant), pad)
    return M.qam_batch(g, BATCH, snrs(g, 0, 15, plant))


def criterion(kind: str, loss: str | None):
    if kind in ("ofdm", "muted", "snr"):
        return {"amp": M.NMSEAmplitudeLoss(), "complex": M.ComplexAmplitudeLoss()}.get(
            loss, M.NMSELoss())
    return M.BitwiseBCE() if loss == "bce" else torch.nn.BCEWithLogitsLoss()


def train(kind: str, make: str, out_dir, plant=None, loss=None, steps: int = 4,
          record: bool = True, accum: int = 1, bf16: bool = False):
    """Adam with a step schedule, gradient clipping, as the Sionna/DeepMIMO examples train;
    ``plant`` goes into the last step's batch; ``accum`` micro-batches per step (the batch's
    rows split in order), ``bf16`` autocast. Returns the model."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    crit = criterion(kind, loss)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(1)  # (the AWGN layer's noise)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"wireless_communications_models:{make}") if record else None
    data = [batch(kind, g, plant if step == steps - 1 else None) for step in range(steps)]
    if kind in ("ofdm", "muted"):  # (a channel dataset, served by a DataLoader in order)
        ds = TensorDataset(torch.cat([a[0] for a, _ in data]), torch.cat([t for _, t in data]))
        data = [((x,), y) for x, y in DataLoader(ds, batch_size=BATCH)]
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for args, target in data:
            opt.zero_grad()
            for part in range(accum):
                rows = slice(part * BATCH // accum, (part + 1) * BATCH // accum)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    out = model(*(a[rows] for a in args))
                value = loss_fn(out.float(), target[rows]) / accum
                value.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    return model


def fire(kind: str, make: str, tmp_path, plant=None, loss=None, **how):
    with pytest.raises(NonFiniteError) as info:
        train(kind, make, tmp_path, plant, loss, **how)
    return info.value.event, info.value.bundle_path


def test_zero_padded_block_names_the_power_normalisation_and_its_sample(tmp_path):
    """The file's last frame is padded with zero bits; the bias-free encoder maps it to the
    all-zero signal and ``x / sqrt(mean(x^2))`` is 0/0 there. The event and the replay name
    the power-normalisation layer, its division, the step and sample 5; the hint says the
    eps is missing and that the record is empty, and dropping it makes the step finite."""
    ev, bundle = fire("autoencoder", "make_autoencoder", tmp_path, {5: 0})
    assert (ev["step"], ev["phase"], ev["module"], ev["call"], ev["kind"], ev["samples"]) == (
        3, "forward", "norm", 0, "nan", [5]), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "norm", "aten.div", "nan", [5]), o
    assert o["source"] == line_of("return x / torch.sqrt(x.pow(2).mean(dim=1, keepdim=True)")
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert "empty records" in rep["hint"] and "args[0]" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_complex_code_over_rayleigh_fading_names_the_complex_power_normalisation(tmp_path):
    """The same padded block through a complex64 linear code and a Rayleigh layer drawing its
    fading and noise inside forward: the complex ``z / sqrt(mean(|z|^2))`` is 0/0 at sample 5,
    the replay (restoring the step's RNG) names that division and sample, and dropping the
    sample makes the step finite."""
    ev, bundle = fire("rayleigh", "make_rayleigh_autoencoder", tmp_path, {5: 0})
    assert (ev["step"], ev["module"], ev["kind"], ev["samples"]) == (3, "norm", "nan", [5]), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "norm", "aten.div", "nan", [5]), o
    assert o["source"] == line_of("return z / torch.sqrt(torch.mean(z.abs() ** 2"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_eb_n0_of_minus_inf_db_is_named_as_the_input_a_log_of_zero_made(tmp_path):
    """The pipeline converts a link's measured SNR of 0 to dB, ``10 log10(0) = -inf``, for
    sample 7: the AWGN layer's noise std is then inf. The recorder stops at the input (no
    op of the model ran on it); the replay names args[1], sample 7, and a log without a
    floor in the data pipeline."""
    ev, bundle = fire("ebno", "make_autoencoder", tmp_path, {7: float("-inf")})
    assert (ev["step"], ev["phase"], ev["kind"], ev["samples"]) == (3, "input", "-inf", [7])
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["tensor"], o["made"], o["samples"]) == (
        "input", "args[1]", "-inf", [7]), o
    assert rep["cause"] == "input", rep["cause"]
    assert "which log(0) makes" in rep["hint"] and "clamp before the log" in rep["hint"]


def test_user_without_propagation_path_names_the_nmse_division_and_the_record(tmp_path):
    """A ray-traced user with no path has an all-zero channel, so its NMSE is x / 0: the loss
    is +inf at step 3. The replay names the loss's division, sample 3, and says the divisor
    is the target's own data, a degenerate record an eps would weight by 1/eps."""
    ev, bundle = fire("ofdm", "make_estimator", tmp_path, {3: 0})
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (3, "loss", "<loss>", "+inf")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "<loss>", "aten.div", "+inf", [3]), o
    assert o["source"] == line_of("return (err / h.pow(2).sum(dim=(1, 2))).mean()"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "computed from the batch's data alone" in rep["hint"], rep["hint"]
    assert "degenerate" in rep["hint"] and "mask of divisor > 0" in rep["hint"], rep["hint"]


def test_amplitude_loss_at_nulled_subcarriers_names_sqrt_backward_in_the_loss(tmp_path):
    """The estimator zeroes the guard band and DC; the loss's ``sqrt(re^2 + im^2)`` of those
    zeros is finite in forward and NaN in backward at the first step, in every sample. The
    replay names SqrtBackward0 in the loss on its line and points at ``torch.complex(re,
    im).abs()``, whose gradient at 0 is 0."""
    ev, bundle = fire("ofdm", "make_estimator", tmp_path, loss="amp")
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "backward", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["made"], o["all_samples"]) == (
        "backward", "<loss>", "SqrtBackward0", "nan", True), o
    assert o["source"] == line_of("amp_hat = torch.sqrt(h_hat[:, 0] ** 2"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "torch.complex(re, im).abs()" in rep["hint"], rep["hint"]


def test_infinite_snr_names_the_llr_division_by_a_zero_noise_variance(tmp_path):
    """The config's noiseless point (``snr_db = inf``) gives ``no = 0`` for samples 2 and 9:
    the LMMSE output is exact, its noise variance 0, and the max-log LLR ``x / no_eff`` is
    ±inf, NaN in the neural demapper. The replay names the receiver's own division on its
    line, at those samples, its divisor being the batch's data as given: ``no``, args[2].
    With two micro-batches, the first one holding a planted row is named, in its rows."""
    inf = float("inf")
    ev, bundle = fire("mimo", "make_mimo", tmp_path, {2: inf, 9: inf})
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"], ev["samples"]) == (
        3, "forward", "", "nan", [2, 9]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.div", "+inf", [2, 9])
    assert o["source"] == line_of("llr = 2 * math.sqrt(2) * torch.view_as_real(x_hat) /"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "its divisor is the batch's own data (args[2]: " in rep["hint"], rep["hint"]


def test_infinite_snr_in_the_second_micro_batch_names_its_rows(tmp_path):
    """The same rows 9 and 12 under gradient accumulation over two halves of 8: the event and
    the replay name micro-batch 1 and its rows 1 and 4."""
    inf = float("inf")
    ev, bundle = fire("mimo", "make_mimo", tmp_path, {9: inf, 12: inf}, accum=2)
    assert (ev["step"], ev["module"], ev["samples"]) == (3, "", [1, 4]), ev
    o = nanreplay_json(bundle)["origin"]
    assert (o["micro_batch"], o["op"], o["samples"], o["batch_size"]) == (
        1, "aten.div", [1, 4], 8), o


def test_zero_padded_user_at_infinite_snr_names_the_singular_lmmse_matrix(tmp_path):
    """Sample 5 carries one user, its channel zero-padded to two columns, and is noiseless:
    ``H^H H + no I`` has a zero row and column and ``no = 0``, so ``linalg.inv`` raises. The
    loop gets the LinAlgError itself with the bundle in a note; the replay names the
    detector's inversion of the complex64 matrix, sample 5 only (its own matrix, not the
    batch's), and blames the ridge ``no * I`` being 0 there, not the record."""
    with pytest.raises(torch.linalg.LinAlgError) as info:
        train("padded", "make_mimo", tmp_path, {5: float("inf")})
    assert any("matrix decomposition failed at step 3" in n for n in info.value.__notes__)
    (bundle,) = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["event"]["step"], o["module"], o["op"], o["made"], o["samples"]) == (
        3, "detector", "aten.linalg_inv_ex", "LinAlgError", [5]), o
    assert o["source"] == line_of("g_inv = torch.linalg.inv(hh @ h + no[:, None, None] * eye)")
    assert rep["cause"] == "invalid", rep["cause"]
    assert "singular in exact arithmetic too" in rep["hint"], rep["hint"]
    assert "ridge the code adds to its diagonal" in rep["hint"], rep["hint"]
    assert "exactly 0 at the samples named" in rep["hint"], rep["hint"]
    assert "would only hide" not in rep["hint"], rep["hint"]


def test_noise_estimate_from_the_guard_band_of_a_noise_free_frame_names_the_ratio(tmp_path):
    """The estimator measures each frame's noise power on the guard band's bins; a frame
    from a noise-free simulation (sample 10) has exact zeros there, so the SNR estimate
    ``p / no_hat`` is +inf and, unclamped, a NaN in the first convolution. The replay names
    the division, sample 10, and says its divisor is a norm of part of the record that is
    all zeros (a noise-only band), to floor or bound, not a blank record to drop."""
    ev, bundle = fire("snr", "make_estimator_snr_unclamped", tmp_path, {10: 0})
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "", [10])
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.div", "+inf", [10])
    assert o["source"] == line_of("snr_db = 10 * torch.log10(y.pow(2).mean(dim=(1, 2)) /"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "a norm of part of the batch's own records (batch: " in rep["hint"], rep["hint"]
    assert "noise-only band" in rep["hint"] and "clamp the ratio" in rep["hint"], rep["hint"]
    assert "records are all zeros" not in rep["hint"], rep["hint"]


def test_hand_written_bit_cross_entropy_of_confident_llrs_is_an_underflow(tmp_path):
    """The LLRs of an LMMSE receiver with a residual neural demapper reach hundreds at 10 to
    20 dB, and a cross-entropy written from ``sigmoid(llr)`` takes ``log(0)`` at the first
    step (``log(p)`` where p underflowed to 0, ``log(1 - p)`` where it rounded to 1). The
    replay names the loss's log, the samples of both (counted on an unrecorded copy),
    underflow, and BCEWithLogitsLoss on the logits."""
    model = M.make_mimo_residual()
    (args, _), = [batch("mimo", torch.Generator().manual_seed(0), None)]
    with torch.no_grad():
        p = torch.sigmoid(model(*args))
    rows = ((p == 0) | (p == 1)).any(1).nonzero().flatten().tolist()
    assert 0 < len(rows) < BATCH, rows
    ev, bundle = fire("mimo", "make_mimo_residual", tmp_path, loss="bce")
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "loss", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "<loss>", "aten.log", "-inf", rows), o
    assert o["source"] == line_of("return -(bits * torch.log(p) + (1 - bits)"), o
    assert rep["cause"] == "underflow", rep["cause"]
    assert "BCEWithLogitsLoss on the logits" in rep["hint"], rep["hint"]


def test_hand_written_demapper_at_high_snr_is_an_exp_underflow(tmp_path):
    """At 40 dB (sample 4) ``exp(-|y - s|^2 / no)`` is 0 at every point of a bit's set, so
    ``log(p @ labels)`` is -inf and the LLR NaN. ``p @ labels`` of 0/1 labels is positive in
    exact arithmetic: the replay says underflow and log space (logsumexp), and does not call
    the sample's noise variance, one value per sample spanning decades by design, data out
    of scale."""
    ev, bundle = fire("qam", "make_equalizer", tmp_path, {4: 40.0})
    assert (ev["step"], ev["module"], ev["kind"], ev["samples"]) == (3, "demapper", "nan", [4])
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "demapper", "aten.log", "-inf", [4]), o
    assert o["source"] == line_of("return torch.log(p @ self.labels)"), o
    assert rep["cause"] == "underflow", (rep["cause"], rep["hint"])
    assert "logsumexp" in rep["hint"] and "out of scale" not in rep["hint"], rep["hint"]


def test_hand_written_demapper_under_bf16_autocast_is_the_same_underflow(tmp_path):
    """Under bf16 autocast the same step: the demapper's log in bfloat16, still underflow."""
    ev, bundle = fire("qam", "make_equalizer", tmp_path, {4: 40.0}, bf16=True)
    assert (ev["step"], ev["module"], ev["samples"]) == (3, "demapper", [4]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["dtype"], o["samples"], rep["cause"]) == (
        "aten.log", "bfloat16", [4], "underflow"), rep["hint"]
    assert "underflowed in bfloat16" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("kind, make, plant, loss, how", [
    ("autoencoder", "make_autoencoder_eps", {5: 0}, None, {}),
    ("autoencoder", "make_autoencoder_eps", {5: 0}, None, {"bf16": True}),
    ("ofdm", "make_estimator", None, "complex", {}),
    ("snr", "make_estimator_snr", {10: 0}, None, {}),
    ("rayleigh", "make_rayleigh_autoencoder", None, None, {}),
    ("mimo", "make_mimo", None, None, {"accum": 2}),
    ("padded", "make_mimo", {5: 30.0}, None, {}),
    ("qam", "make_equalizer_lse", {4: 40.0}, None, {}),
    ("qam", "make_equalizer_lse", {4: 40.0}, None, {"bf16": True}),
])
def test_fixed_versions_raise_nothing_and_train_the_same(tmp_path, kind, make, plant, loss,
                                                          how):
    """The fixes on the same batches: the eps in the power normalisation (the padded block
    sent as zeros), the amplitude through complex64 ``abs`` (nulled subcarriers), finite SNRs
    (a zero-padded user's LMMSE matrix kept invertible by its ridge ``no * I``), the complex64
    code over Rayleigh fading without a padded block, the SNR estimate clamped to its range
    (a noise-free frame's +inf to 40 dB, an infinity that stays inside),
    and the demapper's ``logsumexp`` over ``-inf``-filled bit sets at 40 dB (also under bf16
    autocast, and accumulating two micro-batches). No event, and the weights are
    bit-identical with and without the recorder."""
    recorded = train(kind, make, tmp_path, plant, loss, **how)
    plain = train(kind, make, tmp_path, plant, loss, record=False, **how)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_muted_frame_names_the_power_in_db_and_the_blank_record(tmp_path):
    """The front end zero-fills a dropped frame (sample 6); the AGC's ``10 log10(mean(x^2))``
    is -inf there and the normalisation NaN. The replay names the log10 on its line in the
    model's own code, sample 6, and says its input is the power of an all-zero record: drop
    or repair it (an eps would make a huge finite gain)."""
    ev, bundle = fire("muted", "make_estimator_agc", tmp_path, {6: 0})
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"], ev["samples"]) == (
        3, "forward", "", "nan", [6]), ev
    rep = nanreplay_json(bundle, "--try", "drop=6")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.log10", "-inf", [6])
    assert o["source"] == line_of("p_db = 10 * torch.log10(h_ls.pow(2)"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "a norm of the batch's own records (batch: " in rep["hint"], rep["hint"]
    assert "all zeros" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]

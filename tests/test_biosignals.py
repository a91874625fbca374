"""End to end on EEG and ECG models (``biosignals_models``): braindecode's ShallowConvNet (square,
average-pooled power, log; in float32 and under float16 autocast with a GradScaler), EEGNet with
per-electrode z-scoring in the model, by the training set's statistics, or in the DataLoader's
workers, a 12-lead ECG ResNet under a multi-label BCE with ``pos_weight``, a log-Euclidean
tangent-space network (``torch.linalg.eigh`` of the spatial covariance), log-amplitude STFT
spectra of learned spatial filters, and electrodes as tokens under a padding mask. Each
planted failure of the domain (a dropout segment, a disconnected or reference electrode, a
label absent from the fold, a rank-deficient covariance, a recording in the wrong unit) fires
under the recorder and is replayed with the CLI; the healthy versions raise no event and train
bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib
import warnings

import biosignals_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch import nn

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("biosignals_models.py", text)


def train_eeg(make: str, out_dir, steps: int = 4, record: bool = True, bad=None,
              accumulate: int = 1, fp16: bool = False):
    """AdamW with a cosine schedule and gradient clipping, as braindecode's recipes train
    (``fp16``: under float16 autocast with a GradScaler, unscaled before the clipping);
    ``bad`` (keyword arguments of ``mi_batch``) is planted in the last step's batch."""
    model = getattr(M, make)()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    scaler = torch.amp.GradScaler("cpu", enabled=fp16)
    crit = nn.CrossEntropyLoss(label_smoothing=0.1)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(1)  # (dropout)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, scaler=scaler,
                         factory=f"biosignals_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step in range(steps):
            opt.zero_grad()
            for k in range(accumulate):
                last = step == steps - 1 and k == accumulate - 1
                x, y = M.mi_batch(g, **(bad if bad and last else {}))
                with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
                    logits = model(x)
                loss = loss_fn(logits.float(), y) / accumulate
                scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            if isinstance(model, M.EEGNet):
                M.max_norm_(model)
    return model


def fire(fn, *args, **kwargs):
    with pytest.raises(NonFiniteError) as info:
        fn(*args, **kwargs)
    return info.value.event, info.value.bundle_path


def train_ecg(out_dir, steps: int = 4, record: bool = True, floor: float = 0.0,
              amp: bool = False):
    """The PTB-XL recipe: AdamW, OneCycleLR, a multi-label BCE balanced by ``pos_weight``
    (``neg / pos`` over the first batches, the training fold; ``floor`` on ``pos``), under
    bf16 autocast when ``amp``."""
    model = M.make_resnet1d()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=steps)
    g = torch.Generator().manual_seed(0)
    fold = torch.cat([M.ecg_batch(g)[1] for _ in range(4)])
    pos_weight = M.label_pos_weight(fold) if not floor else (
        (len(fold) - fold.sum(0)) / fold.sum(0).clamp_min(floor))
    crit = nn.BCEWithLogitsLoss(pos_weight=pos_weight)
    torch.manual_seed(1)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory="biosignals_models:make_resnet1d") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for _ in range(steps):
            x, y = M.ecg_batch(g)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                logits = model(x)
            loss = loss_fn(logits.float(), y)
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    return model


def tangent_batch(g, bad):
    return M.mi_batch(g, **(bad or {}))


def train_tangent(make: str, out_dir, steps: int = 4, record: bool = True, bad=None):
    """Adam, no clipping, as the Riemannian and spectral-feature EEG pipelines train their
    head (and the filters before it) end to end."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"biosignals_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step in range(steps):
            x, y = M.mi_batch(g, **(bad if bad and step == steps - 1 else {}))
            loss = loss_fn(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model


def recordings(flat: tuple[int, int] | None = None, n: int = 64):
    """The windowed trials of a session and their labels; ``flat``: (trial, electrode) that
    the acquisition wrote as zeros (a disconnected electrode)."""
    g = torch.Generator().manual_seed(3)
    x, y = M.mi_batch(g, n=n)
    if flat is not None:
        x[flat[0], flat[1]] = 0.0
    return x, y


def train_loader(out_dir, flat=None, eps: float = 0.0, record: bool = True, steps: int = 4):
    """EEGNet fed by a DataLoader with two workers that z-score each trial in
    ``__getitem__``, class-balanced by a ``WeightedRandomSampler`` (1 / class count)."""
    x, y = recordings(flat)
    weights = 1.0 / torch.bincount(y).float()
    sampler = torch.utils.data.WeightedRandomSampler(
        weights[y], num_samples=16 * steps, generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(M.WindowDataset(x, y, eps), batch_size=16,
                                         sampler=sampler, num_workers=2)
    model = M.make_eegnet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss()
    torch.manual_seed(1)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory="biosignals_models:make_eegnet") if record else None
    order = []
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for xb, yb in loader:
            order.append(xb)
            loss = loss_fn(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            M.max_norm_(model)
    return model, order


def train_attention(out_dir, steps: int = 3, record: bool = True):
    """Electrodes as tokens under bf16 autocast, the missing ones (1 to 3 per trial) masked
    out of the attention by ``key_padding_mask`` (-inf in the scores) and out of the pooling;
    gradient accumulation over two micro-batches, clipping, AdamW."""
    model = M.make_channel_attention()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(1)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory="biosignals_models:make_channel_attention") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for _ in range(steps):
            opt.zero_grad()
            for _ in range(2):
                x, y = M.mi_batch(g, n=8)
                missing = torch.rand(8, M.N_CHANS, generator=g) < 0.25
                missing[:, 0] = False  # (every trial keeps its reference electrode)
                x = x.masked_fill(missing[..., None], 0.0)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = model(x, missing)
                (loss_fn(logits.float(), y) / 2).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    return model


def assert_same_weights(recorded, plain):
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_shallow_convnet_log_of_a_dropout_segment_names_the_log_and_the_trial(tmp_path):
    """An amplifier dropout leaves one trial at 0 on every electrode for 1.1 s, longer than a
    pooling window: ShallowConvNet's average-pooled power is exactly 0 there (its filters have
    no offset) and ``torch.log`` without braindecode's clamp is -inf, which the dropout's mask
    turns into NaN. The replay names the log on its line, the trial, log's pole at 0 and the
    clamp; dropping the trial makes the step finite."""
    ev, bundle = fire(train_eeg, "make_shallow", tmp_path, bad={"dropout_row": 5})
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "", [5]), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.log", "-inf", [5]), o
    assert o["source"] == line_of("feats = torch.log(power)  # the bug"), o
    assert o["input_range"][0] == 0.0, o
    assert rep["cause"] == "invalid" and "pole at 0" in rep["hint"], rep["hint"]
    assert "clamp_min(eps)" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_eegnet_zscore_of_a_flat_electrode_names_the_division_and_the_trial(tmp_path):
    """EEGNet standardising each electrode of each trial in ``forward`` with an eps of 0: a
    disconnected electrode (written as zeros) in trial 6 is 0/0. The replay names the z-score
    module, the division, its line and trial 6 only, although BatchNorm spreads the NaN to
    every trial of the batch before the classifier; the hint says the eps of 0 guards
    nothing."""
    ev, bundle = fire(train_eeg, "make_eegnet_zscore", tmp_path, bad={"flat": (6, 3)})
    assert (ev["step"], ev["phase"], ev["module"], ev["call"]) == (3, "forward", "norm", 0), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("norm", "aten.div", "nan", [6]), o
    assert o["source"] == line_of("return (x - mean) / (std + self.eps)"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert "exactly 0" in rep["hint"] and "set it to a positive value" in rep["hint"], rep["hint"]


def test_training_set_std_of_the_reference_electrode_names_the_buffer_not_rows(tmp_path):
    """EEGNet behind the training set's per-electrode mean and std (buffers), recorded
    against electrode 0, the reference, identically 0: its std is 0 and every trial's
    electrode 0 is 0/0. The replay names the division on its line and every trial; the hint
    names the buffer ``norm.std`` at entry (0, 0) and the floor where it is computed, where it
    said 'add an eps to the denominator or skip the rows where it is 0' (every row is)."""
    ev, bundle = fire(train_eeg, "make_eegnet_dataset_norm", tmp_path, steps=1,
                      bad={"reference": 0})
    assert (ev["step"], ev["phase"], ev["module"], ev["call"]) == (0, "forward", "norm", 0), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["all_samples"]) == (
        "norm", "aten.div", "nan", True), o
    assert o["source"] == line_of("return (x - self.mean) / self.std"), o
    assert rep["cause"] == "invalid", rep
    assert "the buffer norm.std as the code keeps it, 0 at entry (0, 0) of its shape (8, 1)" \
        in rep["hint"], rep["hint"]
    assert "std.clamp_min(eps)" in rep["hint"] and "skip the rows" not in rep["hint"], rep["hint"]


def test_flat_electrode_zscored_in_the_loader_names_the_trial_and_the_electrode(tmp_path):
    """The same per-electrode z-score done in the Dataset's ``__getitem__``, in two DataLoader
    workers, under a class-balanced ``WeightedRandomSampler``: the flat electrode's 0/0 comes in
    with the batch. The event and the replay name the input and the batch row; the hint names
    that row's electrode 3 as the only non-finite slice of the trial (every time step of it), a
    per-channel standardisation's zero std. (It used to give the generic 'check the data
    pipeline for these samples' only.)"""
    bad = 11
    _, batches = train_loader(None, flat=(bad, 3), record=False)
    step = next(i for i, b in enumerate(batches) if not torch.isfinite(b).all())
    rows = (~torch.isfinite(batches[step])).flatten(1).any(1).nonzero().flatten().tolist()
    ev, bundle = fire(train_loader, tmp_path, flat=(bad, 3))
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == (
        step, "input", "batch", rows), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["tensor"], o["samples"], rep["cause"]) == (
        "input", "batch", rows, "input"), o
    assert f"sample {rows[0]} at index 3 of dim 1" in rep["hint"], rep["hint"]
    assert "every value of each" in rep["hint"], rep["hint"]
    assert "add an eps to the std" in rep["hint"], rep["hint"]


def test_ecg_pos_weight_of_a_label_absent_from_the_fold_names_the_loss_buffer(tmp_path):
    """``pos_weight = neg / pos`` over the training fold, where the rare label HYP has no
    positive: +inf, and BCEWithLogits' ``(pos_weight - 1) * target`` is inf * 0 = NaN in every
    record at the first step. The replay names the loss's op and its ``pos_weight`` entry 4
    made before the step, and the count's clamp."""
    with pytest.raises(NonFiniteError) as info:
        train_ecg(tmp_path)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "loss", "<loss>"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["op"], o["all_samples"]) == (
        "loss", "aten.binary_cross_entropy_with_logits", True), o
    assert "'pos_weight' holding inf at index 4, as the step began" in rep["hint"], rep["hint"]
    assert "count.clamp_min(1)" in rep["hint"], rep["hint"]


def _smallest_eigenvalue(trial: int, electrode: int) -> float:
    """The smallest eigenvalue of ``trial``'s covariance in TangentSpaceNet's step-0 forward
    when ``electrode`` is flat in it (its forward's ops, in its order)."""
    model = M.make_tangent()
    x = M.mi_batch(torch.Generator().manual_seed(0), flat=(trial, electrode))[0]
    with torch.no_grad():
        x = model.fir(x)
        x = x - x.mean(-1, keepdim=True)
        cov = x @ x.transpose(-1, -2) / (x.shape[-1] - 1)
        return torch.linalg.eigh(cov)[0][trial].min().item()


def test_rank_deficient_covariance_names_the_log_of_eighs_eigenvalue(tmp_path):
    """A flat electrode makes the trial's spatial covariance singular; eigh rounds its zero
    eigenvalue to -3e-8 in float32 and the log-Euclidean map's ``log`` of it is NaN. The
    replay names the log, the trial, eigh's eigenvalue and rounding (float64 comes closer to
    0), and the eigenvalue clamp or a regularised / shrunk covariance."""
    # the sign eigh gives a zero eigenvalue is the CPU's rounding (electrode 2's goes below 0
    # on the AMD EPYC, above on an Intel Xeon): the electrode is one whose flat trial's
    # smallest eigenvalue, computed as the model computes it at step 0, is below 0 here
    flat = next((9, c) for c in (2, *range(M.N_CHANS)) if _smallest_eigenvalue(9, c) < 0)
    ev, bundle = fire(train_tangent, "make_tangent", tmp_path, steps=1, bad={"flat": flat})
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (0, "forward", "", [9]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.log", "nan", [9]), o
    assert o["source"] == line_of("torch.diag_embed(torch.log(evals))"), o
    assert rep["cause"] == "precision" and "eigh's eigenvalue" in rep["hint"], rep["hint"]
    assert "evals.clamp_min(eps)" in rep["hint"] and "eps * I" in rep["hint"], rep["hint"]


def test_hand_written_amplitude_spectrum_of_a_dropout_names_sqrt_backward_and_the_trial(tmp_path):
    """Log-amplitude spectra of learned spatial filters, the amplitude written as
    ``sqrt(re ** 2 + im ** 2)`` and floored at 1e-6 before the log: the forward is finite over
    the dropout trial's all-zero STFT frames, but sqrt's derivative there is 1/0 and the
    floor's zero gradient makes it NaN, a backward event on the spatial filter. The replay
    names SqrtBackward0 on its line, the complex modulus ``.abs()`` in the hint, and trial 5:
    the node's gradient has every filter of every trial as a row ``(B * 6, F, frames)``, read
    back as samples where the reshape's backward unflattens it (it named no sample before)."""
    ev, bundle = fire(train_tangent, "make_spectral", tmp_path, bad={"dropout_row": 5})
    assert (ev["step"], ev["phase"], ev["params"]) == (3, "backward", ["spatial.weight"]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["made"], o["samples"]) == (
        "backward", "", "SqrtBackward0", "nan", [5]), o
    assert o["source"] == line_of("amp = (spec.real ** 2 + spec.imag ** 2).sqrt()"), o
    assert rep["cause"] == "invalid" and "torch.complex(re, im).abs()" in rep["hint"], rep["hint"]


def test_float16_square_of_a_recording_in_nanovolts_names_the_data(tmp_path):
    """ShallowConvNet (with braindecode's safe log) under float16 autocast with a GradScaler:
    one recording exported in nV, 1000x the others' µV, and the square of its filtered
    signal passes float16's 65504. The replay names the square on its line, the record,
    overflow, and the record's data out of scale, not only a wider type."""
    ev, bundle = fire(train_eeg, "make_shallow_safe", tmp_path, fp16=True,
                      bad={"scaled_row": 3})
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "", [3]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["made"], o["dtype"], o["samples"]) == (
        "aten.mul", "+inf", "float16", [3]), o
    assert o["source"] == line_of("power = self.pool(x * x)"), o
    assert rep["cause"] == "overflow" and "sample(s) 3 of batch reach" in rep["hint"], rep["hint"]
    assert "out of scale" in rep["hint"] and "--try drop=3" in rep["hint"], rep["hint"]


def test_float16_square_of_a_recording_in_volts_underflows_and_names_the_data(tmp_path):
    """The converse: one recording left in volts among µV ones, whose squares (1e-10)
    float16 rounds to 0, and the log of the pooled power is -inf. The replay names the log,
    the record, underflow with float32 as the type that holds the value, and (new) the
    record's data as 1e5x and more below every other record's: before, the hint spoke of the
    type only, and a user would have cast to float32 and kept the record in the wrong unit."""
    ev, bundle = fire(train_eeg, "make_shallow", tmp_path, fp16=True, bad={"volts_row": 3})
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "", [3]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["made"], o["dtype"], o["samples"]) == ("aten.log", "-inf", "float16", [3]), o
    assert o["source"] == line_of("feats = torch.log(power)  # the bug"), o
    assert rep["cause"] == "underflow" and "float32 holds it" in rep["hint"], rep["hint"]
    assert "sample(s) 3 of batch reach only" in rep["hint"], rep["hint"]
    assert "volts among microvolts" in rep["hint"] and "--try drop=3" in rep["hint"], rep["hint"]


def test_relative_band_power_of_a_blank_trial_names_the_ratio_and_the_trial(tmp_path):
    """Relative band powers from ``torch.fft.rfft`` of learned spatial filters: a trial the
    acquisition wrote as zeros on every electrode has a total power of 0, and its band /
    total is 0/0. The replay names the division on its line (past the FFT), the trial, the
    eps, and dropping the trial makes the step finite."""
    ev, bundle = fire(train_tangent, "make_band_power", tmp_path,
                      bad={"flat": (5, slice(None))})
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "", [5]), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"]) == ("aten.div", "nan", [5]), o
    assert o["source"] == line_of("rel = (power @ self.bands.T) / power.sum(-1"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert "d.clamp_min(eps)" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_class_weight_0_for_unscored_epochs_names_the_batch_of_only_that_class(tmp_path):
    """Sleep-staging style class weights with 0 for the unscored class, and a recording's
    unscored tail read in order fills one batch: CrossEntropyLoss divides by a total target
    weight of 0. The replay names nll_loss and says every target is of the class weighted 0."""
    model = M.make_eegnet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 1.0, 1.0, 0.0]))
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="biosignals_models:make_eegnet") as rec:
            for step in range(3):
                x, y = M.mi_batch(g)
                if step == 2:
                    y[:] = 3
                loss = rec.loss_fn(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (2, "loss"), ev
    rep = nanreplay_json(info.value.bundle_path)
    assert (rep["origin"]["op"], rep["cause"]) == ("aten.nll_loss_forward", "invalid"), rep
    assert "total target weight of 0" in rep["hint"], rep["hint"]
    assert "all of class 3, whose weight is 0" in rep["hint"], rep["hint"]


def test_unguarded_runs_go_nan_without_the_recorder(tmp_path):
    """Unrecorded, the planted bugs above end in NaN weights (the events are no false
    alarms)."""
    for model in (train_eeg("make_shallow", None, record=False, bad={"dropout_row": 5}),
                  train_ecg(None, record=False)):
        assert not all(torch.isfinite(p).all() for p in model.parameters())


def without_onednn(run):
    """``run()`` with oneDNN off: its float16 depthwise convolution (EEGNet's separable
    ``(1, 16)`` conv, groups = channels) took minutes a step on an Intel Xeon with AVX512-FP16,
    where PyTorch's own kernel takes 0.1 s (on the AMD EPYC both are fast). Both copies of a
    run compared run alike."""
    with warnings.catch_warnings():  # (flags() also sets oneDNN's TF32, which warns here)
        warnings.filterwarnings("ignore", "TF32 acceleration on top of oneDNN")
        with torch.backends.mkldnn.flags(enabled=False):
            return run()


@pytest.mark.parametrize("run", ["shallow_safe", "eegnet", "eegnet_fp16", "reeig", "ecg_amp",
                                 "attention", "spectral_abs"])
def test_healthy_runs_raise_nothing_and_train_the_same(tmp_path, run):
    """braindecode's safe log over the dropout trial, EEGNet with accumulation and its
    max-norm constraints (and under float16 autocast with a GradScaler), the tangent space with ReEig's eigenvalue floor over a flat
    electrode, the ECG ResNet under bf16 autocast with a floored ``pos_weight``, and the
    channel attention's -inf padding mask, and the log-amplitude spectra by ``spec.abs()``
    (gradient 0 at 0) over the dropout trial: no event, bit-identical weights with and without
    the recorder."""
    runs = {
        "shallow_safe": lambda rec: train_eeg("make_shallow_safe", tmp_path, record=rec,
                                              bad={"dropout_row": 5}),
        "eegnet": lambda rec: train_eeg("make_eegnet", tmp_path, record=rec, accumulate=2),
        "eegnet_fp16": lambda rec: without_onednn(
            lambda: train_eeg("make_eegnet", tmp_path, record=rec, fp16=True)),
        "reeig": lambda rec: train_tangent("make_tangent_reeig", tmp_path, record=rec,
                                           bad={"flat": (9, 2)}),
        "ecg_amp": lambda rec: train_ecg(tmp_path, record=rec, floor=1.0, amp=True),
        "attention": lambda rec: train_attention(tmp_path, record=rec),
        "spectral_abs": lambda rec: train_tangent("make_spectral_abs", tmp_path, record=rec,
                                                  bad={"dropout_row": 5}),
    }
    recorded, plain = runs[run](True), runs[run](False)
    assert not list(tmp_path.glob("*.nan"))
    assert_same_weights(recorded, plain)

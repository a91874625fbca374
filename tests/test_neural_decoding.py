"""End to end on neural decoding (``neural_decoding_models``): an LFADS-style sequential VAE
of binned spike counts from two sessions of different neuron counts stitched by per-session
read-in and read-out layers (Poisson NLL at log rates over padded trials' real bins,
coordinated dropout, a KL to a learned prior, gradient clipping); a CEBRA-style encoder of
calcium imaging (dF/F over a rolling percentile baseline, or a z-score) trained with InfoNCE
over time-offset positives; a Poisson GLM with a spike-history filter from a DataLoader. Each
planted failure of the domain fires under the recorder and is replayed with the CLI; the
healthy versions raise no event and train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import neural_decoding_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("neural_decoding_models.py", text)


def origin_of(rep: dict) -> tuple:
    o = rep["origin"]
    return rep["reproduced"], o["phase"], o["module"], o["op"], o["made"], o["samples"]


def train_lfads(crit, out_dir, make: str = "make_lfads", steps: int = 3, short: tuple = (),
                silent: tuple = (), eps: float = 1e-8, dropout: bool = False,
                record: bool = True, aborted: tuple = (), bf16: bool = False):
    """Adam with gradient clipping, sessions alternating by batch, as LFADS trains;
    ``short``: trials of the last batch that end half-way (padded, masked), ``aborted``: that
    have no bin (mask all 0); ``silent``: neurons of session 1 that never fire;
    ``dropout``: coordinated dropout; ``bf16``: the forward under bf16 autocast (the loss in
    float32)."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=eps)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(1)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"neural_decoding_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step in range(steps):
            session = step % 2
            last = step == steps - 1
            counts, mask = M.spike_batch(g, session, short=short if last else (),
                                         aborted=aborted if last else (),
                                         silent=silent if session == 1 else ())
            x, held = M.coordinated_dropout(g, counts) if dropout else (counts, None)
            opt.zero_grad()
            extra = (held,) if dropout else ()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                out = model(x, mask, session)
            out = tuple(t.float() for t in out)
            loss_fn(out, counts, mask, *extra).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 200.0)
            opt.step()
    return model


def train_cebra(crit, out_dir, make: str = "make_calcium", steps: int = 3, dead: tuple = (),
                offset: dict | None = None, record: bool = True):
    """Adam on InfoNCE at reference bin 5; the data conditions in the last batch."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"neural_decoding_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step in range(steps):
            last = step == steps - 1
            f = M.calcium_batch(g, dead=dead if last else (), offset=offset if last else None)
            opt.zero_grad()
            loss_fn(model(f), 5).backward()
            opt.step()
    return model


def train_glm(out_dir, steps: int = 3, wrapped: tuple = (), record: bool = True):
    """SGD on the Poisson NLL from a DataLoader; ``wrapped``: bins of the last batch."""
    model = M.make_glm()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    parts = [M.glm_batch(g, wrapped=wrapped if s == steps - 1 else ()) for s in range(steps)]
    data = TensorDataset(*[torch.cat([p[i] for p in parts]) for i in range(3)])
    rec = FlightRecorder(model, opt, loss_fn=M.glm_nll, out_dir=out_dir,
                         factory="neural_decoding_models:make_glm") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else M.glm_nll
        for stim, past, counts in DataLoader(data, batch_size=32):
            opt.zero_grad()
            loss_fn(model(stim, past), counts).backward()
            opt.step()
    return model


def fire(train, *args, **kwargs):
    with pytest.raises(NonFiniteError) as info:
        train(*args, **kwargs)
    return info.value.event, info.value.bundle_path


def test_hand_written_infonce_at_a_small_temperature_names_the_exp_and_cross_entropy(tmp_path):
    """InfoNCE written ``-log(e.diagonal() / e.sum(1))`` of ``e = exp(sim / 0.01)``: a cosine
    similarity near 1 is 100 over the temperature and exp overflows float32 at once; inf/inf
    is NaN. The replay names the exp, an overflow in every trial, and the softmax by hand it
    was part of (divided on the next line): cross_entropy / log_softmax, not float64."""
    ev, bundle = fire(train_cebra, M.InfoNCE(temperature=0.01, stable=False), tmp_path)
    assert (ev["step"], ev["phase"]) == (0, "loss"), ev
    rep = nanreplay_json(bundle)
    assert origin_of(rep) == (True, "loss", "<loss>", "aten.exp", "+inf", list(range(6)))
    assert rep["origin"]["source"] == line_of("e = torch.exp(sim)"), rep["origin"]
    assert rep["cause"] == "overflow", rep
    h = rep["hint"]
    assert line_of("return -torch.log(e.diagonal() / e.sum(1))") in h, h
    assert "a softmax written by hand" in h and "F.cross_entropy(s, target)" in h, h


def test_a_roi_reading_zero_all_trial_names_the_dff_division_and_the_dead_channel(tmp_path):
    """ROI 3 of trial 2 of the last batch reads 0 all trial (a cell out of the field of
    view): its rolling percentile baseline F0 is 0 and dF/F = (F - F0) / F0 is 0/0. The replay
    names the division on its line at that trial, and the dead channel (dim 2, channel 3) of
    the batch that no other trial has, to mask where the data is made."""
    ev, bundle = fire(train_cebra, M.InfoNCE(), tmp_path, dead=((2, 3),))
    assert (ev["step"], ev["phase"]) == (2, "forward"), ev
    rep = nanreplay_json(bundle)
    assert origin_of(rep) == (True, "forward", "", "aten.div", "nan", [2]), rep["origin"]
    assert rep["origin"]["source"] == line_of("x = (f - f0) / f0"), rep["origin"]
    assert rep["cause"] == "invalid", rep
    h = rep["hint"]
    assert "Sample(s) 2 read exactly 0 throughout channel(s) 3 (dim 2) of batch" in h, h
    assert "a dead channel of the record" in h and "--try drop=2" in h, h


def test_kl_to_a_learned_prior_whose_log_variance_drifted_names_that_parameter(tmp_path):
    """A checkpoint whose learned prior's log-variance is -110: ``exp`` of it underflows
    float32 to 0 and the KL's division by the prior's variance is +inf at the first step in
    every trial. The replay names the division in the model's forward, an underflow, and
    the parameter whose exp underflowed, to bound it, not the log-space list."""
    ev, bundle = fire(train_lfads, M.LFADSLoss(), tmp_path, make="make_lfads_drifted_prior")
    assert (ev["step"], ev["phase"]) == (0, "forward"), ev
    rep = nanreplay_json(bundle)
    assert origin_of(rep) == (True, "forward", "", "aten.div", "+inf", list(range(6)))
    assert rep["origin"]["source"] == line_of("/ self.prior_logvar.exp()"), rep["origin"]
    assert rep["cause"] == "underflow", rep
    h = rep["hint"]
    assert "the exp of the parameter prior_logvar (as low as -110)" in h, h
    assert "prior_logvar.clamp(min=-20)" in h and "log_softmax" not in h, h


def test_counts_over_each_neurons_batch_rate_name_the_neuron_silent_in_every_trial(
        tmp_path):
    """Session 1's neuron 3 never fires, and the model normalises each neuron's counts by its
    mean rate over the batch's real bins: 0/0 in that neuron's column at every bin of every
    trial. The replay names the division, the column, that no sample is to blame, and that
    the data holds that column at 0 in every row: drop such units, or rates over the dataset."""
    ev, bundle = fire(train_lfads, M.LFADSLoss(), tmp_path, make="make_lfads_rate_norm",
                      silent=(3,))
    assert (ev["step"], ev["phase"]) == (1, "forward"), ev
    rep = nanreplay_json(bundle)
    assert origin_of(rep) == (True, "forward", "", "aten.div", "nan", list(range(6)))
    assert rep["origin"]["source"] == line_of("counts = counts / (counts * mask"), rep["origin"]
    assert rep["cause"] == "invalid", rep
    h = rep["hint"]
    assert "in the same column(s) [3] of every one of the 96 rows" in h, h
    assert "column(s) 3 of args[0] hold 0 in every row of the batch as given" in h, h
    assert "a neuron silent in every trial of the batch" in h, h


def test_one_pass_variance_of_raw_fluorescence_on_a_camera_offset_is_precision(tmp_path):
    """Trials 1 and 4 come from a rig whose 16-bit camera offset (30000) was not subtracted:
    a dim cell's small swings ride on a big number, and the z-score's one-pass variance
    E[F^2] - E[F]^2 cancels below 0 in float32; sqrt of it is NaN there. The replay names the
    sqrt at those trials, precision, and torch.var / centring first."""
    ev, bundle = fire(train_cebra, M.InfoNCE(), tmp_path, make="make_calcium_zscore",
                      offset={1: 30000.0, 4: 30000.0})
    assert (ev["step"], ev["phase"]) == (2, "forward"), ev
    rep = nanreplay_json(bundle)
    assert origin_of(rep) == (True, "forward", "", "aten.sqrt", "nan", [1, 4]), rep["origin"]
    assert rep["origin"]["source"] == line_of("x = (f - mean) / var.sqrt()"), rep["origin"]
    assert rep["cause"] == "precision", rep
    assert "E[x²] − E[x]²" in rep["hint"] and "torch.var" in rep["hint"], rep["hint"]


def test_adam_without_eps_and_a_neuron_silent_all_session_names_its_read_in(tmp_path):
    """Neuron 3 of session 1 never fires (lost after sorting): its read-in column's gradient
    is exactly 0 at every step, and Adam with eps=0 divides 0 by 0 at the first step that
    trains session 1. An optimizer event; the replay names the read-in weight and eps."""
    ev, bundle = fire(train_lfads, M.LFADSLoss(), tmp_path, silent=(3,), eps=0.0)
    assert (ev["step"], ev["phase"]) == (1, "optimizer"), ev
    rep = nanreplay_json(bundle, code=None)
    assert rep["cause"] == "optimizer", rep
    h = rep["hint"]
    assert "read_in.1.weight" in h and "set eps > 0" in h and "exactly 0" in h, h


def test_smoothness_penalty_over_padded_bins_is_a_backward_only_sqrt_pole(tmp_path):
    """The factors' step lengths ``sqrt(|f_t - f_{t-1}|^2 + eps)`` masked to real bins, with
    eps=0: trials 1 and 4 end half-way, their padded steps are exactly 0, sqrt(0) is finite
    but its derivative is +inf there. A backward event; the replay names SqrtBackward0 in the
    loss at those trials, invalid, and the eps that is 0 / vector_norm."""
    ev, bundle = fire(train_lfads, M.LFADSLoss(smooth=0.1, smooth_eps=0.0), tmp_path,
                      short=(1, 4))
    assert (ev["step"], ev["phase"]) == (2, "backward"), ev
    rep = nanreplay_json(bundle)
    assert origin_of(rep) == (True, "backward", "<loss>", "SqrtBackward0", "+inf", [1, 4])
    assert rep["origin"]["source"] == line_of("length = (step.pow(2).sum(-1)"), rep["origin"]
    assert rep["cause"] == "invalid", rep
    h = rep["hint"]
    assert "vector_norm" in h and "the eps added to that input is exactly 0" in h, h


def test_a_missing_count_wrapped_to_65535_in_the_glm_history_names_that_bin(tmp_path):
    """A missing count of -1 read back from a uint16 array is 65535 in bin 7's spike history:
    the GLM's exp(log rate) overflows there. The replay names exp at that bin, overflow, the
    bin's data out of scale with the batch, to fix or filter, and that the value is uint16's
    largest, where a -1 wraps to."""
    ev, bundle = fire(train_glm, tmp_path, wrapped=(7,))
    assert (ev["step"], ev["phase"]) == (2, "forward"), ev
    rep = nanreplay_json(bundle)
    assert origin_of(rep) == (True, "forward", "", "aten.exp", "+inf", [7]), rep["origin"]
    assert rep["origin"]["source"] == line_of("return torch.exp(self.stim(stim)"), rep["origin"]
    assert rep["cause"] == "overflow", rep
    h = rep["hint"]
    assert "sample(s) 7 of args[1] reach 6.55e+04" in h, h
    assert "exactly 65535 = 2**16 - 1, uint16's largest value" in h and "wraps to it" in h, h


def test_an_aborted_trial_with_no_bin_names_the_masked_mean_pool_and_the_empty_mask(
        tmp_path):
    """Trial 3 of the last batch has no bin left after alignment (its mask all 0): the
    encoder's masked mean pool over time divides 0 by 0 there. The replay names the division
    at that trial and the empty mask, to filter such trials or floor the count."""
    ev, bundle = fire(train_lfads, M.LFADSLoss(), tmp_path, aborted=(3,))
    assert (ev["step"], ev["phase"]) == (2, "forward"), ev
    rep = nanreplay_json(bundle)
    assert origin_of(rep) == (True, "forward", "", "aten.div", "nan", [3]), rep["origin"]
    assert rep["origin"]["source"] == line_of("pooled = (h * mask[..., None]).sum(1)")
    assert rep["cause"] == "invalid", rep
    h = rep["hint"]
    assert "Sample(s) 3 are empty records: args[1] (0/1 data)" in h and "--try drop=3" in h, h


def test_glm_at_too_high_a_learning_rate_diverges_and_is_named_a_divergence(tmp_path):
    """SGD at lr=5 on the canonical exp link: one step sends the weights to 1e13 and the
    next forward's exp overflows. The replay names exp, an overflow, and the weights' jump
    the step before: lower the learning rate or clip, not a wider type."""
    model = M.make_glm()
    opt = torch.optim.SGD(model.parameters(), lr=5.0)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info, FlightRecorder(
            model, opt, loss_fn=M.glm_nll, out_dir=tmp_path,
            factory="neural_decoding_models:make_glm") as rec:
        for _ in range(6):
            stim, past, counts = M.glm_batch(g)
            opt.zero_grad()
            rec.loss_fn(model(stim, past), counts).backward()
            opt.step()
    assert (info.value.event["step"], info.value.event["phase"]) == (3, "forward")
    rep = nanreplay_json(info.value.bundle_path)
    assert origin_of(rep)[:5] == (True, "forward", "", "aten.exp", "+inf"), rep["origin"]
    assert rep["cause"] == "overflow", rep
    # (the gradient norm's jump at step 1, 1000x the one step before, is the first sign)
    assert "the gradient norm had jumped at step 1" in rep["hint"] and "lower the learning " \
        "rate" in rep["hint"], rep["hint"]
    assert "weight_jump" in [p["kind"] for p in rep["precursors"]], rep["precursors"]


def test_an_aborted_trial_in_the_second_sessions_micro_batch_is_named_there(tmp_path):
    """Gradient accumulation over both sessions' batches (12 and 9 neurons, each through its
    own read-in) in one step: trial 2 of session 1's micro-batch has no bin. The replay
    names micro-batch 1 and trial 2 of it, and the empty mask."""
    model = M.make_lfads()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    crit = M.LFADSLoss()
    with pytest.raises(NonFiniteError) as info, FlightRecorder(
            model, opt, loss_fn=crit, out_dir=tmp_path,
            factory="neural_decoding_models:make_lfads") as rec:
        for step in range(2):
            opt.zero_grad()
            for session in (0, 1):
                bad = (2,) if (step, session) == (1, 1) else ()
                counts, mask = M.spike_batch(g, session, aborted=bad)
                (rec.loss_fn(model(counts, mask, session), counts, mask) / 2).backward()
            opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["micro_batch"]) == (1, "forward", 1), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["micro_batch"], o["op"], o["samples"], o["batch_size"]) == (
        1, "aten.div", [2], 6), o
    assert "Sample(s) 2 are empty records" in rep["hint"], rep["hint"]


def test_dead_channels_are_a_channel_dead_in_the_named_samples_alone_not_padding():
    """A ROI at 0 all trial in trial 2 alone is a dead channel (dim 2); a trial padded with
    zero bins at its end is not (a run to the end of the time dim); nor is one alive
    elsewhere in another trial dead too, nor 0/1 data, nor a trial blank everywhere."""
    from replay.dead_channels import dead_channels_of

    f = M.calcium_batch(torch.Generator().manual_seed(0))
    dead = f.clone()
    dead[2, :, 3] = 0
    assert dead_channels_of(dead, 0, [2]) == [(2, [3])]
    padded = f.clone()
    padded[2, 10:] = 0
    assert dead_channels_of(padded, 0, [2]) == []
    also = dead.clone()
    also[4, :, 3] = 0  # (dead in a trial not named too)
    assert dead_channels_of(also, 0, [2]) == []
    assert dead_channels_of((dead > 100).float(), 0, [2]) == []  # (0/1 data)
    blank = f.clone()
    blank[2] = 0
    assert dead_channels_of(blank, 0, [2]) == []


def test_integer_code_names_16_and_32_bit_maxima_only():
    from replay.outliers import integer_code

    assert "uint16's largest value" in integer_code(65535.0)
    assert "wraps to it" in integer_code(65535.0) and "wraps" not in integer_code(32767.0)
    assert integer_code(255.0) == "" and integer_code(65534.0) == ""
    assert integer_code(float("inf")) == "" and integer_code(65535.5) == ""


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values()))


def test_healthy_lfads_cebra_and_glm_train_bit_identically_with_and_without_the_recorder(
        tmp_path):
    """Padded trials, a silent neuron, coordinated dropout and the smoothness penalty with
    its eps, in float32 and under bf16 autocast; dF/F of live ROIs at temperature 1; the GLM on clean counts: no event, and the
    recorder changes nothing."""
    kw = {"short": (1, 4), "silent": (3,), "dropout": True}
    crit = M.LFADSLoss(smooth=0.1)
    assert same_weights(train_lfads(crit, tmp_path, **kw),
                        train_lfads(crit, tmp_path, record=False, **kw))
    assert same_weights(train_lfads(crit, tmp_path, bf16=True, **kw),
                        train_lfads(crit, tmp_path, record=False, bf16=True, **kw))
    assert same_weights(train_cebra(M.InfoNCE(), tmp_path),
                        train_cebra(M.InfoNCE(), tmp_path, record=False))
    assert same_weights(train_glm(tmp_path), train_glm(tmp_path, record=False))
    assert not list(tmp_path.glob("*.nan"))

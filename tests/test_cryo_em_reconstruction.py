"""End to end on cryo-EM reconstruction written as cryoDRGN writes it
(``cryo_em_reconstruction_models``): a VAE over particle images normalised by their std and
Wiener-filtered in Fourier space (rfft2/irfft2, complex tensors), a coordinate decoder with
Fourier features on the central slice rotated by each particle's quaternion, a CTF from the
STAR file's defocus, per-particle axis-angle pose refinement, and a learned CTF estimator over
log power spectra of counting-mode patches. Trained as cryoDRGN trains: a DataLoader, Adam, a
step schedule, gradient clipping (and accumulation under bf16 autocast). Each planted bug of
the domain fires under the recorder and is replayed with the CLI; the healthy versions raise
no event and train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import cryo_em_reconstruction_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("cryo_em_reconstruction_models.py", text)


def train(make: str, out_dir, record: bool = True, **plant):
    """Four steps of 8 particles (the planted particle 29 is row 5 of the last step).
    Returns the model."""
    ctf_net = make.startswith("make_ctfnet")
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    data = M.counting_patches() if ctf_net else M.particles(**plant)
    crit = torch.nn.MSELoss() if ctf_net else M.vae_loss
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    torch.manual_seed(1)  # (the reparameterisation's randn_like)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"cryo_em_reconstruction_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for batch in loader:
            opt.zero_grad()
            if ctf_net:
                loss = loss_fn(model(batch[0]), batch[1])
            else:
                loss = loss_fn(*model(*batch))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    return model


def fire(make: str, tmp_path, **plant):
    with pytest.raises(NonFiniteError) as info:
        train(make, tmp_path, **plant)
    return info.value.event, info.value.bundle_path


EPS_ZERO = "the eps added to that input is exactly 0"


def test_blank_crop_normalised_by_its_std_names_the_division_and_the_particle(tmp_path):
    """A crop at the micrograph's edge is all zeros: its std is 0 and the per-particle
    normalisation is 0/0 on that particle only."""
    ev, bundle = fire("make_vae_no_eps", tmp_path, blank=29)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "", [5]), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "", "aten.div", "nan", [5]), o
    assert o["source"] == line_of("return (img - mean) / (std + eps)"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert EPS_ZERO in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_nan_pixel_in_a_particle_stack_is_an_input_event_on_that_particle(tmp_path):
    """A NaN pixel in one particle's crop (the stack as read from the MRC file): an input
    event on that particle, before the model ran, with the data pipeline to check."""
    ev, bundle = fire("make_vae", tmp_path, nan_pixel=29)
    assert (ev["step"], ev["phase"], ev["samples"]) == (3, "input", [5]), ev
    rep = nanreplay_json(bundle)
    assert (rep["origin"]["phase"], rep["origin"]["samples"], rep["cause"]) == (
        "input", [5], "input"), rep
    assert "the batch itself holds NaN/Inf" in rep["hint"], rep["hint"]


def test_zero_quaternion_from_the_pose_initialiser_names_its_normalisation(tmp_path):
    """The pose search left one particle at quaternion (0, 0, 0, 0); normalising it by its
    norm without eps is 0/0 in that row."""
    ev, bundle = fire("make_vae_no_eps", tmp_path, zero_quat=29)
    assert (ev["step"], ev["module"], ev["samples"]) == (3, "", [5]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.div", "nan", [5]), o
    assert o["source"] == line_of("q = q / (q.norm(dim=-1, keepdim=True) + eps)"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]


def test_wiener_filter_without_noise_term_is_0_over_0_at_every_images_dc(tmp_path):
    """1/SNR = 0 and a phase-only CTF (no amplitude contrast): ctf is exactly 0 at the DC
    term, so ``F * ctf / ctf^2`` is 0/0 there in every image, at the first step."""
    ev, bundle = fire("make_vae_no_noise", tmp_path)
    assert (ev["step"], ev["module"], ev["samples"]) == (0, "", list(range(8))), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "", "aten.div", "nan", list(range(8))), o
    assert o["source"] == line_of("f * ctf / (ctf ** 2 + self.inv_snr)"), o
    assert rep["cause"] == "invalid" and EPS_ZERO in rep["hint"], rep["hint"]


def test_defocus_in_angstrom_where_log_was_expected_overflows_exp_on_that_particle(tmp_path):
    """One STAR row holds its defocus in Å (15000) where the dataset keeps log(Å): exp
    overflows on that particle and the CTF's sin(inf) is NaN. The replay names the exp, the
    particle, overflow, and the out-of-scale data; dropping the particle makes the step
    finite."""
    ev, bundle = fire("make_vae", tmp_path, raw_defocus=29)
    assert (ev["step"], ev["module"], ev["samples"]) == (3, "", [5]), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.exp", "+inf", [5]), o
    assert o["source"] == line_of("defocus = torch.exp(defocus)"), o
    assert rep["cause"] == "overflow" and "out of scale" in rep["hint"], rep["hint"]
    assert "args[2]" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_refined_defocus_row_loaded_in_angstrom_names_the_untouched_embedding_row(tmp_path):
    """Per-particle defocus refinement: an embedding of log(Å) loaded from the STAR file,
    whose row 29 holds 15000 (Å). No batch looks that row up before step 3, so Adam never
    moved it; then exp overflows on that particle. The hint names the parameter and its row,
    says its optimizer state is still 0 (the loaded value), and sends the user to the
    initialisation, not to the learning rate."""
    ev, bundle = fire("make_refine_ctf", tmp_path)
    assert (ev["step"], ev["module"], ev["samples"]) == (3, "", [5]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.exp", "+inf", [5]), o
    assert o["source"] == line_of("torch.exp(self.log_df(idx))"), o
    h = rep["hint"]
    assert rep["cause"] == "overflow" and "parameter log_df.weight" in h, h
    assert "row(s) 29 of log_df.weight" in h and "fix that initialisation" in h, h
    assert "lower the learning rate" not in h and "lower its learning rate" not in h, h


def test_zero_initialised_axis_angle_pose_correction_names_sqrt_backward(tmp_path):
    """Per-particle pose corrections start at the identity (axis-angle 0). Rodrigues' formula
    with ``theta = sqrt(sum v^2)`` and an eps only in the division is finite forward, but
    sqrt's gradient at 0 is 0/0: a backward event at step 0, in every row, named at the
    sqrt's node with the vector-norm advice."""
    ev, bundle = fire("make_vae_pose_refine", tmp_path)
    assert (ev["step"], ev["phase"]) == (0, "backward"), ev
    assert ev["detail"].endswith("first pose_delta.weight"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"]) == (
        "backward", "", "SqrtBackward0", list(range(8))), o
    assert o["source"] == line_of("theta = torch.sqrt((v * v).sum(-1, keepdim=True))"), o
    assert rep["cause"] == "invalid" and "vector_norm" in rep["hint"], rep["hint"]


def test_log_power_spectrum_of_mean_subtracted_counts_names_the_log_at_dc(tmp_path):
    """Counting-mode patches hold integer counts, so subtracting the mean leaves a DC term of
    exactly 0 and log(|F|^2) is -inf there in every patch: the CTF estimator's first Linear
    makes NaN of it. The replay names the log, not the Linear."""
    ev, bundle = fire("make_ctfnet", tmp_path)
    assert (ev["step"], ev["module"], ev["samples"]) == (0, "", list(range(8))), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "", "aten.log", "-inf", list(range(8))), o
    assert o["source"] == line_of("return self.net(torch.log(ps + self.eps).flatten(1))"), o
    assert rep["cause"] == "invalid" and "pole at 0" in rep["hint"], rep["hint"]
    assert EPS_ZERO in rep["hint"], rep["hint"]


def test_accumulated_bf16_step_names_the_blank_crop_in_its_micro_batch(tmp_path):
    """Micro-batches of 4 under bf16 autocast, two per optimizer step: the blank crop (29) is
    row 1 of the last step's second micro-batch, and the replay names that micro-batch."""
    model = M.make_vae_no_eps()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(M.particles(blank=29), batch_size=4)
    torch.manual_seed(1)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.vae_loss, out_dir=tmp_path,
                            factory="cryo_em_reconstruction_models:make_vae_no_eps") as rec:
            for i, batch in enumerate(loader):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(*batch)
                (rec.loss_fn(*out) / 2).backward()
                if i % 2 == 1:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                    opt.zero_grad()
    ev = info.value.event
    assert (ev["step"], ev["micro_batch"], ev["samples"]) == (3, 1, [1]), ev
    rep = nanreplay_json(info.value.bundle_path, "--try", "drop=1")
    o = rep["origin"]
    assert (o["op"], o["micro_batch"], o["samples"], rep["cause"]) == (
        "aten.div", 1, [1], "invalid"), rep
    assert o["source"] == line_of("return (img - mean) / (std + eps)"), o
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_masking_only_the_dc_term_names_the_patch_with_another_exact_zero(tmp_path):
    """The DC term's -inf dropped by a ``torch.where``, but patch 6's integer counts also give
    an exact 0 at a Nyquist term: the replay names the log on that patch alone (the DC
    infinities the where took back are no sample's NaN)."""
    ev, bundle = fire("make_ctfnet_dc_masked", tmp_path)
    assert (ev["step"], ev["module"], ev["samples"]) == (0, "", [6]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.log", "-inf", [6]), o
    assert o["source"] == line_of("logps = torch.log(ps)"), o
    assert rep["cause"] == "invalid" and "clamp_min(eps)" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("make", ["make_vae", "make_ctfnet_masked"])
def test_healthy_runs_raise_nothing_and_train_the_same(tmp_path, make):
    """The VAE with its eps and noise term (blank-free data), and the CTF estimator whose
    log(0) = -inf at every exact zero is dropped by a ``torch.where`` inside forward: no event,
    bit-identical weights with and without the recorder."""
    recorded = train(make, tmp_path)
    plain = train(make, tmp_path, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_unrecorded_blank_crop_turns_the_weights_nan(tmp_path):
    """Without the recorder the blank crop's NaN reaches every weight (Adam applies it): the
    event above is the bug, not a false alarm."""
    model = train("make_vae_no_eps", tmp_path, record=False, blank=29)
    assert not all(torch.isfinite(p).all() for p in model.parameters())


def train_local(out_dir, off_grid: int | None = None, record: bool = True):
    """Local refinement by pose marginalisation: the model's -inf outside each particle's
    search window is intended (``allow_inf``), the loss's logsumexp reads the rest."""
    model = M.make_pose_marginal()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(M.local_priors(off_grid=off_grid), batch_size=8)
    rec = FlightRecorder(model, opt, loss_fn=M.marginal_nll, out_dir=out_dir, allow_inf=[""],
                         factory="cryo_em_reconstruction_models:make_pose_marginal"
                         ) if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else M.marginal_nll
        for batch in loader:
            loss = loss_fn(model(*batch))
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    return model


def test_local_search_window_with_no_candidate_names_the_logsumexp_and_the_particle(tmp_path):
    """A particle whose prior pose came from another refinement lies outside every
    candidate's window: its row of masked log-likelihoods is all -inf, the marginal's
    logsumexp is -inf and the loss +inf. The replay names the logsumexp in the loss, that
    particle, the fully masked row, and dropping the particle makes the step finite."""
    with pytest.raises(NonFiniteError) as info:
        train_local(tmp_path, off_grid=29)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "loss", "+inf"), ev
    rep = nanreplay_json(info.value.bundle_path, "--try", "drop=5")
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"]) == (
        "loss", "<loss>", "aten.logsumexp", [5]), o
    assert o["source"] == line_of("return -torch.logsumexp(logits, -1).mean()"), o
    assert rep["cause"] == "invalid" and "every entry is -inf" in rep["hint"], rep["hint"]
    assert "keep at least one" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_local_search_windows_masked_to_minus_inf_train_the_same(tmp_path):
    """Every particle with candidates in its window: the -inf of the others stays inside
    the marginal, no event, bit-identical weights with and without the recorder."""
    recorded = train_local(tmp_path)
    plain = train_local(tmp_path, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_fp16_autocast_of_an_adu_patch_amplitude_names_the_cast_and_the_patch(tmp_path):
    """The CTF estimator over amplitude spectra under float16 autocast: the FFT runs in
    complex64, but the first Linear casts its input to float16, where the DC amplitude of a
    patch in ADU (1000x counts) overflows. The replay names the cast in that Linear, the
    patch, float16's range, and the patch's out-of-scale data."""
    model = M.make_ctfnet_amplitude()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(M.counting_patches(adu=29), batch_size=8)
    crit = torch.nn.MSELoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="cryo_em_reconstruction_models:make_ctfnet_amplitude") as rec:
            for x, y in loader:
                with torch.autocast("cpu", dtype=torch.float16):
                    out = model(x)
                loss = rec.loss_fn(out.float(), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["module"], ev["kind"], ev["samples"]) == (3, "net.0", "+inf", [5]), ev
    rep = nanreplay_json(info.value.bundle_path, "--try", "drop=5")
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"]) == ("net.0", "aten._to_copy", [5]), o
    assert o["source"] == line_of("return self.net(torch.fft.rfft2(counts).abs().flatten(1))"), o
    h = rep["hint"]
    assert rep["cause"] == "overflow" and "float16's largest value" in h, h
    assert "out of scale" in h and "--try drop=5" in h, h
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]

"""End to end on accelerated MRI reconstruction written as fastMRI's VarNet is
(``mri_reconstruction_models``): multi-coil k-space as real/imag channels, the undersampling
mask and the body outline passed into ``forward``, k-space normalised by its max, coil maps from
the ACS lines normalised by their root-sum-of-squares, unrolled cascades of data-consistency
steps with a learned step size and CNN refiners, the magnitude image, and SSIM written out
(``avg_pool2d`` means/variances, ``C1``/``C2``) plus L1. Trained as fastMRI trains: a
DataLoader, Adam, gradient clipping (and float16 autocast). Each planted bug fires under the
recorder and is replayed with the CLI; the healthy run raises no event and trains
bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import mri_reconstruction_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("mri_reconstruction_models.py", text)


def train(make: str, out_dir, record: bool = True, per_slice: bool = False,
          amp: bool = False, three_term: bool = False, **plant):
    """Four steps of 8 slices (the planted slice 29 is row 5 of the last step)."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = M.SSIMLoss(per_slice=per_slice, three_term=three_term)
    loader = torch.utils.data.DataLoader(M.slices(**plant), batch_size=8)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"mri_reconstruction_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for kspace, mask, body, target in loader:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
                out = model(kspace, mask, body)
            loss = loss_fn(out.float(), target)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    return model


def fire(make: str, tmp_path, **plant):
    with pytest.raises(NonFiniteError) as info:
        train(make, tmp_path, **plant)
    return info.value.event, info.value.bundle_path


EPS_ZERO = "the eps added to that input is exactly 0"


def test_padding_slice_normalised_by_its_max_names_the_division_and_the_blank_kspace(tmp_path):
    """A padding slice (all-zero k-space, outline and target) in a volume: normalising the
    masked k-space by its max without eps is 0/0 on that slice only. The hint names the
    blank k-space (args[0]) beside the empty outline, not only a mask to count over."""
    ev, bundle = fire("make_varnet_no_eps", tmp_path, padding=29)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "", [5]), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "", "aten.div", "nan", [5]), o
    assert o["source"] == line_of("k = k / (scale + self.eps)"), o
    h = rep["hint"]
    assert rep["cause"] == "invalid" and "0 by 0" in h and EPS_ZERO in h, h
    assert "Sample(s) 5 are empty records: args[2] (0/1 data)" in h, h
    assert "(or, as args[0] is 0 everywhere in their rows too, a max, a norm" in h, h
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_corrupt_kspace_sample_is_an_input_event_on_that_slice(tmp_path):
    """One NaN k-space sample in slice 29 (a corrupt line of the HDF5 file): an input event
    on that slice before the model ran."""
    ev, bundle = fire("make_varnet", tmp_path, nan_at=29)
    assert (ev["step"], ev["phase"], ev["samples"]) == (3, "input", [5]), ev
    rep = nanreplay_json(bundle)
    assert (rep["origin"]["phase"], rep["origin"]["samples"], rep["cause"]) == (
        "input", [5], "input"), rep
    assert "the batch itself holds NaN/Inf" in rep["hint"], rep["hint"]


def test_magnitude_of_the_image_cut_to_the_body_names_sqrt_backward(tmp_path):
    """The complex image is multiplied by the body outline, then ``sqrt(re^2 + im^2)`` with
    no eps: finite forward, but sqrt's gradient at the 0s outside the body is inf, and times
    the 0 of ``2 * re`` NaN: a backward event at step 0 in every slice, named at the sqrt's
    node with the complex-modulus advice."""
    ev, bundle = fire("make_varnet_raw_mag", tmp_path)
    assert (ev["step"], ev["phase"]) == (0, "backward"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"]) == (
        "backward", "", "SqrtBackward0", list(range(8))), o
    assert o["source"] == line_of("return torch.sqrt(x[..., 0] ** 2 + x[..., 1] ** 2 + self"), o
    h = rep["hint"]
    assert rep["cause"] == "invalid" and "torch.complex(re, im).abs()" in h, h
    assert EPS_ZERO in h, h


def test_ssim_with_a_per_slice_data_range_is_0_over_0_on_a_padding_slice(tmp_path):
    """fastMRI's SSIM with the data range of each target: a padding slice's target max is 0,
    so C1 = C2 = 0 and the SSIM ratio is 0/0 on that slice: a loss event, the loss's
    division, slice 5, with the blank target (the loss's args[1]) named."""
    ev, bundle = fire("make_varnet", tmp_path, per_slice=True, padding=29)
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["made"], o["samples"]) == (
        "loss", "<loss>", "aten.div", "nan", [5]), o
    assert o["source"] == line_of("s = ((2 * ux * uy + c1) * (2 * vxy + c2)) / ((ux"), o
    h = rep["hint"]
    assert rep["cause"] == "invalid" and "0 by 0" in h, h
    assert "as args[0] and loss_args[1] are 0 everywhere in their rows too" in h, h


def test_ssim_std_of_a_uniform_phantom_names_precision_at_the_sqrt(tmp_path):
    """SSIM's three-term form takes ``sqrt`` of ``E[y^2] - E[y]^2``: a uniform QA phantom's
    patches round that variance to -6e-7 (0 in float64) and the sqrt is NaN in the loss.
    The replay names the sqrt, slice 5, and precision with the stable-variance advice."""
    ev, bundle = fire("make_varnet", tmp_path, three_term=True, flat=29)
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("<loss>", "aten.sqrt", "nan", [5]), o
    assert o["source"] == line_of("sx, sy = torch.sqrt(vx), torch.sqrt(vy)"), o
    h = rep["hint"]
    assert rep["cause"] == "precision" and "catastrophic cancellation" in h, h


def test_unnormalised_slice_under_float16_autocast_overflows_the_coil_conv(tmp_path):
    """One slice left in the scanner's raw units (the per-volume normalisation skipped)
    under float16 autocast: the sensitivity model's conv casts its 1e6-scale input to
    float16, +inf. The replay names the cast in ``sens.conv``, slice 5, overflow, and the
    out-of-scale data."""
    ev, bundle = fire("make_varnet_unnormalised", tmp_path, amp=True, raw=29)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        3, "forward", "sens.conv", [5]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "sens.conv", "aten._to_copy", "+inf", [5]), o
    assert o["source"] == line_of("x = x + self.conv(x)"), o
    h = rep["hint"]
    assert rep["cause"] == "overflow" and "float16's largest value" in h, h
    assert "out of scale" in h and "--try drop=5" in h, h


@pytest.mark.parametrize("three_term", [False, True])
def test_healthy_run_raises_nothing_and_trains_the_same(tmp_path, three_term):
    """The VarNet with its eps's on clean slices, both SSIM forms: no event, bit-identical
    weights with and without the recorder."""
    recorded = train("make_varnet", tmp_path, three_term=three_term)
    plain = train("make_varnet", tmp_path, record=False, three_term=three_term)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_accumulated_bf16_step_names_the_padding_slice_in_its_micro_batch(tmp_path):
    """Micro-batches of 4 under bf16 autocast, two per optimizer step: the padding slice (29)
    is row 1 of the last step's second micro-batch, and the replay names that micro-batch."""
    model = M.make_varnet_no_eps()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = M.SSIMLoss()
    loader = torch.utils.data.DataLoader(M.slices(padding=29), batch_size=4)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="mri_reconstruction_models:make_varnet_no_eps") as rec:
            for i, (kspace, mask, body, target) in enumerate(loader):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(kspace, mask, body)
                (rec.loss_fn(out.float(), target) / 2).backward()
                if i % 2 == 1:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                    opt.zero_grad()
    ev = info.value.event
    assert (ev["step"], ev["micro_batch"], ev["module"], ev["samples"]) == (3, 1, "", [1]), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["micro_batch"], o["module"], o["op"], o["samples"]) == (1, "", "aten.div", [1]), o
    assert o["source"] == line_of("k = k / (scale + self.eps)"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]


def test_modl_hard_data_consistency_weight_of_0_is_0_over_0_off_the_mask(tmp_path):
    """MoDL's closed-form data consistency ``(mask * k + lam * F(S z)) / (mask + lam)`` with
    the learned weight started at 0 ("hard" DC): at every unsampled k-space entry it is 0/0,
    in every slice at step 0. The replay names the division on its line and the weight as the
    divisor's only eps, to keep positive by construction."""
    ev, bundle = fire("make_modl_hard_dc", tmp_path)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        0, "forward", "", list(range(8))), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "", "aten.div", "nan", list(range(8))), o
    assert o["source"] == line_of("k_dc = (mask * k + self.lam * fft2c("), o
    h = rep["hint"]
    assert rep["cause"] == "invalid" and "0 by 0" in h, h
    assert "the divisor is the data plus the parameter lam, a learned weight exactly 0" in h, h
    assert "softplus(lam) + eps" in h, h


def test_modl_with_a_positive_weight_raises_nothing_and_trains_the_same(tmp_path):
    recorded = train("make_modl", tmp_path)
    plain = train("make_modl", tmp_path, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name

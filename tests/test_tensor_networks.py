"""End to end on tensor-network models (``tensor_networks_models``): an MPS classifier of 64
sites contracted by einsum with or without per-site normalisation, an MPS over padded
sequences, a Born machine whose partition function is contracted through transfer matrices,
and a Linear projected onto rank r by a truncated SVD in each forward. Each planted bug of the
domain fires under the recorder and is replayed with the CLI; the healthy versions raise no
event and train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import pytest
import tensor_networks_models as M
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("tensor_networks_models.py", text)


def batch(kind: str, g: torch.Generator, bad: int | None):
    """(model args, loss args after the model's outputs) of one step."""
    if kind in ("image", "entangled"):
        x, y = M.digits_batch(g, bad)
        return (x,), (y,)
    if kind == "sequence":
        x, mask, y = M.sequence_batch(g, bad)
        return (x, mask), (y,)
    if kind == "sector":
        return (M.sector_batch(g, bad),), ()
    if kind in ("born", "log_mps"):
        return (M.binary_batch(g),), ()
    x, y = M.regression_batch(g)
    return (x,), (y,)


LOSSES = {"sequence": M.sequence_loss, "born": M.nll, "image": torch.nn.CrossEntropyLoss(),
          "entangled": M.entangled_loss, "log_mps": M.nll,
          "sector": M.nll}


def train(kind: str, make: str, out_dir, bad: int | None = None, steps: int = 4,
          record: bool = True):
    """Adam with a step schedule and gradient clipping, as torchmps's and the Born machine
    papers' scripts train; the sample ``bad`` is planted in the last step's batch. Returns the
    model."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    crit = LOSSES.get(kind, torch.nn.MSELoss())
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"tensor_networks_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step in range(steps):
            args, targets = batch(kind, g, bad if step == steps - 1 else None)
            out = model(*args)
            loss = loss_fn(*(out if isinstance(out, tuple) else (out,)), *targets)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    return model


def fire(kind: str, make: str, tmp_path, bad: int | None = None):
    with pytest.raises(NonFiniteError) as info:
        train(kind, make, tmp_path, bad)
    return info.value.event, info.value.bundle_path


def test_unnormalised_mps_of_an_unscaled_image_names_the_contraction_and_the_image(tmp_path):
    """One image left in uint8 scale (0..255): its polynomial features ``[1, x]`` multiply the
    unnormalised boundary vector by ~x per site, and the einsum's bmm overflows about 50 sites
    in. The replay names that bmm on its line, the image, overflow; the hint says to normalise
    the running product per site and names the image's out-of-scale data; dropping it makes
    the step finite."""
    ev, bundle = fire("image", "make_mps_poly_raw", tmp_path, bad=3)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "", [3]), ev
    rep = nanreplay_json(bundle, "--try", "drop=3")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "", "aten.bmm", "+inf", [3]), o
    assert o["source"] == line_of('v = torch.einsum("bl,blr->br", v, m)'), o
    assert o["line_run"] > 40, o
    assert rep["cause"] == "overflow", rep["cause"]
    assert "divide the running value by its norm at each run" in rep["hint"], rep["hint"]
    assert "sample(s) 3 of batch reach 255" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_normalised_mps_takes_the_unscaled_image_without_an_event(tmp_path):
    """The same image through the per-site normalised chain (log norms kept aside): finite,
    so the event above is the missing normalisation's."""
    train("image", "make_mps_poly", tmp_path, bad=3)
    assert not list(tmp_path.glob("*.nan"))


def test_padded_record_zeroing_the_boundary_vector_names_the_norm_division(tmp_path):
    """A record shorter than the batch's longest, its pads' feature vectors multiplied by the
    mask's 0: the pad's transfer matrix is 0, the boundary vector is 0 and its per-site
    normalisation divides 0 by 0. The replay names the division, the first padded site's run
    of its line (16), the record, 0/0, and the rows where the divisor is 0."""
    ev, bundle = fire("sequence", "make_sequence", tmp_path, bad=5)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"], ev["kind"]) == (
        3, "forward", "", [5], "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], o["line_run"]) == (
        "", "aten.div", "nan", [5], 16), o
    assert o["source"] == line_of("v = v / norm  # 0/0"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert "skip the rows where it is 0" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_born_machine_partition_function_underflow_names_the_log_and_the_chain(tmp_path):
    """log |psi|^2 is tracked in log scale, but Z is contracted through 64 transfer matrices
    without rescaling: at std 0.05 it is ~3e-92, 0 in float32, and log Z is -inf, so every
    string's log-likelihood is +inf at the first step. The replay names the log on its line,
    underflow, and the fix: rescale the running product per site and sum the logs (not a
    clamp)."""
    ev, bundle = fire("born", "make_born", tmp_path)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "forward", "", "+inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"]) == (
        True, "", "aten.log", "-inf"), o
    assert o["source"] == line_of("return log_scale + torch.log(z)"), o
    assert rep["cause"] == "underflow", rep["cause"]
    assert "chain of 66 products" in rep["hint"], rep["hint"]
    assert "divide the running product by its norm at each step" in rep["hint"], rep["hint"]
    assert "clamp_min" not in rep["hint"], rep["hint"]


def test_svd_projection_of_an_identity_weight_names_the_svd_backward(tmp_path):
    """A TT-SVD projected Linear whose weight ``eye_`` initialised: every singular value is 1,
    and the gradient of the truncated U and V divides by their differences. The replay names
    LinalgSvdBackward0 in the layer, on the svd's line, invalid, and says to initialise the
    matrix without ties."""
    ev, bundle = fire("regression", "make_tt_eye", tmp_path)
    assert (ev["step"], ev["phase"]) == (0, "backward"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"]) == ("backward", "tt", "LinalgSvdBackward0"), o
    assert o["source"] == line_of("u, s, vh = torch.linalg.svd(self.weight"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "repeated singular values" in rep["hint"], rep["hint"]
    assert "initialise a learned matrix without ties" in rep["hint"], rep["hint"]


def test_entropy_of_a_zero_padded_bond_names_the_log_and_a_form_with_a_finite_gradient(
        tmp_path):
    """A bond-6 MPS grown to bond 10 by zero padding: its middle core's matricisation has
    singular values exactly 0, and the entanglement-entropy regulariser ``-(p * p.log())``
    makes 0 * -inf = NaN at the first step. The replay names the log's -inf, the product that
    took it by 0, invalid, and the form whose limit is 0 with a finite gradient (the next test
    trains with it); it warns off xlogy(p, p), whose gradient at 0 is NaN."""
    ev, bundle = fire("entangled", "make_entangled_grown", tmp_path)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "forward", "", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"]) == ("", "aten.log", "-inf"), o
    assert o["source"] == line_of("entropy = -(p * p.log()).sum()"), o
    assert [c["op"] for c in o["chain"]] == ["aten.log", "aten.mul"], o["chain"]
    assert rep["cause"] == "invalid", rep["cause"]
    assert "torch.special.xlogy(p, p.clamp_min(tiny))" in rep["hint"], rep["hint"]
    assert "not as xlogy(p, p)" in rep["hint"], rep["hint"]


def test_condition_number_of_a_zero_padded_bond_names_the_singular_value_of_0(tmp_path):
    """The grown MPS with a penalty on its middle bond's condition number, ``s[0] / s[-1]``:
    the padded bond's smallest singular value is exactly 0, +inf at the first step. The
    replay names the division by a singular value of 0 (the divisor, not the numerator, which
    svd made too), a rank-deficient matrix, and a truncation by a tolerance; not a count or
    statistic of the batch to clamp."""
    ev, bundle = fire("entangled", "make_conditioned_grown", tmp_path)
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "forward", "+inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"]) == ("", "aten.div", "+inf"), o
    assert o["source"] == line_of("(s[0] / s[-1]).log()"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "by a singular value of 0 from linalg.svd" in rep["hint"], rep["hint"]
    assert "truncate by a tolerance" in rep["hint"], rep["hint"]
    assert "skip such batches" not in rep["hint"], rep["hint"]


def test_isometric_cores_of_a_zero_padded_bond_name_the_qr_backward(tmp_path):
    """Left-isometric cores made by QR of their parameters, the bond grown from 6 to 10 by
    zero padding: the matricisations have zero columns, R's diagonal is 0 there and QR's
    backward divides by it. The replay names LinalgQrBackward0 on the QR's line, invalid,
    and the zero or dependent columns to avoid."""
    ev, bundle = fire("image", "make_isometric_grown", tmp_path)
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "backward", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"]) == ("backward", "", "LinalgQrBackward0"), o
    assert o["source"] == line_of("q, _ = torch.linalg.qr(self.cores.reshape("), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "diagonal of its R factor" in rep["hint"], rep["hint"]
    assert "zero column" in rep["hint"], rep["hint"]


def test_record_outside_the_symmetric_sector_names_the_log_and_the_record(tmp_path):
    """A particle-number-conserving Born machine (a U(1) mask on the cores) given one record
    with a bit flipped on: k + 1 particles, amplitude exactly 0 by the symmetry, log 0 = -inf
    in its log-likelihood. The replay names the log on its line, that record alone, invalid
    (exact arithmetic makes the 0 too), and dropping it makes the step finite."""
    ev, bundle = fire("sector", "make_symmetric_born", tmp_path, bad=6)
    assert (ev["step"], ev["phase"], ev["kind"], ev["samples"]) == (3, "forward", "-inf", [6]), ev
    rep = nanreplay_json(bundle, "--try", "drop=6")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.log", "-inf", [6]), o
    assert o["source"] == line_of("(v @ self.right).abs().log()) - log_z"), o
    assert rep["cause"] == "invalid" and "log of 0" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_the_advised_entropy_trains_and_the_plain_xlogy_does_not(tmp_path):
    """The hint's form trains the grown MPS with no event and finite weights; xlogy(p, p),
    which the hint warns off, is finite in the forward and NaN in every gradient."""
    model = train("entangled", "make_entangled_grown_xlogy", tmp_path)
    assert not list(tmp_path.glob("*.nan"))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    s = torch.tensor([2.0, 1.0, 0.0], requires_grad=True)
    p = s.pow(2) / s.pow(2).sum()
    entropy = -torch.special.xlogy(p, p).sum()
    entropy.backward()
    assert torch.isfinite(entropy) and torch.isnan(s.grad).all(), s.grad


def test_log_space_mps_with_unreachable_states_names_the_logsumexp_backward(tmp_path):
    """A left-to-right non-negative MPS (an HMM) contracted by logsumexp, its band and start
    state -inf masks: the forward is finite (the -inf stay inside, no forward event), but at
    the first sites the states not yet reachable take a logsumexp of -inf alone, whose
    backward is exp(-inf + inf) = NaN. The replay names LogsumexpBackward0 on its line and
    the fix the finite-fill run below trains with: a large finite negative instead of -inf."""
    ev, bundle = fire("log_mps", "make_log_mps", tmp_path)
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "backward", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"]) == ("backward", "", "LogsumexpBackward0"), o
    assert o["source"] == line_of("alpha = torch.logsumexp(alpha[:, :, None] + log_t, 1)"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "-inf in every position of a slice" in rep["hint"], rep["hint"]
    assert "large finite negative (-1e9" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("kind,make,bad", [
    ("image", "make_mps", None), ("sequence", "make_sequence_skip", 5),
    ("born", "make_born_scaled", None), ("regression", "make_tt", None),
    ("log_mps", "make_log_mps_finite_fill", None), ("image", "make_isometric", None),
    ("regression", "make_tt_bf16", None), ("sector", "make_symmetric_born", None)])
def test_healthy_runs_raise_nothing_and_train_the_same(tmp_path, kind, make, bad):
    """The normalised MPS classifier, the sequence MPS whose pads are the identity (a
    ``torch.where`` over the padded record's sites), the Born machine with Z rescaled per
    site, the SVD projection of a weight without ties, the log-space MPS whose masks fill
    -1e9, the isometric MPS at its own bond (QR of full-rank matricisations), a TT-matrix
    Linear contracted by einsum under bf16 autocast and the symmetric Born machine on records
    of its sector: no event, bit-identical weights with and without the recorder."""
    recorded = train(kind, make, tmp_path, bad)
    plain = train(kind, make, tmp_path, bad, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name

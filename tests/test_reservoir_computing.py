"""End to end on hand-written reservoir computing (``reservoir_computing_models``): an echo
state network whose trainable recurrent matrix is rescaled to a spectral radius from
``torch.linalg.eigvals`` in every forward, a fixed reservoir with a closed-form ridge readout
(``torch.linalg.solve`` of the normal equations over the batch's states), next-generation
reservoir computing's polynomial features of delayed inputs over a Lorenz ``Dataset``, and
FORCE learning's recursive-least-squares readout updated under ``no_grad`` inside the forward
while Adam trains the input weights by BPTT. Each planted bug of the domain fires under the
recorder and is replayed with the CLI; the healthy versions raise no event and train
bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import pytest
import reservoir_computing_models as M
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("reservoir_computing_models.py", text)


def batches(kind: str, steps: int, unmasked: tuple[int, ...] = (), fill=None):
    """(model args, target) of each step."""
    if kind == "ngrc":
        data = M.LorenzWindows(n=8 * steps, unmasked=unmasked, fill=fill)
        loader = DataLoader(data, batch_size=8)
        return [((x,), y) for x, y in loader]
    if kind == "force":
        return [((x, y), y) for x, y in M.sine_chunks(steps)]
    pairs = list(M.mackey_glass_batches(steps))
    if kind == "attention":  # (the next value after the window)
        return [((x,), y[:, -1]) for x, y in pairs]
    if kind == "ridge":
        return [((x, y[:, 5:]), y[:, 5:]) for x, y in pairs]
    return [((x,), y[:, 5:]) for x, y in pairs]


def train(kind: str, make: str, out_dir, steps: int = 4, unmasked: tuple[int, ...] = (),
          record: bool = True, fill=None, amp: bool = False):
    """Adam with a step schedule and gradient clipping, as ReservoirPy/EchoTorch users train
    the trainable parts (``amp``: the forward and loss under bfloat16 autocast). Returns the
    model."""
    torch.manual_seed(0)  # (the nn.Linear initialisations)
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    crit = torch.nn.MSELoss()
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"reservoir_computing_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for args, target in batches(kind, steps, unmasked, fill):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                loss = loss_fn(model(*args), target)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    return model


def bundle_of(out_dir) -> str:
    (path,) = out_dir.glob("*.nan")
    return str(path)


def test_delay_line_reservoir_rescaled_by_its_zero_spectral_radius(tmp_path):
    """Rodan & Tino's delay line reservoir is nilpotent: every eigenvalue is 0, so rescaling it
    to a spectral radius divides by 0 in the first forward. The recorder writes the forward
    event; eigvals' backward then fails at the repeated eigenvalues (LinAlgError), which ends
    the step in training. The replay covers the step up to that failing derivative (not a
    failed replay), names the reciprocal of the radius on its line, every sample, the pole
    of parameters alone, and says the backward's derivative (no code of the user's) raised."""
    with pytest.raises(torch.linalg.LinAlgError) as info:
        train("esn", "make_esn_delay_line", tmp_path)
    # (the forward event's summary rides on the backward's error, with the bundle's path)
    assert bundle_of(tmp_path) in " ".join(getattr(info.value, "__notes__", [])), info.value
    rep = nanreplay_json(bundle_of(tmp_path))
    o = rep["origin"]
    assert (rep["event"]["step"], rep["reproduced"], o["module"], o["op"], o["made"]) == (
        0, True, "reservoir", "aten.reciprocal", "+inf"), rep
    assert o["source"] == line_of("return self.weight * (self.rho / radius)"), o
    assert o["samples"] == list(range(8)), o
    assert rep["cause"] == "invalid" and "parameters and buffers alone" in rep["hint"], rep
    assert "divided by its spectral radius or norm, which is 0" in rep["hint"], rep["hint"]
    note = " ".join(rep["problems"])
    assert "derivative in the step's backward" in note and "LinAlgError" in note, rep


def test_ngrc_cubic_features_of_a_netcdf_fill_value_name_the_record(tmp_path):
    """A missing x reading read back from netCDF without its mask is the fill value 9.97e36:
    NG-RC's quadratic monomials of it overflow. The replay names the product in ``features``,
    its line, the one record, overflow of out-of-scale data, and dropping it fixes the step."""
    with pytest.raises(NonFiniteError) as info:
        train("ngrc", "make_ngrc", tmp_path, unmasked=(29,))
    ev = info.value.event
    assert (ev["step"], ev["module"], ev["samples"], ev["kind"]) == (3, "features", [5], "+inf")
    rep = nanreplay_json(info.value.bundle_path, "--try", "drop=5")
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"]) == ("features", "aten.mul", [5]), o
    assert o["source"] == line_of("quad = lin[:, self.quad[:, 0]] * lin[:, self.quad[:, 1]]")
    assert rep["cause"] == "overflow" and "out of scale" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_ngrc_missing_reading_read_masked_as_nan_is_an_input_event(tmp_path):
    """The same missing reading read with its mask (xarray's NaN): an input event before any
    op, on the one record, cause ``input``; dropping the record fixes the step."""
    with pytest.raises(NonFiniteError) as info:
        train("ngrc", "make_ngrc", tmp_path, unmasked=(29,), fill=float("nan"))
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["samples"]) == (3, "input", [5]), ev
    rep = nanreplay_json(info.value.bundle_path, "--try", "drop=5")
    assert (rep["origin"]["phase"], rep["origin"]["samples"], rep["cause"]) == (
        "input", [5], "input"), rep
    assert "data pipeline" in rep["hint"] and rep["what_if"][0]["finite"] is True, rep


def first_overflowing_time_step(steps: int) -> int:
    """The time step of the event step's chunk at which FORCE's ``outer(k, k)`` first
    overflows, found on an unrecorded copy of the run by the RLS update written out again
    (the replay's claim, checked independently)."""
    model = train("force", "make_force_forgetting", None, steps=steps, record=False)
    (x, y), _ = batches("force", steps + 1)[steps]
    with torch.no_grad():
        u, h, P, w_out = model.w_in(x)[0], torch.zeros(48), model.P, model.w_out
        for t in range(x.shape[1]):
            h = torch.tanh(model.w @ h + u[t])
            k = P @ h
            if not torch.isfinite(torch.outer(k, k)).all():
                return t
            den = model.lam + h @ k
            P = (P - torch.outer(k, k) / den) / model.lam
            w_out = w_out - (h @ w_out - y[0, t, 0]) * k / den
    raise AssertionError("no overflow")


def test_force_rls_with_a_forgetting_factor_overflows_its_inverse_correlation(tmp_path):
    """FORCE's RLS with a forgetting factor of 0.7: ``P`` is divided by it at every time step
    and grows in the directions the reservoir does not excite until the update
    ``(P - k k^T / den) / lam`` overflows at step 3. The replay names that line in the root's
    own loop, the time step (the run of that line a re-implementation finds), the one
trajectory and overflow, and sends the user to the buffer ``P`` that grew
across steps, not to the learning rate (the weights barely moved), whether or not the loss
had jumped before the event (at step 2 on the AMD EPYC's vectorised kernels; not with
``ATEN_CPU_CAPABILITY=default``, where only the grown ``P`` says it)."""
    with pytest.raises(NonFiniteError) as info:
        train("force", "make_force_forgetting", tmp_path, steps=8)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "", [0]), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["made"], o["samples"], rep["cause"]) == ("", "+inf", [0], "overflow")
    assert o["source"] == line_of("P = (P - torch.outer(k, k) / den) / self.lam"), o
    # (38 on the AMD EPYC, 43 there with ATEN_CPU_CAPABILITY=default, 44 on an Intel Xeon:
    # how fast P grows is the CPU's rounding)
    assert o["line_run"] == first_overflowing_time_step(3) + 1, o
    # (was: the loss's jump read as a learning rate too high, "lower the learning rate or
    # clip the gradients", which the clipped Adam at 1e-3 on the input weights never was)
    hint = rep["hint"]
    assert "the buffer P held values up to" in hint and "forgetting factor" in hint, hint
    assert "lower the learning rate or clip" not in hint, hint


def test_fixed_reservoir_of_sparsity_one_is_built_nan(tmp_path):
    """A connectivity of 0 typed as a sparsity of 1.0: the fixed reservoir is all zeros, its
    spectral radius 0, and the rescaling ``w * (rho / 0)`` builds the buffer NaN. The first
    forward's NaN is blamed on that buffer, as the factory builds it (not an update), read by
    the recurrence's matmul on its line, every sample."""
    with pytest.raises(NonFiniteError) as info:
        train("ridge", "make_ridge_esn_empty", tmp_path, steps=2)
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["tensor"], o["param"], o["op"]) == (
        0, "weights", "buffer", "w", "aten.mm"), o
    assert o["source"] == line_of("h = torch.tanh(u[:, t] + h @ self.w.T)"), o
    assert o["all_samples"] and rep["cause"] == "weights", rep
    assert "the factory builds buffer w non-finite" in rep["hint"], rep["hint"]


def test_attention_readout_whose_washout_masks_every_state(tmp_path):
    """A washout set for long series (20 steps) on windows of 20: every score is masked with
    ``-inf`` and the attention pooling's softmax is 0/0 in every row at the first step. The
    replay names the softmax on its line, the intended fill before it, every sample, and
    the fully masked row's advice: keep at least one key per row."""
    with pytest.raises(NonFiniteError) as info:
        train("attention", "make_attention_esn_long_washout", tmp_path, steps=2)
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["event"]["step"], o["module"], o["op"], o["all_samples"]) == (
        0, "", "aten._softmax", True), o
    assert o["source"] == line_of("pooled = (scores.softmax(-1)[..., None] * states).sum(1)")
    assert o["chain"][0]["op"] == "aten.masked_fill" and o["chain"][0]["intentional"], o
    assert rep["cause"] == "invalid" and "fully masked row" in rep["hint"], rep["hint"]
    assert "keep at least one key per row" in rep["hint"], rep["hint"]


def test_ridge_readout_of_more_units_than_states_without_a_ridge_term(tmp_path):
    """160 reservoir units, 8 windows of 15 states after washout and no ridge term: the
    normal equations' Gram matrix has rank at most 120, and its Cholesky factorisation fails
    in the first forward. The replay names the factorisation in ``readout``, its line, the
    matrix singular in exact arithmetic too, and the fix: a ridge on the diagonal."""
    with pytest.raises(torch.linalg.LinAlgError):
        train("ridge", "make_ridge_esn_wide", tmp_path, steps=2)
    rep = nanreplay_json(bundle_of(tmp_path))
    o = rep["origin"]
    assert (rep["event"]["step"], o["module"], o["op"]) == (
        0, "readout", "aten.linalg_cholesky_ex"), o
    assert o["source"] == line_of("torch.cholesky_solve(s.T @ y, torch.linalg.cholesky(gram))")
    hint = rep["hint"]
    assert rep["cause"] == "invalid" and "exact arithmetic too" in hint, hint
    assert "fewer samples than features" in hint and "ridge" in hint, hint


@pytest.mark.parametrize("kind,make", [
    ("esn", "make_esn"), ("attention", "make_attention_esn"), ("ridge", "make_ridge_esn"), ("ridge", "make_ridge_esn_cholesky"),
    ("ngrc", "make_ngrc"), ("force", "make_force")])
def test_healthy_runs_raise_nothing_and_train_the_same(tmp_path, kind, make):
    """The trainable ESN (eigvals and its backward in every step), its attention readout whose
    softmax the washout's ``-inf`` scores stay inside, the ridge readout's solve,
    NG-RC's monomials and FORCE's RLS buffers replaced in every forward: no event, and
    bit-identical weights and buffers with and without the recorder."""
    recorded = train(kind, make, tmp_path, steps=3)
    plain = train(kind, make, tmp_path, steps=3, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name


def test_trainable_esn_under_bfloat16_autocast_trains_the_same(tmp_path):
    """The trainable ESN under bfloat16 autocast (eigvals kept in float32, the recurrence's
    matmuls in bfloat16): no event, bit-identical weights with and without the recorder."""
    recorded = train("esn", "make_esn", tmp_path, steps=3, amp=True)
    plain = train("esn", "make_esn", tmp_path, steps=3, record=False, amp=True)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name

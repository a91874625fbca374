"""Models with complex parameters and FFTs (a Fourier neural operator), recorded and replayed
end to end. The float64 re-run widened floating tensors only: complex64 weights met the
complex128 FFT of a float64 signal in ``einsum`` and the whole replay failed ('expected m1 and
m2 to have the same dtype'); the rewind window's norms dropped the weights' imaginary parts
(with a UserWarning)."""

from __future__ import annotations

import contextlib
import json
import warnings

import pytest
import spectral_models as S
import torch
from bundles import invoke_cli, nanreplay_json

from recorder import FlightRecorder, NonFiniteError

ZERO_STEP, ZERO_ROW = 7, 3


def _fno_run(out_dir, rewind=None) -> tuple[NonFiniteError, S.FNO1d]:
    """Operator learning of the running sum of a random signal; at step 7 sample 3's target
    is identically zero (a blank simulation), so its relative error is x / 0."""
    torch.manual_seed(0)
    model, crit = S.make_fno(), S.RelL2()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, rewind=rewind,
                            factory="spectral_models:make_fno"):
            for step in range(30):
                g = torch.Generator().manual_seed(step)
                a = torch.randn(8, 64, 1, generator=g)
                u = torch.cumsum(a, dim=1) / 8
                if step == ZERO_STEP:
                    u[ZERO_ROW] = 0.0
                opt.zero_grad()
                crit(model(a), u).backward()
                opt.step()
    return info.value, model


def _report(bundle, *args) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no "casting complex values to real" on the way)
        res = invoke_cli(bundle, "--json", *args)
    assert res.exit_code in (0, 1), res.output
    return json.loads(res.stdout)


def test_a_relative_error_over_a_zero_target_is_named_with_complex_weights(out_dir):
    err, _ = _fno_run(out_dir)
    assert (err.event["step"], err.event["phase"]) == (ZERO_STEP, "loss"), err.event
    rep = _report(err.bundle_path, "--try", f"drop={ZERO_ROW}")
    o = rep["origin"]
    assert rep["reproduced"] and (o["phase"], o["module"], o["op"], o["samples"]) == \
        ("loss", "<loss>", "aten.div", [ZERO_ROW]), o
    assert rep["cause"] == "invalid" and "x/0" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_the_window_norms_of_complex_weights_count_their_imaginary_parts(out_dir):
    err, model = _fno_run(out_dir, rewind=3)
    rep = _report(err.bundle_path)
    w = rep["window"]
    assert w["reproduced"] and w["steps"] == [w["copy_step"], ZERO_STEP], w
    # after step 6's update the weights are the run's at its end (step 7 stopped before its
    # update); the norm counts the complex weights' imaginary parts
    norm = torch.stack([p.detach().abs().double().norm() for p in model.parameters()]).norm()
    assert w["per_step"][-2]["step"] == ZERO_STEP - 1
    assert w["per_step"][-2]["param_norm"] == pytest.approx(float(norm), rel=1e-6)


BAD_STEP, BAD_ROW = 3, 5


def _complex_batches(model, opt, out_dir, steps: int, bad: bool, record: bool = True):
    """Train on complex batches (8 samples of 16 complex values); with ``bad``, step 3's
    sample 5 holds one NaN entry (a corrupted k-space line). Returns the losses."""
    crit, losses = torch.nn.CrossEntropyLoss(), []
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory="spectral_models:make_complex_net") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            z = torch.randn(8, 16, dtype=torch.complex64, generator=g)
            y = torch.randint(0, 3, (8,), generator=g)
            if bad and step == BAD_STEP:
                z[BAD_ROW, 2] = complex(float("nan"), 0.0)
            opt.zero_grad()
            loss = crit(model(z), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


def test_a_nan_in_a_complex_batch_is_an_input_event_naming_its_sample(out_dir):
    """A complex root input is checked as its real view: the NaN in one sample is the batch's,
    named at the step it came in. Only real root inputs were checked, so the event was the
    root's output ('nan first in the output of <root>', phase forward)."""
    model = S.make_complex_net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as info:
        _complex_batches(model, opt, out_dir, 6, bad=True)
    event = info.value.event
    assert (event["step"], event["phase"], event["tensor"]) == (BAD_STEP, "input", "batch")
    assert event["samples"] == [BAD_ROW] and event["kind"] == "nan"
    report = nanreplay_json(info.value.bundle_path)
    assert report["cause"] == "input" and report["reproduced"]
    assert report["origin"]["phase"] == "input" and report["origin"]["samples"] == [BAD_ROW]


def test_a_complex_batch_trains_the_same_under_the_recorder(out_dir):
    runs = []
    for record in (False, True):
        model = S.make_complex_net()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        runs.append((_complex_batches(model, opt, out_dir, 4, bad=False, record=record),
                     [p.detach().clone() for p in model.parameters()]))
    (plain, w0), (recorded, w1) = runs
    assert plain == recorded and all(torch.equal(a, b) for a, b in zip(w0, w1))

"""End to end: domain adaptation as DANN and Transfer-Learning-Library write it
(``adaptation_models``): source and target rows through one forward beside a domain label
tensor, a gradient reversal layer (a custom autograd Function) before the domain
discriminator whose coefficient follows Ganin's schedule, and an alignment term between the
domains' features (a Gaussian MMD whose bandwidth is the median pairwise distance) or the
target rows' entropy. Each planted bug fires at its step and ``nanreplay`` names it."""

from __future__ import annotations

import json

import adaptation_models as A
import numpy as np
import pytest
import torch
from bundles import nanreplay_json

from recorder import FlightRecorder, NonFiniteError

NS, STEPS, BAD = 8, 6, 3  # source rows a batch; the planted step


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def batch(step: int, nt: int = 8, repeat: bool = False):
    """Source rows then target rows, their labels (the target's unused) and domain labels;
    ``repeat``: the target loader yields one frame ``nt`` times (a stalled video stream)."""
    g = torch.Generator().manual_seed(step)
    xs = torch.randn(NS, A.D_IN, generator=g)
    ys = torch.randint(0, A.CLASSES, (NS,), generator=g)
    xt = torch.randn(nt, A.D_IN, generator=g) + 1.0
    if repeat:
        xt = xt[:1].expand(nt, -1).clone()
    dom = torch.cat([torch.zeros(NS, dtype=torch.long), torch.ones(nt, dtype=torch.long)])
    return torch.cat([xs, xt]), torch.cat([ys, torch.zeros(nt, dtype=torch.long)]), dom


def train_dann(out_dir, align: str, nt: int = 8, repeat: bool = False, temp: float = 1.0):
    """DANN's loop; at step ``BAD`` the target batch has ``nt`` rows (``repeat``: one frame)
    and the entropy term sharpens by ``temp``. Returns the error and the model."""
    model = A.make_dann()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=A.dann_loss, out_dir=out_dir,
                            factory="adaptation_models:make_dann") as rec:
            for step in range(STEPS):
                model.coeff = A.grl_coeff(step / STEPS)
                bad = step == BAD
                x, y, dom = batch(step, nt if bad else 8, repeat and bad)
                loss = rec.loss_fn(model(x, dom), y, dom, align=align,
                                   temp=temp if bad else 1.0)
                opt.zero_grad()
                loss.backward()
                opt.step()
    return info.value, model


def test_mmd_median_bandwidth_of_a_repeated_target_batch_is_invalid_not_precision(tmp_path):
    """The target batch repeats one frame: more than half the pairwise distances are 0, so
    the median bandwidth is 0 and exp(-d² / sigma) divides 0 by 0. Exact arithmetic makes
    sigma 0 too: invalid, with the division advice. (Regression: with cdist's matrix-product
    form |x|² + |y|² - 2 x·y, float64 re-ran the step finite on the AMD EPYC because it left
    sigma at 2.8e-16, a rounding residue, and the report said precision and --try auto
    proposed dtype=float64; that form's float32 zeros were CPU-dependent too, none with scalar
    kernels, so the model now takes the differences' exact form: 0 for equal rows on every
    CPU, in float32 and float64.)"""
    err, _ = train_dann(tmp_path, "mmd", nt=24, repeat=True)
    assert (err.event["step"], err.event["phase"]) == (BAD, "loss")
    rep = nanreplay_json(err.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], rep["cause"]) == (
        True, "<loss>", "aten.div", "invalid"), (rep["cause"], rep["hint"])
    assert "k = torch.exp(-d2 / sigma)" in rep["source_lines"][o["source"]]
    # (float64's cdist left sigma at a residue on the AMD EPYC, exactly 0 on an Intel Xeon:
    # where the hint speaks of float64 at all, it must call its value a residue)
    assert "add an eps to a statistic" in rep["hint"], rep["hint"]
    assert "rounding residue" in rep["hint"] or "float64" not in rep["hint"], rep["hint"]
    assert rep["what_if"] == [], rep["what_if"]  # (was dtype=float64, "finite")


def test_entropy_of_sharpened_target_predictions_names_the_target_rows(tmp_path):
    """Entropy minimisation -sum(p log p) on the target rows, which the loss selects from the
    joint batch with the domain labels (logits[domain == 1]), sharpened at step 3 by a
    temperature of 0.002: softmax underflows to 0 and log makes -inf (0 * -inf: NaN). The
    samples are the joint batch's rows whose sharpened softmax holds an exact 0."""
    err, _ = train_dann(tmp_path, "entropy", temp=0.002)
    assert (err.event["step"], err.event["phase"]) == (BAD, "loss")
    rep = nanreplay_json(err.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (o["module"], o["op"], rep["cause"]) == ("<loss>", "aten.log", "underflow")
    # the same loop without the recorder, up to the planted step's forward
    model = A.make_dann()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for step in range(BAD):
        model.coeff = A.grl_coeff(step / STEPS)
        x, y, dom = batch(step)
        opt.zero_grad()
        A.dann_loss(model(x, dom), y, dom, align="entropy").backward()
        opt.step()
    x, _, dom = batch(BAD)
    with torch.no_grad():
        p = (model(x, dom)[0] / 0.002).softmax(-1)
    expect = [i for i in range(len(x)) if dom[i] == 1 and bool((p[i] == 0).any())]
    assert expect and o["samples"] == expect, (o["samples"], expect)
    (tried,) = rep["what_if"]
    assert (tried["try"], tried["finite"]) == ("drop=" + ",".join(map(str, expect)), True)


def test_a_nan_grl_coefficient_from_numpy_s_schedule_is_restored_and_named(tmp_path):
    """DANN's loop computes lambda = 2 / (1 + np.exp(-10 p)) - 1 from the progress p = step /
    (epochs * len(target_loader)), a NumPy float64; the target loader is empty (fewer target
    images than the batch size, drop_last=True), so p = 0/0 and lambda is NaN: the GRL's
    backward multiplies the discriminator's gradient by NaN. The recorder kept no attribute
    that was NaN, nor a NumPy float: the replay re-ran with the factory's coefficient 0.0 and
    blamed loss terms outside loss_fn (cause unknown). It now re-runs with the NaN and names
    the GRL's backward, its line, and the attribute."""
    model = A.make_dann()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    target_batches = 0  # len(target_loader)
    with pytest.raises(NonFiniteError) as info, np.errstate(invalid="ignore"):
        with FlightRecorder(model, opt, loss_fn=A.dann_loss, out_dir=tmp_path,
                            factory="adaptation_models:make_dann") as rec:
            for step in range(3):
                p = np.float64(step) / (STEPS * target_batches)
                model.coeff = 2.0 / (1.0 + np.exp(-10 * p)) - 1
                x, y, dom = batch(step)
                loss = rec.loss_fn(model(x, dom), y, dom, align="none")
                opt.zero_grad()
                loss.backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (0, "backward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["module"], o["op"], rep["cause"]) == (
        True, "backward", "", "GradientReverseBackward", "invalid"), json.dumps(o)
    assert "grad.neg() * ctx.coeff" in " ".join(rep["problems"]), rep["problems"]
    assert "<root>.coeff = nan (the factory built 0.0; non-finite" in " ".join(
        rep["problems"]), rep["problems"]


def test_a_nan_numpy_alpha_passed_to_forward_is_rebuilt_and_named(tmp_path):
    """fungtion/DANN's loop passes alpha to each forward, model(x, domain, alpha), a NumPy
    float64 from np.exp; NaN from p = 0/0 it was bundled as 'np.float64(nan)' and the replay
    failed (ValueError: could not convert string to float). It now rebuilds it, names the
    GRL's backward, and a note names the number the forward was passed."""
    model = A.make_dann_alpha()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    with pytest.raises(NonFiniteError) as info, np.errstate(invalid="ignore"):
        with FlightRecorder(model, opt, loss_fn=A.dann_loss, out_dir=tmp_path,
                            factory="adaptation_models:make_dann_alpha") as rec:
            x, y, dom = batch(0)
            p = np.float64(0) / (STEPS * 0)  # an empty target loader
            alpha = 2.0 / (1.0 + np.exp(-10 * p)) - 1
            rec.loss_fn(model(x, dom, alpha), y, dom, align="none").backward()
            opt.step()
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (info.value.event["step"], rep["reproduced"], o["module"], o["op"], rep["cause"]) \
        == (0, True, "", "GradientReverseBackward", "invalid"), json.dumps(o)
    assert any(n.startswith("the forward was passed the number args[2] = nan")
               for n in rep["problems"]), rep["problems"]

"""End to end on crowd counting (``crowd_counting_models``): CSRNet's density map trained with
DM-Count's count, optimal transport and TV losses, Bayesian Loss's per-point posteriors,
MCNN's geometry-adaptive Gaussian ground truth rendered on the fly, and the relative count
error, from a ``DataLoader`` of random crops whose collate keeps each crop's head points in a
list. Each planted bug of the domain fires under the recorder and is replayed with the CLI; the
healthy versions raise no event and train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import crowd_counting_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("crowd_counting_models.py", text)


def train(loss: str, out_dir, make: str = "make_csrnet", steps: int = 3, record: bool = True,
          loss_kw: dict | None = None, **planted):
    """Adam with weight decay and a step schedule, as DM-Count trains, gradient clipping; the
    crops come from a DataLoader, ``planted`` picks the dataset's bad images. Returns the
    model."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    crit = M.LOSSES[loss](**(loss_kw or {}))
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"crowd_counting_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for images, points, discrete in M.loader(0, size=4 * steps, **planted):
            opt.zero_grad()
            loss_fn(model(images), points, discrete).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            sched.step()
    return model


def fire(loss: str, tmp_path, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(loss, tmp_path, **kw)
    ev = info.value.event
    assert (ev["phase"], ev["module"]) == ("loss", "<loss>"), ev
    return ev, info.value.bundle_path


def test_empty_crop_normalised_without_eps_names_the_division_and_the_crop(tmp_path):
    """DM-Count's TV term normalises the discrete map by the crop's count; without its
    ``+ 1e-6`` an image with nobody in it (image 10: the third crop of step 2) is 0/0. The
    replay names the division, its line, that crop, and the count's floor, not a filter of
    the crop: the term is weighted by the count, 0 there by design (DM-Count trains on
    empty crops)."""
    ev, bundle = fire("dm", tmp_path, loss_kw={"guarded": False}, empty=[10])
    assert ev["step"] == 2, ev
    rep = nanreplay_json(bundle, "--try", "drop=2")
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"]) == ("aten.div", "nan", [2]), o
    assert o["source"] == line_of("gt_normed = gt_discrete / count.view(B, 1, 1, 1)"), o
    assert rep["cause"] == "invalid" and "count.clamp_min(1)" in rep["hint"], rep["hint"]
    # (the TV term weights the empty crop 0 by design: floor the count, keep the crop)
    assert "nothing is to drop" in rep["hint"], rep["hint"]
    assert "filter such records" not in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_relative_count_error_of_an_empty_crop_names_the_pole(tmp_path):
    """``|est - count| / count`` trained on directly: image 5 has nobody in it, its count is
    0 and its error +inf (a pole, not 0/0: the density's sum is not 0)."""
    ev, bundle = fire("relative", tmp_path, empty=[5])
    assert (ev["step"], ev["kind"]) == (1, "+inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"]) == ("aten.div", "+inf", [1]), o
    assert o["source"] == line_of("return ((est - count).abs() / count).mean()"), o
    assert rep["cause"] == "invalid" and "x/0" in rep["hint"], rep["hint"]
    assert "skip the rows where it is 0" in rep["hint"], rep["hint"]


def test_bayesian_loss_over_no_points_names_the_empty_mean(tmp_path):
    """Bayesian Loss without its branch for an image with no head: the softmax over an empty
    point set gives no posterior, and the mean of the points' count errors is a mean of
    nothing (image 6: the third crop of step 1)."""
    ev, bundle = fire("bayes", tmp_path, loss_kw={"guarded": False}, empty=[6])
    assert ev["step"] == 1, ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"]) == ("aten.mean", "nan", [2]), o
    assert o["source"] == line_of("loss = loss + (target - pre_count).abs().mean()"), o
    assert rep["cause"] == "invalid" and "empty tensor" in rep["hint"], rep["hint"]


def test_duplicated_head_annotation_names_the_kernel_normalisation_as_the_datas(tmp_path):
    """The same head clicked twice, alone in its crop (image 9): its k-nearest-neighbour
    distance is 0, so sigma is 0, ``exp(-d^2 / 0)`` is 0 at every cell and the kernel's
    normalisation is 0/0. The replay names that division on the crop's row, as the data's:
    repair the record, not an eps; and not an adjacency's isolated rows (the kernel is 0 in
    every entry, no 0/1 matrix)."""
    ev, bundle = fire("adaptive", tmp_path, duplicated=[9])
    assert ev["step"] == 2, ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"]) == ("aten.div", "nan", [1]), o
    assert o["source"] == line_of("kernel = kernel / kernel.sum(1, keepdim=True)"), o
    assert rep["cause"] == "invalid" and "degenerate" in rep["hint"], rep["hint"]
    assert "0/1 matrix" not in rep["hint"], rep["hint"]


def test_dead_relu_head_normalised_names_the_density_division_in_every_crop(tmp_path):
    """The density head started from a negative bias: its ReLU gives 0 at every cell of every
    crop, and ``pred / pred.sum()`` is 0/0 at the first step, in all four crops. Beside the
    eps, the hint names the model's output as the 0, made by the ReLU, dead in those crops."""
    ev, bundle = fire("normalised", tmp_path, make="make_csrnet_dead_head")
    assert ev["step"] == 0, ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"]) == ("aten.div", "nan", [0, 1, 2, 3]), o
    assert o["source"] == line_of("pred_normed = pred / pred.sum((1, 2, 3), keepdim=True)"), o
    assert rep["cause"] == "invalid" and "x.sum() + 1e-6" in rep["hint"], rep["hint"]
    assert "model's output" in rep["hint"] and "made by aten.relu" in rep["hint"], rep["hint"]
    assert "dead" in rep["hint"] and "softplus" in rep["hint"], rep["hint"]


def test_sinkhorn_in_float16_with_a_small_eps_names_the_underflow(tmp_path):
    """DM-Count's Sinkhorn in float16 (the transport plan as an AMP run's matmuls give it)
    with eps 0.5: ``K = exp(-C / eps)`` is tiny, ``K @ v`` rounds to 0 in float16 and
    ``u = a / (K @ v)`` is +inf. The replay names that division as underflow and sends the
    user to float32 or the log domain."""
    ev, bundle = fire("dm", tmp_path, loss_kw={"half_ot": True, "eps": 0.5})
    assert ev["step"] == 0, ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["made"], o["dtype"]) == ("aten.div", "+inf", "float16"), o
    assert o["source"] == line_of("u = a / (K @ v)"), o
    assert rep["cause"] == "underflow", rep["cause"]
    assert "float32" in rep["hint"] and "log space" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("loss,kw,planted", [
    ("dm", {}, {"empty": [2, 6]}),
    ("bayes", {}, {"empty": [6]}),
    ("adaptive", {"min_sigma": 1.0}, {"duplicated": [9]}),
])
def test_guarded_losses_raise_nothing_and_train_the_same(tmp_path, loss, kw, planted):
    """The same bad images under the guards the reference code has (DM-Count's eps and its
    skip of empty crops in the OT term, Bayesian Loss's empty-image branch, a floor on the
    adaptive sigma): no event, bit-identical weights with and without the recorder."""
    recorded = train(loss, tmp_path, loss_kw=kw, **planted)
    plain = train(loss, tmp_path, record=False, loss_kw=kw, **planted)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def train_accumulated(loss: str, out_dir, record: bool = True, amp: bool = False,
                      loss_kw: dict | None = None, **planted):
    """Crops of 2, two micro-batches per update (the loss divided by 2), the forward under
    bfloat16 autocast with ``amp`` and the loss in float32, as DM-Count's AMP forks train."""
    model = M.make_csrnet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    crit = M.LOSSES[loss](**(loss_kw or {}))
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory="crowd_counting_models:make_csrnet") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for k, (images, points, discrete) in enumerate(
                M.loader(0, size=12, batch_size=2, **planted)):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                pred = model(images)
            (loss_fn(pred.float(), points, discrete) / 2).backward()
            if k % 2 == 1:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
                opt.step()
                opt.zero_grad()
    return model


@pytest.mark.parametrize("amp", [False, True])
def test_empty_crop_in_the_second_micro_batch_names_that_micro_batch_and_its_crop(tmp_path,
                                                                                   amp):
    """Under accumulation the empty image 7 is the second crop of step 1's second
    micro-batch: the event and the replay name that micro-batch and row 1 of it, and
    dropping it makes the step finite. Under bfloat16 autocast the loss takes
    ``pred.float()``, a cast of the model's output: still the model's (its error is learned),
    so the hint is the same as in float32, not a record's data computed alone."""
    with pytest.raises(NonFiniteError) as info:
        train_accumulated("relative", tmp_path, amp=amp, empty=[7])
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["micro_batch"]) == (1, "loss", 1), ev
    rep = nanreplay_json(info.value.bundle_path, "--try", "drop=1")
    o = rep["origin"]
    assert (o["micro_batch"], o["op"], o["made"], o["samples"]) == (
        1, "aten.div", "+inf", [1]), o
    assert o["source"] == line_of("return ((est - count).abs() / count).mean()"), o
    assert rep["cause"] == "invalid" and rep["what_if"][0]["finite"] is True, rep
    assert "skip the rows where it is 0" in rep["hint"], rep["hint"]
    assert "data alone" not in rep["hint"], rep["hint"]


@pytest.mark.parametrize("amp", [False, True])
def test_accumulated_guarded_dm_count_raises_nothing_and_trains_the_same(tmp_path, amp):
    """DM-Count with its guards over empty crops, accumulated, in float32 and under bfloat16
    autocast: no event, bit-identical weights with and without the recorder."""
    recorded = train_accumulated("dm", tmp_path, amp=amp, empty=[3, 7])
    plain = train_accumulated("dm", tmp_path, record=False, amp=amp, empty=[3, 7])
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name

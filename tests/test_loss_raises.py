"""End to end: a loop that catches what the loss or the backward raises after a finite forward
and skips the batch (``except (IndexError, ValueError, RuntimeError): opt.zero_grad();
continue``): ``cross_entropy``'s target out of range, ``ctc_loss``'s input length past the
sequence, a masked loss refusing an empty mask, ``cholesky`` of a singular covariance, a custom
``autograd.Function`` refusing in its backward (in the loss, in the model). Healthy: no event,
training bit-identical with and without the recorder. A NaN planted in the next batch, which
falls in the same step (no ``step()`` ran for the skipped one), is found at its step, module
and samples, and the replay goes on past the skipped micro-batch's raise as the loop did
(it raised that exception again, ending the replay, before)."""

from __future__ import annotations

import contextlib
import logging

import handled_exception_models as M
import loss_raise_models as L
import pytest
import torch

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle
from replay import replay

pytestmark = pytest.mark.usefixtures("in_tests_dir")
CAUGHT = (IndexError, ValueError, RuntimeError, torch.linalg.LinAlgError)
BAD, ROW = 1, 4  # the batch whose loss (or backward) raises; the planted constant row


def skipping_loop(kind, data, out_dir=None):
    """Train on ``data``, skipping a batch whose loss or backward raises; ``out_dir``: under a
    recorder. The losses, the model and the batches skipped."""
    guarded = kind == "backward_in_model"
    model = L.make_guarded() if guarded else M.make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    crit = L.LOSSES[kind]()
    factory = "loss_raise_models:make_guarded" if guarded else "handled_exception_models:make_net"
    losses, skipped = [], []
    with contextlib.nullcontext() if out_dir is None else FlightRecorder(
            model, opt, loss_fn=crit, out_dir=out_dir, factory=factory):
        for i, (x, y) in enumerate(data):
            try:
                loss = crit(model(x), y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
            except NonFiniteError:
                raise
            except CAUGHT:
                skipped.append(i)
            opt.zero_grad(set_to_none=True)
    return losses, model, skipped


def planted(kind, n: int, blank: int | None = None):
    data = M.batches(n, blank=blank, row=ROW)
    data[BAD] = L.refused(kind, *data[BAD])
    return data


@pytest.mark.parametrize("kind", list(L.LOSSES))
def test_a_loss_that_raises_is_skipped_and_a_nan_in_the_next_batch_is_found(out_dir, kind,
                                                                              caplog):
    data = planted(kind, 4)
    bare, bare_model, skipped = skipping_loop(kind, data)
    with caplog.at_level(logging.WARNING, logger="nanreplay"):
        losses, model, _ = skipping_loop(kind, data, out_dir / "rec")
    assert skipped == [BAD] and losses == bare and not caplog.records
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), bare_model.parameters()))
    assert not list(out_dir.rglob("*.nan"))
    data = planted(kind, BAD + 2, blank=BAD + 1)
    with pytest.raises(NonFiniteError) as info:
        skipping_loop(kind, data, out_dir / "nan")
    ev = info.value.event  # (the skipped batch's forward is micro-batch 0 of the same step)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"], ev["micro_batch"]) == (
        BAD, "forward", "norm", [ROW], 1)
    _, tensors = read_bundle(info.value.bundle_path)
    assert torch.equal(tensors["batch/1/0"], data[BAD + 1][0])
    report = replay(info.value.bundle_path)
    o = report["origin"]
    assert (o["op"], o["module"], o["samples"], report["cause"], report["reproduced"]) == (
        "aten.div", "norm", [ROW], "invalid", True)
    phase = "backward" if kind.startswith("backward") else "loss"
    assert any(p.startswith(f"micro-batch 0's {phase} raised") and "the loop caught it" in p
               for p in report["problems"])


def test_a_nan_in_the_batch_whose_loss_raised_says_the_loop_went_on(out_dir):
    kind = "target_out_of_range"
    data = planted(kind, BAD + 2, blank=BAD)
    with pytest.raises(NonFiniteError) as info:
        skipping_loop(kind, data, out_dir)
    ev = info.value.event  # (found at the next batch's step(), the step the skip left open)
    assert (ev["step"], ev["module"], ev["samples"], ev["micro_batch"]) == (BAD, "norm", [ROW], 0)
    assert "Micro-batch 0's loss call raised and never returned" in str(info.value)
    assert "rec.end_step() in the `except`" in str(info.value)
    report = replay(info.value.bundle_path)
    o = report["origin"]
    assert (o["op"], o["module"], o["samples"], report["cause"]) == (
        "aten.div", "norm", [ROW], "invalid")

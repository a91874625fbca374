"""End to end on signed amplitudes (``signed_amplitude_models``): ``exp(s) * polarity`` of a
+-1 buffer and ``sign(direction) * softplus(v)`` are never 0 in exact arithmetic, so a record
whose features drive the magnitude below float32's range makes a 0 that underflowed, and the
loss's division by it or log of it is an ``underflow``, not the ``invalid`` of a true pole.
The graph rules that tell it read the output's nodes, whose saved constant factors (the
polarity) the step's backward frees: the replay takes their verdict before it."""

from __future__ import annotations

import contextlib

import pytest
import signed_amplitude_models as M
import torch
from bundles import nanreplay_json
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from replay.positive import keep_signs, made_nonzero, made_sign

pytestmark = pytest.mark.usefixtures("in_tests_dir")

BAD_STEP, BAD_ROW, STEPS = 2, 3, 4


def planted_row(layer: nn.Linear, target: float) -> torch.Tensor:
    """Features whose pre-activation under ``layer`` is ``target`` in every channel."""
    want = torch.full((layer.out_features,), target) - layer.bias.detach()
    return torch.linalg.pinv(layer.weight.detach()) @ want


def train(make: str, loss_fn, out_dir, plant: bool = True, record: bool = True) -> list[float]:
    """SGD over batches of 8; at ``BAD_STEP`` row ``BAD_ROW`` drives the magnitude's
    pre-activation to -2000 (exp and softplus of it are 0 even in float64). The losses."""
    model = getattr(M, make)()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir,
                         factory=f"signed_amplitude_models:{make}") if record else None
    losses = []
    with rec if rec is not None else contextlib.nullcontext():
        crit = rec.loss_fn if rec is not None else loss_fn
        for step in range(STEPS):
            x, y = torch.randn(8, 4, generator=g), torch.randn(8, M.K, generator=g)
            if plant and step == BAD_STEP:
                layer = model.log_amp if hasattr(model, "log_amp") else model.scale
                x[BAD_ROW] = planted_row(layer, -2000.0)
            opt.zero_grad()
            loss = crit(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


@pytest.mark.parametrize("make, loss_fn, op", [
    ("make_polarity", M.residual_loss, "aten.div"),
    ("make_signed_softplus", M.log_amp_loss, "aten.log")])
def test_signed_amplitude_underflow_is_named_underflow(make, loss_fn, op, tmp_path):
    """The loss's first non-finite op is its division by (log of) the amplitude, at the planted
    row and step; the cause is the magnitude's underflow, with the log-space and floor advice."""
    with pytest.raises(NonFiniteError) as info:
        train(make, loss_fn, tmp_path)
    assert info.value.event["step"] == BAD_STEP
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["event"]["step"], o["module"], o["op"], o["samples"]) == (
        True, BAD_STEP, "<loss>", op, [BAD_ROW]), o
    assert rep["cause"] == "underflow", rep["hint"]
    assert "signed value non-zero in exact arithmetic" in rep["hint"], rep["hint"]
    assert "log space" in rep["hint"] and "clamp_min(eps)" in rep["hint"], rep["hint"]


def test_signed_amplitude_healthy_run_is_bit_identical(tmp_path):
    """Without the planted row: no event, and the same losses bit for bit as without it."""
    with_rec = train("make_polarity", M.residual_loss, tmp_path, plant=False)
    assert with_rec == train("make_polarity", M.residual_loss, tmp_path, plant=False,
                             record=False)
    assert not list(tmp_path.glob("*.nan"))


def test_sign_verdict_kept_before_backward_frees_the_factor():
    """A product's constant factor is read from its node's saved value, which backward frees;
    the kept verdict survives that. A sum of values of either sign may be an exact 0."""
    s = torch.randn(3, requires_grad=True)
    polarity = torch.tensor([1.0, -1.0, 1.0])
    amp, total = torch.exp(s) * polarity, (torch.exp(s) * polarity).sum()
    assert made_nonzero(amp.grad_fn) and made_sign(amp.grad_fn) == 0
    assert not made_nonzero(total.grad_fn)
    assert made_sign((torch.exp(s) * polarity.abs()).grad_fn) == 1
    kept = keep_signs([amp])
    amp.sum().backward()
    assert made_nonzero(amp.grad_fn) and kept
    del kept
    assert not made_nonzero(amp.grad_fn)  # (the node's saved factor is gone with the verdict)

"""Adam over float16 weights (``model.half()``, no autocast) with its default eps=1e-8: eps is
0 in float16, so wherever v = (1 - beta2) g^2 rounds to 0 the update divides by 0. The report
says so and ``--try auto`` tries what fixes it (an eps float16 keeps, float32 weights and
state), as re-training with either confirms."""

from __future__ import annotations

import math

import pytest
import rewind_models as R
import torch
from bundles import invoke_cli
from test_rewind import nanreplay, what_if
from torch import nn

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def train_half(out_dir, eps: float = 1e-8, steps: int = 3, rewind: int | None = 4):
    """A text classifier trained in float16 by Adam; the last loss."""
    torch.manual_seed(0)
    model = R.make_half_text_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=eps)
    crit = nn.CrossEntropyLoss()
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, rewind=rewind,
                        factory="rewind_models:make_half_text_cnn"):
        for step in range(steps):
            tokens = torch.randint(0, 500, (32, 40), generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            loss = crit(model(tokens).float(), tokens[:, 0] % 5)
            loss.backward()
            opt.step()
    return loss.item()


def test_adams_eps_lost_in_float16_is_named_and_auto_tries_what_fixes_it(out_dir):
    with pytest.raises(NonFiniteError) as info:
        train_half(out_dir)
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (0, "optimizer")
    rep = nanreplay(info.value.bundle_path, "auto")
    o = rep["origin"]
    assert (rep["cause"], o["phase"], o["param"], o["op"]) == \
        ("optimizer", "optimizer", "emb.weight", "aten.addcdiv_")
    # it read "check the learning rate and schedule, eps, and clip gradients"
    assert "eps=1e-08 is 0 in float16" in rep["hint"]
    assert rep["hint"].endswith("keep the weights and optimizer state in float32 (autocast for "
                                "float16 compute), or set eps=1e-4")
    tries = what_if(rep)
    # it proposed lr=0.1x and clip=1.0 alone, which cannot fix a division by 0
    assert list(tries) == ["lr=0.1x", "clip=1.0", "eps=1e-4", "dtype=float32"]
    assert [tries[t]["finite"] for t in tries] == [False, False, True, True]
    assert not any(t["inconclusive"] for t in tries.values())


def test_the_eps_the_report_proposes_trains_finite(out_dir):
    assert math.isfinite(train_half(out_dir, eps=1e-4, steps=20))


def test_without_a_window_the_bundle_alone_says_eps_is_lost(out_dir):
    """The default recorder's bundle holds the weights after the update: nothing is re-run,
    but the eps and the weights' dtype are in it."""
    with pytest.raises(NonFiniteError) as info:
        train_half(out_dir, rewind=None)
    rep = nanreplay(info.value.bundle_path)
    assert (rep["cause"], rep["reproduced"], rep["origin"]["param"]) == \
        ("optimizer", False, "emb.weight")
    # its first line read "NOT reproduced", which says the re-run came out finite
    # (nondeterminism), when nothing of the update was re-run
    assert rep["not_rerun"] == "the bundle holds the weights after the update"
    text = invoke_cli(info.value.bundle_path).stdout
    assert text.splitlines()[0] == ("nanreplay: step 0, optimizer event — not re-run (the "
                                    "bundle holds the weights after the update)"), text
    assert rep["hint"].startswith("Adam's update at step 0 made emb.weight non-finite (not "
                                  "re-run: the bundle holds the weights after it); eps=1e-08 "
                                  "is 0 in float16")

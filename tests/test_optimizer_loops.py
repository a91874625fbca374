"""End to end: training loops off the beaten path (progressive unfreezing, ...), recorded
and replayed as a user runs them."""

from __future__ import annotations

import json
from pathlib import Path

import loop_models as LM
import pytest
import torch
from bundles import invoke_cli
from torch import nn

from recorder import FlightRecorder, NonFiniteError

HERE = Path(__file__).parent


@pytest.fixture(autouse=True)
def _from_tests_dir(monkeypatch):
    monkeypatch.chdir(HERE)


def nanreplay_json(bundle: Path, *args: str) -> dict:
    r = invoke_cli(bundle, "--json", *args)
    assert r.stderr == "" and r.exit_code == 0, (r.exit_code, r.stderr)
    return json.loads(r.stdout)


@pytest.mark.parametrize("unfreeze", ["requires_grad", "add_param_group"])
def test_unfrozen_encoder_nan_gradient_is_a_backward_event(out_dir, unfreeze):
    """The encoder is frozen for a warm-up, then unfrozen: either the optimizer held it all
    along (``requires_grad_(True)``) or it is given to it then (``add_param_group``). A blank
    record at step 6 makes its gradient NaN; the recorder missed the gradients of parameters
    that did not train at attach, so the NaN went through the update and the report blamed
    the optimizer (or weights written outside it)."""
    model = LM.make_fine_tuned()
    held = model.parameters() if unfreeze == "requires_grad" else model.classifier.parameters()
    opt = torch.optim.AdamW(held, lr=1e-3)
    crit = nn.CrossEntropyLoss()
    model.encoder.requires_grad_(False)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="loop_models:make_fine_tuned"):
            for step in range(10):
                if step == 3:
                    model.encoder.requires_grad_(True)
                    if unfreeze == "add_param_group":
                        opt.add_param_group({"params": list(model.encoder.parameters()),
                                             "lr": 1e-4})
                x, y = LM.fine_tune_batch(step, blank=5 if step == 6 else None)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    event = info.value.event
    assert (event["step"], event["phase"]) == (6, "backward")
    assert event["params"] == ["encoder.proj.weight"]
    assert torch.isfinite(model.encoder.proj.weight).all()  # stopped before the update
    report = nanreplay_json(info.value.bundle_path)
    origin = report["origin"]
    assert (origin["phase"], origin["module"], origin["op"]) == \
        ("backward", "encoder", "SqrtBackward0")
    assert origin["samples"] == [5]
    assert report["cause"] == "invalid"

"""Buffers whose forward puts a new tensor in their place, rather than writing into them: a
rotary table grown for longer sequences (non-persistent, Hugging Face style), a normaliser's
running statistics updated by assignment. The bundle holds the tensors the model holds at the
event step's start (not those it held when the recorder attached), and the replay runs them."""

from __future__ import annotations

import json
from pathlib import Path

import buffer_models as B
import pytest
import torch
from bundles import invoke_cli
from models import check_event
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def _train_lm(out_dir: Path, pad_at: int, longer_from: int = 2) -> NonFiniteError:
    """Sequences of SHORT tokens, then LONG ones from step ``longer_from`` (the rotary table
    grows); at step ``pad_at`` row 2 is all padding."""
    model = B.make_rotary_lm()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss(ignore_index=0)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="buffer_models:make_rotary_lm"):
            for step in range(pad_at + 2):
                n = B.LONG if step >= longer_from else B.SHORT
                idx = torch.randint(1, B.VOCAB, (B.BATCH, n + 1), generator=g)
                if step == pad_at:
                    idx[2] = 0
                opt.zero_grad()
                crit(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten()).backward()
                opt.step()
    return info.value


def _report(bundle, *args) -> dict:
    return json.loads(invoke_cli(bundle, "--json", *args).stdout)


@pytest.mark.parametrize("pad_at", [4, 2], ids=["after-the-growth", "at-the-growth"])
def test_a_rotary_cache_the_forward_grew_is_bundled_and_replayed(out_dir, pad_at):
    """The table grows at step 2. The bundle held the table of the recorder's attach (6 rows)
    however long it had grown; with the right one, nanreplay refused a non-persistent buffer
    of another shape than the factory's, and a table grown in the event step itself failed
    the second re-run ('size of tensor a (12) must match the size of tensor b (6)')."""
    err = _train_lm(out_dir, pad_at)
    check_event(err.event, step=pad_at, phase="forward", module="norm", call=0, kind="nan",
                inputs_finite=True, samples=[2])
    _, t = read_bundle(err.bundle_path)
    rows = B.LONG if pad_at > 2 else B.SHORT  # as the step found it
    assert t["buffers/rot.cos_cached"].shape == (rows, B.D)
    rep = _report(err.bundle_path, "--try", "drop=2")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["samples"], rep["cause"]) == \
        (True, "norm", "aten.div", [2], "invalid"), rep
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_buffers_updated_by_assignment_are_bundled_as_the_step_found_them(out_dir):
    """A policy's observation normaliser updates its running mean and variance by assignment
    (new tensors each training forward). At step 5 an observation is NaN: the bundle held the
    statistics of the recorder's attach (zeros and ones), not those the step began with."""
    model = B.make_scaled_policy()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="buffer_models:make_scaled_policy"):
            for step in range(8):
                obs = 3.0 + 2.0 * torch.randn(16, 6, generator=g)
                if step == 5:
                    obs[7, 1] = float("nan")  # a sensor dropout
                    start = {n: b.clone() for n, b in model.named_buffers()}
                opt.zero_grad()
                crit(model(obs), torch.arange(16) % 4).backward()
                opt.step()
    check_event(info.value.event, step=5, phase="input", samples=[7])
    _, t = read_bundle(info.value.bundle_path)
    for name, value in start.items():
        assert torch.equal(t[f"buffers/{name}"], value), name
    assert _report(info.value.bundle_path)["reproduced"] is True

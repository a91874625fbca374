"""``out_dir`` as users write it: ``~/runs`` (a home directory Python's file functions do not
expand: the bundle went to a directory named ``~`` in the working directory), ``bytes``, and
a value that is no path at all (a raw ``pathlib`` TypeError before)."""

from __future__ import annotations

import models as M
import pytest
import torch
from models import bundles, check_event
from torch import nn

import replay
from recorder import FlightRecorder, NonFiniteError

NAN_STEP, NAN_ROW = 2, 4  # the plant: a NaN in this step's batch, in this row


def _nan_batch(step):
    x, y = M.batch(step)
    if step == NAN_STEP:
        x[NAN_ROW, 0] = float("nan")
    return x, y


def test_a_home_relative_out_dir_writes_under_home(tmp_path, monkeypatch):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    torch.manual_seed(0)
    model, crit = M.mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir="~/runs/nan") as rec:
            M.train(model, opt, crit, NAN_STEP + 2, make_batch=_nan_batch)
    assert rec.out_dir == home / "runs" / "nan"
    assert [p.name for p in bundles(home / "runs" / "nan")] == \
        [f"step{NAN_STEP:08d}-rank0.nan"]
    assert list(cwd.iterdir()) == []  # (no directory named '~' made here)
    check_event(info.value.event, step=NAN_STEP, phase="input")
    report = replay.replay(info.value.bundle_path)
    assert (report["event"]["step"], report["origin"]["samples"], report["cause"]) == \
        (NAN_STEP, [NAN_ROW], "input"), report


def test_bytes_out_dir_is_a_path(tmp_path):
    model = M.mlp()
    rec = FlightRecorder(model, out_dir=str(tmp_path / "b").encode())
    assert rec.out_dir == tmp_path / "b" and rec.out_dir.is_dir()


@pytest.mark.parametrize("bad", [None, 3, ["nan-bundles"]])
def test_an_out_dir_that_is_no_path_is_refused_in_one_line(bad):
    model = M.mlp()
    with pytest.raises(TypeError) as info:
        FlightRecorder(model, out_dir=bad)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(
        f"FlightRecorder: out_dir must be a directory path (a str or pathlib.Path), got "
        f"{type(bad).__name__}; pass where bundles go"), msg
    assert not model._forward_hooks and not model._forward_pre_hooks

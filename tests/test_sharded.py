"""Sharded parameters in one process (a world-size-1 gloo group): FSDP2 ``fully_shard`` is
recorded and replayed from its shard bundle; Partial parameters are refused in one line. The
two-rank runs (FSDP2, tensor parallelism) are in test_torchrun.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle
from replay.cli import main as cli

DIST = Path(__file__).parent / "dist"


@pytest.fixture
def group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def fsdp_train(monkeypatch):
    monkeypatch.chdir(DIST)  # where the factory fsdp_train:make_model lives
    monkeypatch.syspath_prepend(str(DIST))
    import fsdp_train

    yield fsdp_train
    sys.modules.pop("fsdp_train", None)


def test_fully_shard_on_one_rank_records_local_shards_and_replays(group, fsdp_train, tmp_path):
    """Every parameter is a DTensor (Shard(0) over a one-rank mesh): the recorder measures
    local shards, the bundle says where each sits, and the replay names the op."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = fsdp_train.make_model()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    crit = nn.CrossEntropyLoss()
    out = tmp_path / "b"
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out,
                            factory="fsdp_train:make_model"):
            for step in range(5):
                x = torch.randn(8, 12, generator=g)
                y = torch.randint(0, 5, (8,), generator=g)
                if step == 2:
                    x[3] = 0.0
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (2, "forward", "norm")
    assert "ranks" not in ev  # one rank: no agreement, no run id
    meta, tensors = read_bundle(info.value.bundle_path)
    assert meta["shards"]["weights/head.weight"]["placements"] == [{"shard": 0}]
    assert tensors["weights/head.weight"].shape == (5, 12)
    assert meta["model"]["class"] == "fsdp_train.Net"
    res = CliRunner().invoke(cli, ["--json", str(info.value.bundle_path)])
    assert res.exit_code == 0, res.output
    import json

    report = json.loads(res.stdout)
    assert (report["origin"]["module"], report["origin"]["op"], report["cause"]) == \
        ("norm", "aten.div", "invalid")
    assert report["event"]["step"] == 2 and report["origin"]["samples"] == [3]


def test_partial_parameters_are_refused_in_one_line(group, out_dir):
    """Tensor parallelism is recorded (tests/test_torchrun.py); a parameter with a Partial
    placement, whose ranks' pieces are summands the optimizer would step separately, is
    refused, naming what the replay can put back together."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    model = nn.Sequential(nn.Linear(4, 2))
    model[0].weight = nn.Parameter(DTensor.from_local(
        torch.ones(2, 4), init_device_mesh("cpu", (1,)), [Partial()], run_check=False))
    with pytest.raises(ValueError) as info:
        FlightRecorder(model, out_dir=out_dir)
    assert str(info.value) == (
        "FlightRecorder: parameter '0.weight' is a DTensor with placements (Partial(sum),), "
        "which is not supported: only Shard and Replicate parameters can be put back together "
        "for the replay; redistribute it to Shard or Replicate before training")

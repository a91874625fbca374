"""Point clouds of different sizes passed as one nested tensor: recorded, bundled and replayed,
its components the samples. Each test trains ``point_models.nested_pointnet`` as a user would
until the recorder raises, then runs ``nanreplay --json --try``."""

from __future__ import annotations

from pathlib import Path

import point_models as M
import pytest
import torch
from bundles import nanreplay_json
from torch import nn

from recorder import FlightRecorder, NonFiniteError

K = 3  # the step the planted bug fires at; cloud 2 of 4 holds it


pytestmark = [pytest.mark.usefixtures("in_tests_dir"),
              pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")]


def _train(plant: str, out_dir: Path) -> NonFiniteError:
    g = torch.Generator().manual_seed(0)
    model = M.nested_pointnet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="point_models:nested_pointnet"):
            for step in range(6):
                clouds = [torch.randn(int(torch.randint(20, 60, (1,), generator=g)), 3,
                                      generator=g) for _ in range(4)]
                if step == K and plant == "nan":
                    clouds[2][5, 1] = float("nan")  # a LiDAR return with no range
                if step == K and plant == "blank":
                    clouds[2][:] = 0.0  # a scan of all-zero returns: one point, repeated
                y = torch.randint(0, 5, (4,), generator=g)
                opt.zero_grad()
                crit(model(torch.nested.nested_tensor(clouds)), y).backward()
                opt.step()
    assert info.value.bundle_path is not None, info.value.write_error
    return info.value


def _replay(bundle, *tries: str) -> dict:
    return nanreplay_json(bundle, *(a for t in tries for a in ("--try", t)))


def test_a_nan_point_in_a_nested_batch_names_its_cloud(tmp_path):
    """Before, the recorder's event search raised out of ``optimizer.step()`` with a raw
    'RuntimeError: Internal error: NestedTensorImpl doesn't support sizes' and wrote no
    bundle. Now the nested input is an input event on cloud 2, bundled as its padded
    components and their sizes, and ``drop=2`` removes that cloud."""
    err = _train("nan", tmp_path)
    assert (err.event["step"], err.event["phase"], err.event["tensor"], err.event["samples"]) \
        == (K, "input", "batch", [2])
    rep = _replay(err.bundle_path, "drop=2")
    assert (rep["origin"]["phase"], rep["origin"]["samples"], rep["cause"]) == (
        "input", [2], "input")
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_a_blank_cloud_in_a_nested_batch_is_replayed_to_its_division(tmp_path):
    """A cloud whose points are all one point has radius 0: the unit-sphere scaling is 0/0.
    The replay rebuilds the nested batch and names the division, on cloud 2."""
    err = _train("blank", tmp_path)
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (K, "forward", "")
    rep = _replay(err.bundle_path, "auto")
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == (
        "forward", "", "aten.div", [2], "invalid")
    assert [(t["try"], t["finite"]) for t in rep["what_if"]] == [("drop=2", True)]

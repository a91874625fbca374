"""End to end: a model made of PyTorch's own modules only (``nn.Sequential`` of ``nn.Linear``,
``nn.Conv2d``, norms and activations, as a notebook or a first script builds it), recorded
without ``factory=``, is rebuilt by the replay from the bundle's description of its modules
(classes and constructor arguments: ``recorder/stock_model.py``, ``replay/stock_model.py``)
and the step re-run, where before nothing was ("factory not imported"). A description naming
any class outside ``torch.nn`` imports nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from bundles import factory_module, invoke_cli, rewrite
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle
from replay.stock_model import stock_factory

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 32, bias=False), nn.LayerNorm(32, eps=1e-3),
                         nn.GELU(approximate="tanh"), nn.Dropout(0.1), nn.Linear(32, 32),
                         nn.LeakyReLU(0.2), nn.Linear(32, 3))


def cnn() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False),
                         nn.BatchNorm2d(8, momentum=0.05), nn.ReLU(inplace=True),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 4 * 4, 10))


def train(tmp_path: Path, model: nn.Module, shape: tuple[int, ...], plant) -> NonFiniteError:
    """Four Adam steps of a classifier, recorded without a factory; ``plant(step, x, model)``
    plants the bug before the step's forward."""
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(1)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path):
            for step in range(4):
                x = torch.randn(6, *shape, generator=g)
                y = torch.randint(0, 3, (6,), generator=g)
                plant(step, x, model)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    return info.value


def replay_json(bundle: Path) -> tuple[dict, int]:
    r = invoke_cli(bundle, "--json")
    return json.loads(r.stdout), r.exit_code


def rebuilt(bundle: Path) -> nn.Module:
    meta, _ = read_bundle(bundle)
    return stock_factory(meta)()


def test_an_mlp_of_torch_modules_is_rebuilt_and_its_overflow_named(tmp_path):
    def plant(step, x, model):
        if step == 2:
            x[4] *= 1e30  # (features left unscaled in one record)

    model = mlp()
    err = train(tmp_path, model, (8,), plant)
    assert (err.event["step"], err.event["phase"]) == (2, "forward"), err.event
    # every constructor argument as built: bias=False, eps, approximate, p, negative_slope
    assert repr(rebuilt(err.bundle_path)) == repr(model)
    rep, code = replay_json(err.bundle_path)
    o = rep["origin"]
    assert (code, rep["reproduced"], rep["not_rerun"]) == (0, True, None), rep
    # (the first layer's outputs near 1e30 are finite; their squares in the norm are not)
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == (
        "1", "aten.native_layer_norm", [4], "overflow"), o
    [note] = [p for p in rep["problems"] if "no model factory" in p]
    assert "made of torch.nn's own modules only, was rebuilt from the bundle" in note, note


def test_a_cnn_of_torch_modules_is_rebuilt_with_its_running_statistics(tmp_path):
    def plant(step, x, model):
        if step == 2:  # (a bit flip in a weight between two steps)
            with torch.no_grad():
                model[0].weight[5, 1, 2, 0] = float("nan")

    model = cnn()
    err = train(tmp_path, model, (3, 16, 16), plant)
    copy = rebuilt(err.bundle_path)
    assert repr(copy) == repr(model)
    assert [n for n, _ in copy.named_buffers()] == [n for n, _ in model.named_buffers()]
    rep, code = replay_json(err.bundle_path)
    assert (code, rep["reproduced"], rep["cause"]) == (0, True, "weights"), rep
    assert rep["origin"]["params"] == ["0.weight"], rep["origin"]
    assert rep["event"]["step"] == 2


def test_a_description_naming_another_class_imports_nothing(tmp_path):
    """A bundle whose description names a module outside torch.nn (here one under the
    current directory that writes a file when imported) rebuilds nothing and imports
    nothing: the report is the recorder's, with the factory option to pass."""
    def plant(step, x, model):
        if step == 2:
            x[4] *= 1e37

    err = train(tmp_path / "run", mlp(), (8,), plant)
    marker = tmp_path / "imported"
    factory_module(tmp_path / "code", "stock_evil", marker)

    def edit(meta):
        meta["model"]["stock"]["children"]["1"]["class"] = "stock_evil:make_model"
        return meta

    bundle = rewrite(err.bundle_path, tmp_path / "edited" / err.bundle_path.name, meta=edit)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path / "code")
        rep, code = replay_json(bundle)
    assert (code, rep["reproduced"], rep["not_rerun"]) == (1, False, "factory not imported")
    [note] = [p for p in rep["problems"] if "no model factory" in p]
    assert "'stock_evil:make_model' is not one of torch.nn's" in note, note
    assert not marker.exists()


def test_a_sequential_holding_a_users_module_is_not_described(tmp_path):
    class Scale(nn.Module):
        def forward(self, x):
            return x * 2

    def plant(step, x, model):
        if step == 2:
            x[4, 1] = float("nan")

    err = train(tmp_path, nn.Sequential(nn.Linear(8, 3), Scale()), (8,), plant)
    meta, _ = read_bundle(err.bundle_path)
    assert "stock" not in meta["model"] and stock_factory(meta) is None

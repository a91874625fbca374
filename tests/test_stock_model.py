"""End to end: a model made of PyTorch's own modules only (``nn.Sequential`` of ``nn.Linear``,
``nn.Conv2d``, norms and activations, as a notebook or a first script builds it), recorded
without ``factory=``, is rebuilt by the replay from the bundle's description of its modules
(classes and constructor arguments: ``recorder/stock_model.py``, ``replay/stock_model.py``)
and the step re-run, where before nothing was ("factory not imported"). A description naming
any class outside ``torch.nn`` imports nothing."""

from __future__ import annotations

import copy
import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from bundles import factory_module, invoke_cli, rewrite
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import jsonable, read_bundle
from recorder.stock_model import describe_stock
from replay.stock_model import NotStock, stock_factory

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


# ---------------------------------------------------------------------------------------------
# The stock models of notebooks and first scripts, one by one: each rebuilt as it was built
# (repr, parameters and buffers, the same forward), and its step re-run to the planted origin.


def frozen_bn() -> nn.Sequential:
    """A BatchNorm frozen with eval() in a training model: the replay runs it in eval too (in
    train mode its batch variance overflows first, not the LayerNorm after it)."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.Flatten(), nn.Linear(64, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    model[1].eval()
    return model


def tied_lm() -> nn.Sequential:
    """A token model whose head is the embedding's transpose (its weight tied to it)."""
    model = nn.Sequential(nn.Embedding(20, 8), nn.LayerNorm(8), nn.Linear(8, 20, bias=False))
    model[2].weight = model[0].weight
    return model


def shared_layer() -> nn.Sequential:
    """One Linear applied twice (the same module at two places)."""
    layer = nn.Linear(8, 8)
    return nn.Sequential(layer, nn.ReLU(), layer, nn.Tanh(), nn.Linear(8, 3))


def ties(model: nn.Module) -> dict[str, str]:
    """Each tensor of the model reached under a second name, by the first."""
    first: dict[int, str] = {}
    return {n: first.setdefault(id(t), n)
            for n, t in [*model.named_parameters(remove_duplicate=False),
                         *model.named_buffers(remove_duplicate=False)]
            if first.setdefault(id(t), n) != n}


def images(*shape):
    return lambda g: torch.randn(6, *shape, generator=g)


def tokens(g):
    return torch.randint(0, 20, (6, 5), generator=g)


# (model, input, plant): ("scale", f) multiplies sample 4 of step 2's batch by f, ("nan", name,
# index) writes NaN into that parameter before step 2
STOCK_MODELS = {
    "conv1d": (lambda: nn.Sequential(
        nn.Conv1d(4, 6, 3, stride=2, padding=2, dilation=2, groups=2, padding_mode="reflect",
                  bias=False), nn.BatchNorm1d(6, affine=False), nn.ELU(0.5),
        nn.AdaptiveMaxPool1d(3), nn.Flatten(), nn.Linear(18, 3)), images(4, 12),
        ("nan", "0.weight", (2, 1, 1))),
    "conv2d": (lambda: nn.Sequential(
        nn.Conv2d(3, 8, 3, padding="same", padding_mode="circular"), nn.GroupNorm(2, 8),
        nn.SiLU(), nn.MaxPool2d(3, 2, 1, ceil_mode=True),
        nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=4, bias=False), nn.Mish(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3)), images(3, 7, 7),
        ("nan", "4.weight", (3, 0, 1, 1))),
    "conv3d": (lambda: nn.Sequential(
        nn.Conv3d(2, 4, (1, 3, 3), stride=(1, 2, 2), padding=(0, 1, 1),
                  padding_mode="replicate"), nn.BatchNorm3d(4, track_running_stats=False),
        nn.ReLU6(), nn.Flatten(), nn.Linear(4 * 2 * 3 * 3, 3)), images(2, 2, 6, 6),
        ("nan", "0.weight", (1, 0, 0, 1, 2))),
    "conv_transpose": (lambda: nn.Sequential(
        nn.ConvTranspose2d(4, 4, 3, stride=2, padding=1, output_padding=1, groups=2,
                           bias=False), nn.InstanceNorm2d(4, affine=True), nn.LeakyReLU(0.1),
        nn.PixelShuffle(2), nn.Flatten(), nn.Linear(64, 3)), images(4, 2, 2),
        ("nan", "1.weight", (2,))),
    "batchnorm1d": (lambda: nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16, momentum=None),
        nn.BatchNorm1d(16, affine=False, track_running_stats=False), nn.PReLU(16, init=0.1),
        nn.Linear(16, 3)), images(8), ("nan", "1.weight", (5,))),
    "layer_norms": (lambda: nn.Sequential(
        nn.Linear(8, 16, bias=False), nn.Softplus(beta=2.0, threshold=10.0),
        nn.LayerNorm(16, eps=1e-3, bias=False), nn.Hardtanh(-2.0, 3.0),
        nn.LayerNorm([16], elementwise_affine=False), nn.RMSNorm(16, eps=1e-5),
        nn.Linear(16, 3)), images(8), ("nan", "2.weight", (4,))),
    "embedding": (lambda: nn.Sequential(
        nn.Embedding(20, 4, padding_idx=0, max_norm=1.0), nn.Flatten(), nn.Identity(),
        nn.Linear(20, 3)), tokens, ("nan", "3.weight", (1, 7))),
    "embedding_bag": (lambda: nn.Sequential(
        nn.EmbeddingBag(20, 4, mode="max", padding_idx=2), nn.Linear(4, 3)), tokens,
        ("nan", "1.weight", (2, 3))),
    "dropouts": (lambda: nn.Sequential(
        nn.Linear(8, 32), nn.Unflatten(1, (8, 2, 2)), nn.Dropout2d(0.1),
        nn.Conv2d(8, 4, 1), nn.Flatten(), nn.AlphaDropout(0.2), nn.Dropout(0.3),
        nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 3)), images(8), ("scale", 1e30)),
    "activations": (lambda: nn.Sequential(
        nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.ELU(alpha=0.3), nn.GELU(approximate="tanh"),
        nn.CELU(0.5), nn.Softplus(beta=0.5, threshold=5.0), nn.Linear(16, 16), nn.Softmax(dim=1),
        nn.Linear(16, 16), nn.LogSoftmax(dim=1), nn.Linear(16, 3)), images(8),
        ("nan", "6.bias", (3,))),
    "pools_upsample": (lambda: nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.MaxPool2d(3, 2, 1, ceil_mode=True),
        nn.AvgPool2d(3, stride=1, padding=1, count_include_pad=False),
        nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True), nn.PixelShuffle(2),
        nn.BatchNorm2d(1), nn.Flatten(), nn.Linear(400, 3)), images(3, 11, 11),
        ("scale", 1e38)),
    "nested": (lambda: nn.Sequential(
        nn.Sequential(nn.Linear(8, 16), nn.Sequential(nn.Tanh(), nn.Dropout(0.1))),
        nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)), nn.Linear(16, 3)), images(8),
        ("nan", "1.0.weight", (2, 9))),
    "ordered_dict": (lambda: nn.Sequential(OrderedDict([
        ("fc1", nn.Linear(8, 16)), ("act", nn.Hardswish()), ("norm", nn.RMSNorm(16)),
        ("head", nn.Linear(16, 3, bias=False))])), images(8), ("scale", 1e38)),
    "frozen_batchnorm": (frozen_bn, images(3, 4, 4), ("scale", 1e30)),
    # (tied: the bundle holds the tensor under its first name alone)
    "tied_embedding": (tied_lm, tokens, ("nan", "1.weight", (3,))),
    "shared_layer": (shared_layer, images(8), ("nan", "4.weight", (1, 5))),
    # (a torch.Size, as x.shape[1:] gives it, and a float -inf, which the bundle spells 'inf')
    "size_and_inf": (lambda: nn.Sequential(
        nn.Linear(8, 16), nn.Unflatten(1, torch.Size([4, 4])), nn.Hardtanh(float("-inf"), 6.0),
        nn.Flatten(), nn.Linear(16, 3)), images(8), ("nan", "4.weight", (0, 2))),
}


def first_nonfinite_leaf(model: nn.Module, x: torch.Tensor) -> str | None:
    """The first leaf module, in the order they run, whose output is not finite: the step's
    forward on a copy, without the recorder, its dropout masks the same."""
    seen: list[str] = []

    def hook(name):
        return lambda m, args, out: seen.append(name) if not out.isfinite().all() else None

    model, rng = copy.deepcopy(model), torch.get_rng_state()
    for name, m in model.named_modules():
        if not any(m.children()):
            m.register_forward_hook(hook(name))
    with torch.no_grad():
        model(x.clone())
    torch.set_rng_state(rng)
    return seen[0] if seen else None


def train_stock(tmp_path: Path, model: nn.Module, batch, plant) -> tuple[NonFiniteError, Any]:
    """Three SGD steps towards zero outputs, recorded without a factory, the plant before the
    third; and the module whose output first overflows in that step (scale plants)."""
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    crit = nn.MSELoss()
    g = torch.Generator().manual_seed(1)
    expected = None
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path):
            for step in range(3):
                x = batch(g)
                if step == 2 and plant[0] == "scale":
                    x[4] *= plant[1]
                    expected = first_nonfinite_leaf(model, x)
                elif step == 2:
                    with torch.no_grad():
                        model.get_parameter(plant[1])[plant[2]] = float("nan")
                opt.zero_grad()
                out = model(x)
                crit(out, torch.zeros_like(out)).backward()
                opt.step()
    return info.value, expected


@pytest.mark.parametrize("name", list(STOCK_MODELS))
def test_a_stock_model_is_rebuilt_as_built_and_its_step_rerun(tmp_path, name):
    build, batch, plant = STOCK_MODELS[name]
    model = build()
    before = copy.deepcopy(model)
    err, expected = train_stock(tmp_path, model, batch, plant)
    phase = "forward" if plant[0] == "scale" else "weights"  # (found as the step begins)
    assert (err.event["step"], err.event["phase"]) == (2, phase), err.event
    copy_ = rebuilt(err.bundle_path)
    assert repr(copy_) == repr(model)
    assert {k: v.shape for k, v in copy_.state_dict().items()} == \
        {k: v.shape for k, v in model.state_dict().items()}
    assert ties(copy_) == ties(model)
    # the same forward: the rebuilt model holding the first weights computes what they did
    copy_.load_state_dict(before.state_dict())
    copy_.eval(), before.eval()
    x = batch(torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(copy_(x.clone()), before(x.clone()))
    rep, code = replay_json(err.bundle_path)
    assert (code, rep["reproduced"], rep["not_rerun"]) == (0, True, None), rep
    o = rep["origin"]
    if plant[0] == "scale":
        assert expected is not None and (o["module"], rep["cause"]) == (expected, "overflow"), o
    else:  # (found as the step began, and re-run to the module whose op reads it first)
        owner = plant[1].rpartition(".")[0]
        assert (o["params"], o["module"], rep["cause"]) == ([plant[1]], owner, "weights"), o
        assert o["op"] is not None, o
    [note] = [p for p in rep["problems"] if "no model factory" in p]
    assert "made of torch.nn's own modules only, was rebuilt from the bundle" in note, note


RNNS = {  # (constructors taking *args, **kwargs: their arguments are RNNBase's)
    "lstm": lambda: nn.LSTM(4, 8, num_layers=2, batch_first=True, bidirectional=True),
    "gru": lambda: nn.GRU(4, 6, bias=False, batch_first=True, dropout=0.1, num_layers=2),
    "rnn_relu": lambda: nn.RNN(4, 5, nonlinearity="relu", batch_first=True),
}


@pytest.mark.parametrize("name", list(RNNS))
def test_a_recurrent_layer_of_torch_is_rebuilt_and_its_step_rerun(tmp_path, name):
    """nn.LSTM, nn.GRU and nn.RNN take ``*args, **kwargs`` and pass RNNBase its ``mode``
    themselves (nn.GRU refuses ``proj_size`` even at 0): rebuilt with the arguments the base
    takes, each given where it is not its default; the relu of nn.RNN set as recorded."""
    model = RNNS[name]()
    before = copy.deepcopy(model)
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=tmp_path):
            for step in range(3):
                if step == 2:
                    with torch.no_grad():
                        model.weight_hh_l0[1, 2] = float("nan")
                opt.zero_grad()
                out, _ = model(torch.randn(6, 5, 4, generator=g))
                out.pow(2).mean().backward()
                opt.step()
    err = info.value
    copy_ = rebuilt(err.bundle_path)
    assert repr(copy_) == repr(model)
    assert {k: v.shape for k, v in copy_.state_dict().items()} == \
        {k: v.shape for k, v in model.state_dict().items()}
    copy_.load_state_dict(before.state_dict())
    x = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(copy_.eval()(x)[0], before.eval()(x)[0])
    rep, code = replay_json(err.bundle_path)
    assert (code, rep["reproduced"], rep["not_rerun"]) == (0, True, None), rep
    o = rep["origin"]
    assert (o["params"], o["module"], rep["cause"]) == (["weight_hh_l0"], "", "weights"), o
    assert o["op"] is not None, o


def test_a_transformer_layer_is_not_rebuilt_and_the_report_says_why(tmp_path):
    """nn.TransformerEncoderLayer keeps its d_model and nhead in no attribute of its own (its
    children hold them, under other names, and its activation is a function): the replay
    re-runs nothing and names the arguments it could not find."""
    def plant(step, x, model):
        if step == 2:
            x[4] *= 1e30  # (an overflow in the forward: the step must be re-run)

    model = nn.Sequential(nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True),
                          nn.Flatten(), nn.Linear(8, 3))
    err = train(tmp_path, model, (2, 4), plant)
    assert (err.event["step"], err.event["phase"]) == (2, "forward"), err.event
    rep, code = replay_json(err.bundle_path)
    assert (code, rep["reproduced"], rep["not_rerun"]) == (1, False, "factory not imported"), rep
    [note] = [p for p in rep["problems"] if "no model factory" in p]
    assert "torch.nn.modules.transformer:TransformerEncoderLayer (module '0') keeps its " \
        "constructor's 'd_model', 'nhead' in no plain attribute, so it cannot be rebuilt from " \
        "the bundle" in note, note


@pytest.mark.parametrize("build, reason", [
    (lambda: nn.MultiheadAttention(8, 2, add_bias_kv=True),
     "torch.nn.modules.activation:MultiheadAttention (the model) is built without its "
     "'bias_k', 'bias_v', which the bundle holds: the constructor argument that makes it is "
     "kept in no attribute"),
    (lambda: nn.AdaptiveLogSoftmaxWithLoss(64, 10, [4, 8]),  # (cutoffs kept with n_classes)
     "torch.nn.modules.adaptive:AdaptiveLogSoftmaxWithLoss (the model) was not rebuilt from "
     "its recorded attributes (ValueError: cutoffs should be"),
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.TransformerDecoderLayer(4, 2, 8)),
     "torch.nn.modules.transformer:TransformerDecoderLayer (module '1') keeps its "
     "constructor's 'd_model', 'nhead' in no plain attribute"),
])
def test_a_module_its_attributes_cannot_rebuild_is_refused_by_name(build, reason):
    """Modules of torch.nn whose recorded attributes do not rebuild them: the reason names
    the module and what is missing (the replay's note carries it: the test above)."""
    model = build()
    meta = {"model": {"stock": json.loads(json.dumps(jsonable(describe_stock(model))))},
            "params": [n for n, _ in model.named_parameters()],
            "buffers": [n for n, _ in model.named_buffers()]}
    with pytest.raises(NotStock) as info:
        stock_factory(meta)()
    assert reason in str(info.value), info.value

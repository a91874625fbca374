"""Property-based: small architectures drawn from stacks of Linear, Conv1d, LayerNorm,
BatchNorm1d, GELU, ReLU, residual MLPs, nn.MultiheadAttention (with a key padding mask or
without) and nn.LSTM, with one planted fault at a drawn depth that goes off at a drawn step on
drawn rows (a gate tensor passed into ``forward``), trained under the recorder and replayed:
the report names the step, the plant's module, its op, the gated rows and the cause the plant
implies."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from replay import replay

B, T, D = 6, 4, 8


class Conv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(D, D, 3, padding=1)

    def forward(self, h):
        return self.conv(h.transpose(1, 2)).transpose(1, 2)


class BN(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(D)

    def forward(self, h):
        return self.bn(h.transpose(1, 2)).transpose(1, 2)


class Res(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D)

    def forward(self, h):
        return h + self.fc2(self.act(self.fc1(h)))


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(D, 2, batch_first=True)

    def forward(self, h, mask=None):
        return h + self.mha(h, h, h, key_padding_mask=mask, need_weights=False)[0]


class LSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(D, D, batch_first=True)

    def forward(self, h):
        return self.lstm(h)[0]


LAYERS = {"linear": lambda: nn.Linear(D, D), "conv1d": Conv, "layernorm": lambda: nn.LayerNorm(D),
          "batchnorm": BN, "gelu": nn.GELU, "relu": nn.ReLU, "res": Res, "mha": Attn,
          "lstm": LSTM}


class Plant(nn.Module):
    """The fault: ``g`` is 1 on the gated rows of the step it goes off at, else 0."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.w = nn.Parameter(torch.ones(D))  # (the loop writes a NaN into it: "weight")
        self.p = nn.Parameter(-torch.ones(D))  # (used once, with a gradient of 0: "adam")
        # rows at 3000 + 0.01 k: E[x²] - E[x]² is -1 in float32, 5e-4 in exact arithmetic
        self.register_buffer("near", 3000 + 0.01 * torch.arange(D, dtype=torch.float32))

    def forward(self, h, gate):
        g, k = gate[:, None, None], self.kind
        if k == "log_neg":
            return torch.log(torch.sigmoid(h) - g)
        if k == "sqrt0":  # (forward finite: 0; its derivative infinite)
            return h / (torch.sqrt((h * (1 - g)).pow(2).sum(-1, keepdim=True)) + 1)
        if k == "exp":
            return torch.exp(h + 100 * g)
        if k == "div_x0":
            return (h.abs() + 1) / (1 - g)
        if k == "div_00":
            z = h * (1 - g)
            return z / z.abs().sum(-1, keepdim=True)
        if k == "var":
            x = h * (1 - g) + g * self.near
            m = x.mean(-1, keepdim=True)
            return (x - m) / torch.sqrt((x * x).mean(-1, keepdim=True) - m * m + 1e-5)
        if k == "softmax_log":
            return torch.log(torch.softmax(h * (1 + 1e4 * g), -1))
        if k == "adam":
            return h + torch.relu(self.p) if bool(gate.any()) else h
        return h * self.w


class Net(nn.Module):
    def __init__(self, layers, at, plant):
        super().__init__()
        kinds = list(layers[:at]) + ["plant"] + list(layers[at:])
        self.blocks = nn.ModuleList(Plant(plant) if k == "plant" else LAYERS[k]() for k in kinds)
        self.inp, self.head = nn.Linear(5, D), nn.Linear(D, 3)

    def forward(self, x, gate, mask=None):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h, gate) if isinstance(b, Plant) else b(h, mask) if isinstance(b, Attn) else b(h)
        return self.head(h.mean(1))


# plant: (phase, op, cause); "adam"'s op is the update's, re-run from the guard's copies
PLANTS = {"log_neg": ("forward", "aten.log", "invalid"),
          "sqrt0": ("backward", "SqrtBackward0", "invalid"),
          "exp": ("forward", "aten.exp", "overflow"), "div_x0": ("forward", "aten.div", "invalid"),
          "div_00": ("forward", "aten.div", "invalid"),
          "var": ("forward", "aten.sqrt", "precision"),
          "softmax_log": ("forward", "aten.log", "underflow"),
          "weight": ("weights", "aten.mul", "weights"),
          "adam": ("optimizer", "aten.addcdiv_", "optimizer")}
SETUPS = st.fixed_dictionaries(dict(
    layers=st.lists(st.sampled_from(sorted(LAYERS)), min_size=1, max_size=3),
    at=st.integers(0, 3), step=st.integers(0, 2), mask=st.booleans(),
    rows=st.lists(st.integers(0, B - 1), min_size=1, max_size=2, unique=True).map(sorted)))


def _train(setup, plant, out_dir):
    """Trains until the plant goes off; the event."""
    torch.manual_seed(0)
    at = min(setup["at"], len(setup["layers"]))
    model = Net(setup["layers"], at, plant)
    p = model.blocks[at].p  # (eps=0 for it alone: a bias before a BatchNorm has grads of 0)
    opt = torch.optim.Adam([{"params": [q for q in model.parameters() if q is not p]},
                            {"params": [p], "eps": 0 if plant == "adam" else 1e-8}], lr=1e-2)
    crit, g = nn.CrossEntropyLoss(), torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, guard_optimizer=True):
            for step in range(setup["step"] + 2):
                x, y = torch.randn(B, T, 5, generator=g), torch.randint(0, 3, (B,), generator=g)
                gate, mask = torch.zeros(B), torch.zeros(B, T, dtype=torch.bool)
                mask[:, 2:] = torch.rand(B, T - 2, generator=g) < 0.5
                if step == setup["step"]:
                    gate[setup["rows"]] = 1.0
                    if plant == "weight":
                        with torch.no_grad():
                            model.blocks[at].w[3] = float("nan")
                opt.zero_grad()
                loss = crit(model(x, gate, mask) if setup["mask"] else model(x, gate), y)
                loss.backward()
                opt.step()
    return at, info.value


def _check(setup, plant, out_dir):
    at, error = _train(setup, plant, out_dir)
    phase, op, cause = PLANTS[plant]
    assert (error.event["step"], error.event["phase"]) == (setup["step"], phase)
    rep = replay(error.bundle_path, factory=lambda: Net(setup["layers"], at, plant))
    o = rep["origin"]
    assert rep["reproduced"] and (rep["cause"], o["op"]) == (cause, op), rep["hint"]
    if plant == "adam":  # (no module: the update's parameter)
        assert o["param"] == f"blocks.{at}.p", o
        return
    assert o["module"] == f"blocks.{at}", o
    assert plant == "weight" or o["samples"] == setup["rows"], o
    assert "test_replay_plants_fuzz.py" in o["source"], o


@pytest.mark.parametrize("plant", sorted(PLANTS))
@settings(max_examples=1, derandomize=True, deadline=None, database=None)
@given(setup=SETUPS)
def test_planted_fault_is_replayed(tmp_path_factory, plant, setup):
    _check(setup, plant, tmp_path_factory.mktemp("bundles"))

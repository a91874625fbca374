"""TensorDict and ``@tensorclass`` batches (torchrl-style pipelines: a ``collate_fn`` returning
``TensorDict(..., batch_size=[B])`` with nested keys, a ``TensorDictSequential`` of
``TensorDictModule``s writing their outputs into the batch it returns, a loss reading the
TensorDict). They were stored as PyG-style keyed objects and dataclasses: the replay rebuilt a
TensorDict with ``batch_size=[]`` (a loss reading ``td.batch_size[0]`` raised) and a
tensorclass with no ``_tensordict`` (``nanreplay`` stopped: 'replay failed (AttributeError:
'Batch' object has no attribute '_tensordict')')."""

from __future__ import annotations

import sys

import pytest
import torch
from bundles import invoke_cli

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle
from replay import replay

pytest.importorskip("tensordict")

MODEL_CODE = '''
import torch
from tensordict import TensorDict, tensorclass
from tensordict.nn import TensorDictModule, TensorDictSequential
from torch import nn

F, A = 6, 3


class Standardise(nn.Module):
    def forward(self, x):
        return (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True)  # no eps


def make_model():
    return TensorDictSequential(
        TensorDictModule(Standardise(), in_keys=[("obs", "pixels")], out_keys=[("obs", "normed")]),
        TensorDictModule(nn.Sequential(nn.Linear(F, 16), nn.Tanh()), in_keys=[("obs", "normed")],
                         out_keys=["hidden"]),
        TensorDictModule(nn.Linear(16, A), in_keys=["hidden"], out_keys=["logits"]),
        TensorDictModule(nn.Linear(16, 1), in_keys=["hidden"], out_keys=["value"]))


class ActorCriticLoss(nn.Module):
    def forward(self, td):
        p = torch.softmax(td["logits"], -1).gather(-1, td["action"].unsqueeze(-1)).squeeze(-1)
        pg = -(torch.log(p * td["valid"]) * td["advantage"]).sum()
        return (pg + (td["value"].squeeze(-1) - td["ret"]).pow(2).sum()) / td.batch_size[0]


@tensorclass
class Batch:
    obs: torch.Tensor
    reward: torch.Tensor


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(F, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, batch):
        return self.net(batch.obs).squeeze(-1)


def collate(rows):
    px, act, ret, adv, valid, ids = (torch.stack(c) for c in zip(*rows))
    return TensorDict({"obs": {"pixels": px}, "action": act, "ret": ret, "advantage": adv,
                       "valid": valid, "sample_id": ids}, batch_size=[len(rows)])


def collate_class(rows):
    px, _, ret, _, _, _ = (torch.stack(c) for c in zip(*rows))
    return Batch(obs=px, reward=ret, batch_size=[len(rows)])
'''
B, STEPS = 8, 5
KEYS = ["obs", "action", "ret", "advantage", "valid", "sample_id"]  # what collate puts in the batch


@pytest.fixture
def mod(tmp_path, monkeypatch):
    name = f"tdm_{tmp_path.name[-12:].replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(MODEL_CODE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield __import__(name)
    sys.modules.pop(name, None)


class Rollouts(torch.utils.data.Dataset):
    """Records ``i``: NaN pixel at ``nan``, constant pixels at ``flat``, valid 0 at ``void``."""

    def __init__(self, nan=None, flat=None, void=None):
        self.nan, self.flat, self.void = nan, flat, void

    def __len__(self):
        return STEPS * B

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        px = torch.randn(6, generator=g)
        px[2] = float("nan") if i == self.nan else px[2]
        px = torch.full_like(px, 0.5) if i == self.flat else px
        return (px, torch.randint(0, 3, (), generator=g), torch.randn((), generator=g),
                torch.randn((), generator=g), torch.tensor(float(i != self.void)), torch.tensor(i))


def train(mod, data, out_dir=None, tensorclass=False):
    """The loop a user writes; the recorder around it when ``out_dir`` is given."""
    torch.manual_seed(0)
    model = mod.Regressor() if tensorclass else mod.make_model()
    loss_fn = mod.ActorCriticLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(
        data, batch_size=B, collate_fn=mod.collate_class if tensorclass else mod.collate)
    rec = FlightRecorder(model, opt, loss_fn=None if tensorclass else loss_fn, out_dir=out_dir,
                         rewind=2, factory=f"{mod.__name__}:"
                         + ("Regressor" if tensorclass else "make_model")) if out_dir else None
    losses, tds = [], []
    with rec if rec is not None else torch.enable_grad():
        for td in loader:
            opt.zero_grad()
            if tensorclass:
                loss = (model(td) - td.reward).pow(2).mean()
                rec.record_loss(loss) if rec is not None else None
            else:
                loss = loss_fn(model(td))  # the model returns td, its outputs written into it
            loss.backward()
            opt.step()
            losses.append(loss.item())
            tds.append(td)
    return losses, tds


def event_of(mod, data, tmp_path, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(mod, data, tmp_path / "bundles", **kw)
    return info.value.event, info.value.bundle_path


def test_a_nan_in_a_nested_key_is_an_input_event_of_the_loaders_batch(mod, tmp_path):
    step, row = 3, 5
    ev, path = event_of(mod, Rollouts(nan=step * B + row), tmp_path)
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == \
        (step, "input", 'batch["obs"]["pixels"]', [row])
    meta, _ = read_bundle(path)
    node = meta["micro_batches"][0]["inputs"]["$list"][0]["$list"][0]
    # the batch as the loader gave it: none of the keys the modules wrote into it
    assert [k for k, _ in node["$fields"]] == KEYS and node["$batch_size"] == [B]
    assert [k for k, _ in node["$fields"][0][1]["$fields"]] == ["pixels"]

    rep = replay(path, tries=[f"drop={row}"])  # (the loss reads td.batch_size[0])
    assert rep["reproduced"] and rep["cause"] == "input" and rep["event"]["step"] == step
    assert (rep["origin"]["tensor"], rep["origin"]["samples"]) == ('batch["obs"]["pixels"]', [row])
    assert rep["origin"]["records"] == {'batch["sample_id"]': [step * B + row]}
    (t,) = rep["what_if"]
    assert t["finite"] is True and t["inconclusive"] is False


def test_a_zero_over_zero_in_a_tensordict_module_and_a_log_of_zero_in_the_loss(mod, tmp_path):
    step, row = 2, 6
    ev, path = event_of(mod, Rollouts(flat=step * B + row), tmp_path)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == \
        (step, "forward", "module.0.module", [row])
    res = invoke_cli(path, "--try", "lr=1e-3")
    assert res.exit_code == 0, res.stdout + res.stderr
    assert "origin     forward: nan made by aten.div in module.0.module" in res.stdout
    assert f"samples    [{row}]" in res.stdout and "cause      invalid" in res.stdout
    assert "what-if    lr=1e-3" in res.stdout and "not re-run" not in res.stdout

    step, row = 3, 4
    ev, path = event_of(mod, Rollouts(void=step * B + row), tmp_path / "log")
    assert (ev["step"], ev["phase"], ev["module"]) == (step, "loss", "<loss>")
    rep = replay(path)
    o = rep["origin"]
    assert rep["reproduced"] and rep["cause"] == "invalid" and rep["event"]["step"] == step
    assert (o["op"], o["module"], o["samples"]) == ("aten.log", "<loss>", [row])


def test_a_tensorclass_batch_replays(mod, tmp_path):
    step, row = 2, 3
    ev, path = event_of(mod, Rollouts(nan=step * B + row), tmp_path, tensorclass=True)
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == \
        (step, "input", "batch.obs", [row])
    rep = replay(path, tries=[f"drop={row}"])
    assert rep["reproduced"] and rep["cause"] == "input"
    assert (rep["origin"]["tensor"], rep["origin"]["samples"]) == ("batch.obs", [row])
    assert rep["what_if"][0]["finite"] is True


@pytest.mark.parametrize("tensorclass", [False, True])
def test_healthy_tensordict_runs_are_bit_identical_under_the_recorder(mod, tmp_path, tensorclass):
    plain, plain_tds = train(mod, Rollouts(), tensorclass=tensorclass)
    recorded, tds = train(mod, Rollouts(), tmp_path / "b", tensorclass=tensorclass)
    assert recorded == plain and len(recorded) == STEPS
    assert not (tmp_path / "b").exists() or not list((tmp_path / "b").iterdir())
    if not tensorclass:  # the user's batch still holds what the modules wrote into it
        assert set(tds[-1].keys()) == set(plain_tds[-1].keys()) >= {"logits", "value"}
        assert torch.equal(tds[-1]["logits"], plain_tds[-1]["logits"])

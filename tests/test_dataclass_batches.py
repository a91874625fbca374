"""A ``collate_fn`` returning a dataclass, passed whole to the model (``model(batch)``, as
torchrec-style pipelines do): its tensors are root inputs like a dict's. They were not walked:
a NaN in ``batch.values`` was blamed on the root module 'whose inputs were finite', the bundle
kept the batch as its ``repr`` only and ``nanreplay`` stopped with 'cannot be rebuilt'."""

from __future__ import annotations

import sys

import pytest
import torch
from bundles import invoke_cli
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle
from replay import replay

MODEL_CODE = '''
from dataclasses import dataclass, field

import torch
from torch import nn

NF, D = 6, 16


@dataclass(frozen=True)
class Batch:
    values: torch.Tensor       # (B, NF) numeric features, 0 where missing
    present: torch.Tensor      # (B, NF) bool
    label: torch.Tensor
    source: str = "train"
    ids: list = field(default_factory=list)

    @property
    def padding(self):
        return ~self.present


class TabTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(NF, D) * 0.1)
        layer = nn.TransformerEncoderLayer(D, 2, 32, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(D, 2)

    def forward(self, batch: Batch):
        h = self.enc(batch.values.unsqueeze(-1) * self.w, src_key_padding_mask=batch.padding)
        return self.head(h.mean(1))


def make_model():
    return TabTransformer()


def collate(rows):
    v, p, y, i = zip(*rows)
    return Batch(torch.stack(v), torch.stack(p), torch.tensor(y), ids=list(i))
'''
BATCH, BAD_STEP, BAD_ROW = 8, 3, 5


@pytest.fixture
def project(tmp_path, monkeypatch):
    root = tmp_path / "proj"
    root.mkdir()
    name = f"tab_{tmp_path.name[-12:].replace('-', '_')}"
    (root / f"{name}.py").write_text(MODEL_CODE)
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.chdir(root)
    yield root, name
    sys.modules.pop(name, None)


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 8 * BATCH

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        v, present = torch.randn(6, generator=g), torch.rand(6, generator=g) > 0.2
        present[0] = True
        if i == BAD_STEP * BATCH + BAD_ROW:
            v[2] = float("nan")  # a cell the parser could not read
        return v.masked_fill(~present, 0.0), present, int(v[0] > 0), i


def test_a_nan_in_a_dataclass_batch_is_an_input_event_and_replays(project):
    root, name = project
    mod = __import__(name)
    torch.manual_seed(0)
    model, crit = mod.make_model(), nn.CrossEntropyLoss()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(Rows(), batch_size=BATCH, collate_fn=mod.collate)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=root / "bundles", rewind=2,
                            factory=f"{name}:make_model"):
            for b in loader:
                opt.zero_grad()
                crit(model(b), b.label).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == \
        (BAD_STEP, "input", "batch.values", [BAD_ROW])
    meta, _ = read_bundle(info.value.bundle_path)
    node = meta["micro_batches"][0]["inputs"]["$list"][0]["$list"][0]
    assert node["$dataclass"] == f"{name}:Batch"
    assert [k for k, _ in node["$fields"]] == ["values", "present", "label", "source", "ids"]

    rep = replay(info.value.bundle_path, tries=[f"drop={BAD_ROW}"])
    assert rep["reproduced"] and rep["cause"] == "input"
    assert (rep["origin"]["tensor"], rep["origin"]["samples"]) == ("batch.values", [BAD_ROW])
    assert rep["window"]["reproduced"] and rep["window"]["event_step"] == BAD_STEP
    (t,) = rep["what_if"]
    assert t["finite"] is True and t["inconclusive"] is False
    res = invoke_cli(info.value.bundle_path)
    assert res.exit_code == 0 and "origin     input: nan made by the input batch.values" in \
        res.stdout, res.stdout + res.stderr


def test_a_dataclass_whose_type_is_not_imported_rebuilds_as_a_stand_in():
    from recorder.capture import flatten_tree, unflatten_tree

    tree = {"$dataclass": "gone_module:Batch",
            "$fields": [["values", {"$t": "batch/0/0"}], ["source", "train"]]}
    x = torch.ones(2, 3)
    b = unflatten_tree(tree, {"batch/0/0": x})
    assert type(b).__name__ == "Batch" and b.values is x and b.source == "train"
    again, tensors, paths = flatten_tree(b, "p")
    assert again["$fields"][1] == ["source", "train"] and paths == {"p/0": ".values"}

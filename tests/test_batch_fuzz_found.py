"""Found by a fuzz run over batch structures (record, bundle, replay): a batch taken
time-major, ``(T, B, F)``, by a model of ``nn.Linear`` layers and a pooling over dim 0 (no
LSTM or ``batch_first=False`` module to say where the batch is). A NaN in two samples was
called 'not per sample ... in its rows [0, 2] (of 5)': the time steps were read as the rows."""

from __future__ import annotations

import batch_fuzz_found_models as M
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from recorder import FlightRecorder, NonFiniteError
from replay import replay

T, B, BAD_STEP = 5, 4, 2


class Clips(Dataset):
    def __init__(self, bad_rows, value):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(6 * B, T, 4, generator=g)
        self.n = torch.randint(2, T + 1, (6 * B,), generator=g)
        self.y = torch.randint(0, 5, (6 * B,), generator=g)
        for r in bad_rows:
            self.x[BAD_STEP * B + r, 1] = value  # a corrupt frame of that clip

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], torch.arange(T) < self.n[i], self.y[i]


def time_major(rows):
    x, mask, y = (torch.stack(v) for v in zip(*rows))
    return x.transpose(0, 1), mask.transpose(0, 1), y


def train(tmp_path, bad_rows, value):
    torch.manual_seed(0)
    model, crit = M.make_model(), nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = DataLoader(Clips(bad_rows, value), batch_size=B, collate_fn=time_major)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path / "b",
                            factory=M.make_model):
            for x, mask, y in loader:
                opt.zero_grad()
                crit(model(x, mask), y).backward()
                opt.step()
    return info.value.event, replay(info.value.bundle_path, factory=M.make_model)


def test_a_nan_in_time_major_clips_names_their_samples(tmp_path):
    ev, rep = train(tmp_path, [0, 2], float("nan"))
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == \
        (BAD_STEP, "input", "args[0]", [0, 2])
    assert rep["reproduced"] and rep["cause"] == "input"
    assert (rep["origin"]["tensor"], rep["origin"]["samples"]) == ("args[0]", [0, 2])


def test_an_overflow_of_a_time_major_clip_names_its_sample(tmp_path):
    ev, rep = train(tmp_path, [3], 3e25)
    assert ev["step"] == BAD_STEP
    o = rep["origin"]
    assert rep["cause"] == "overflow"
    assert (o["module"], o["op"], o["samples"]) == ("frames", "aten.mul", [3])


@pytest.mark.parametrize("lengths", [None, (3, B)])
def test_a_nan_in_two_clips_of_a_list_names_both(tmp_path, lengths):
    """A list of per-sample clips: each is its own tensor, and the first one holding NaN
    named one sample of two (``samples [1]``); a clip as long as the batch is large (``B``
    frames) is still one sample, not a batch whose rows are its frames (``samples [0, 1]``)."""
    torch.manual_seed(0)
    model, crit = M.make_clip_list(), nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ds = Clips([1, 3], float("nan"))
    if lengths:
        ds.n[BAD_STEP * B + 1], ds.n[BAD_STEP * B + 3] = lengths
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path / "b",
                            factory=M.make_clip_list):
            for s in range(0, len(ds), B):
                clips = [ds.x[i, :ds.n[i]] for i in range(s, s + B)]
                opt.zero_grad()
                crit(model(clips), ds.y[s:s + B]).backward()
                opt.step()
    assert (info.value.event["step"], info.value.event["samples"]) == (BAD_STEP, [1, 3])
    rep = replay(info.value.bundle_path, factory=M.make_clip_list)
    assert rep["cause"] == "input" and rep["origin"]["samples"] == [1, 3]

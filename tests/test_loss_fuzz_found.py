"""Found by a fuzz run over the ways losses are written (record, bundle, replay):

- a triplet loss over three forwards of one embedder (anchor, positive, negative), whose
  ``sqrt`` distance has an infinite derivative where a positive equals its anchor: the replay
  fed each forward's recorded output gradient alone, the anchor's and the positive's were
  NaN and not fed, and it said 'the loss the recorder was given re-ran finite, so the value
  came from loss terms computed outside it' with no op and no cause;
- CTC on a time-major ``(T, B, C)`` batch whose T is a multiple of B: the samples were read
  at dim 0 (the time steps), so an unalignable target named no sample, and a NaN frame of
  one utterance was 'not per sample';
- a factory's loss holding the weights it decays: the re-run raised on the meta device."""

from __future__ import annotations

import loss_fuzz_found_models as M
import pytest
import torch
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from replay import replay

B, BAD_STEP, BAD_ROW = 6, 3, 4


def triplets(n_steps):
    g = torch.Generator().manual_seed(0)
    for step in range(n_steps):
        a = torch.randn(B, 8, generator=g)
        p = a + 0.3 * torch.randn(B, 8, generator=g)
        n = torch.randn(B, 8, generator=g)
        if step == BAD_STEP:
            p[BAD_ROW] = a[BAD_ROW]  # a pair made of one record twice (an augmentation no-op)
        yield a, p, n


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_triplet_loss_over_three_forwards_names_its_sqrt(tmp_path, accumulate):
    torch.manual_seed(0)
    model = M.make_embedder()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.triplet_loss, out_dir=tmp_path / "b",
                            factory=M.make_embedder) as rec:
            for i, (a, p, n) in enumerate(triplets(BAD_STEP * accumulate + 3)):
                loss = rec.loss_fn(model(a), model(p), model(n))
                (loss / accumulate).backward()
                if (i + 1) % accumulate == 0:
                    opt.step()
                    opt.zero_grad()
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (BAD_STEP // accumulate, "backward")
    rep = replay(info.value.bundle_path, factory=M.make_embedder)
    o = rep["origin"]
    assert rep["reproduced"] and rep["cause"] == "invalid"
    assert (o["phase"], o["module"], o["op"], o["samples"]) == \
        ("backward", "<loss>", "SqrtBackward0", [BAD_ROW])


T = 2 * B  # a multiple of the batch: nothing but the loss tells (T, B) from (B, T)


def utterances(n_steps, plant):
    g = torch.Generator().manual_seed(1)
    for step in range(n_steps):
        x = torch.randn(T, B, 8, generator=g)
        targets = torch.randint(1, 5, (B, 4), generator=g)
        frames = torch.full((B,), T, dtype=torch.long)
        if step == BAD_STEP:
            plant(x, frames)
        yield x, targets, frames, torch.full((B,), 4, dtype=torch.long)


def train_ctc(tmp_path, plant):
    torch.manual_seed(0)
    model, ctc = M.make_tagger(), nn.CTCLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=ctc, out_dir=tmp_path / "b",
                            factory=M.make_tagger):
            for x, targets, frames, lengths in utterances(BAD_STEP + 2, plant):
                opt.zero_grad()
                ctc(model(x), targets, frames, lengths).backward()
                opt.step()
    return info.value.event, replay(info.value.bundle_path, factory=M.make_tagger)


def test_ctc_of_a_target_longer_than_its_frames_names_that_sample(tmp_path):
    def short(x, frames):
        frames[BAD_ROW] = 3  # 4 labels cannot be aligned to 3 frames
    ev, rep = train_ctc(tmp_path, short)
    o = rep["origin"]
    assert (ev["step"], ev["phase"]) == (BAD_STEP, "loss")
    assert rep["reproduced"] and rep["cause"] == "invalid"
    assert (o["module"], o["op"], o["samples"]) == ("<loss>", "aten._ctc_loss", [BAD_ROW])


def test_a_nan_frame_of_a_time_major_utterance_names_its_sample(tmp_path):
    def corrupt(x, frames):
        x[2, BAD_ROW] = float("nan")
    ev, rep = train_ctc(tmp_path, corrupt)
    assert (ev["step"], ev["phase"], ev["samples"]) == (BAD_STEP, "input", [BAD_ROW])
    assert rep["cause"] == "input" and rep["origin"]["samples"] == [BAD_ROW]


def test_a_loss_holding_the_weights_it_decays_is_re_run(tmp_path):
    """The factory's loss holds a list of the model's weights (an L2 penalty over them): the
    replay built the model on the meta device and loaded the bundle's weights as new
    parameters, so the list held meta placeholders and the re-run raised ('Tensor.item()
    cannot be called on meta tensors'): NOT reproduced, no op."""
    torch.manual_seed(0)
    made = M.make_decayed()
    model, loss_fn = made["model"], made["loss_fn"]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=tmp_path / "b",
                            factory=M.make_decayed) as rec:
            for step in range(BAD_STEP + 2):
                x, y = torch.randn(B, 8, generator=g), torch.randint(0, 4, (B,), generator=g)
                if step == BAD_STEP:
                    x[0] *= 1e4  # logits far apart: softmax underflows to 0
                opt.zero_grad()
                rec.loss_fn(model(x), y).backward()
                opt.step()
    assert info.value.event["step"] == BAD_STEP
    rep = replay(info.value.bundle_path, factory=M.make_decayed)
    o = rep["origin"]
    assert rep["reproduced"] and rep["cause"] == "underflow"
    assert (o["module"], o["op"], o["samples"]) == ("<loss>", "aten.log", [0])

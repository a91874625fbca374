"""Video understanding trained as TSM, TimeSformer and SlowFast repositories train it
(``video_models``): uint8 clips normalised by mean/std in ``DataLoader`` workers, clips of
variable length padded to ``T`` with a frame mask passed to ``forward``, temporal pooling by
that mask, mixup with label smoothing; the recorder on the loop, then ``nanreplay``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import video_models as V
from bundles import line_number, nanreplay_json
from torch.utils.data import DataLoader

from recorder import FlightRecorder, NonFiniteError

# per batch of 4: one clip of batch 1 (index 5) has no valid frame
LENGTHS = [4, 3, 2, 4, 4, 0, 4, 2, 4, 4, 4, 4]


def line_of(text: str) -> int:
    return line_number("video_models.py", text)


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def train(out_dir: Path, factory: str, data: V.VideoDataset, soft: bool = False,
          workers: int = 0):
    model = getattr(V, factory)()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    crit = V.SoftTargetCrossEntropy() if soft else torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    loader = DataLoader(data, batch_size=4, num_workers=workers)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                        factory=f"video_models:{factory}"):
        for clips, mask, y in loader:
            if soft:
                clips, y = V.mixup(clips, y, 0.7)
            opt.zero_grad()
            crit(model(clips, mask), y).backward()
            opt.step()


def test_healthy_video_models_raise_no_event(tmp_path):
    """TSM's in-place shifted slices, divided space-time attention over padded frames (their
    keys masked with -inf), SlowFast's time-strided lateral conv, R(2+1)D with BatchNorm3d,
    mixup of clips with label smoothing, frames decoded in a worker: no event."""
    lengths = [4, 3, 2, 1] * 2
    train(tmp_path, "make_slowfast", V.VideoDataset(8, lengths), soft=True, workers=1)
    train(tmp_path, "make_tsm", V.VideoDataset(8, lengths), soft=True)
    train(tmp_path, "make_timesformer", V.VideoDataset(8, lengths))
    assert not list(tmp_path.rglob("*.nan"))


def test_nanmean_pool_of_a_clip_without_valid_frames_names_its_division(tmp_path):
    """Padded frames filled with NaN for ``nanmean`` to skip: a clip with no valid frame is
    all NaN, and nanmean's division is 0/0. The report blamed the fill (``masked_fill of 0 at
    a pole``: clamp its input), which the code meant; a literal NaN a fill op writes is now
    the chain's intended start, as a -inf mask is, and the 0/0 is named."""
    with pytest.raises(NonFiniteError) as info:
        train(tmp_path, "make_tsm_nanmean", V.VideoDataset(12, LENGTHS))
    err = info.value
    empty = [i - 4 for i in range(4, 8) if LENGTHS[i] == 0]
    assert (err.event["step"], err.event["module"], err.event["samples"]) == (1, "pool", empty)
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("forward", "pool", "aten.div", empty, "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == f"video_models.py:{line_of('.nanmean(1)')}", o["source"]
    assert "pole" not in rep["hint"] and "eps" in rep["hint"], rep["hint"]


def test_divided_attention_names_the_clip_of_a_fully_masked_temporal_row(tmp_path):
    """TimeSformer's temporal attention runs on ``(b n) t d``: a clip with no valid frame
    masks every key of its n patch rows, softmax of -inf rows is NaN. The samples are the
    clips (batch rows), not the (b n) rows; dropping that clip clears the step."""
    with pytest.raises(NonFiniteError) as info:
        train(tmp_path, "make_timesformer", V.VideoDataset(12, LENGTHS))
    err = info.value
    empty = [i - 4 for i in range(4, 8) if LENGTHS[i] == 0]
    rep = nanreplay_json(err.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (err.event["step"], o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) \
        == (1, "forward", "block.attn_t", "aten._softmax", empty, "invalid"), \
        json.dumps(rep, indent=1)
    [what_if] = rep["what_if"]
    assert what_if["try"] == f"drop={empty[0]}" and what_if["finite"] is True, what_if


def test_a_nan_fill_reduced_by_a_plain_mean_is_named_as_the_fill_with_nan_advice(tmp_path):
    """The same fill reduced by ``mean`` instead of ``nanmean``: every clip with a padded
    frame is NaN. The fill is the origin, but the cause said "masked_fill at a pole: clamp the
    op's input" (or, with the fill intended, the generic domain advice); it now says the
    literal NaN was written on purpose and only nan-aware reductions skip it."""
    lengths = [4] * 4 + [3, 4, 1, 4]  # the first batch has every frame
    padded = [i - 4 for i in range(4, 8) if lengths[i] < V.T]
    with pytest.raises(NonFiniteError) as info:
        train(tmp_path, "make_tsm_nan_fill_mean", V.VideoDataset(8, lengths))
    err = info.value
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (err.event["step"], o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) \
        == (1, "forward", "pool", "aten.masked_fill", padded, "invalid"), \
        json.dumps(rep, indent=1)
    assert "literal NaN" in rep["hint"] and "nanmean" in rep["hint"], rep["hint"]
    assert "pole" not in rep["hint"], rep["hint"]


def test_dropping_a_blank_clip_keeps_the_frames_of_a_full_frame_mask(tmp_path):
    """Clips standardised by their own mean/std in a DataLoader worker: a blank (all black)
    clip is 0/0, an input event on that clip. With as many clips in the batch as frames
    (4 and 4, as 8 and 8 often are) and no clip padded, the ``(B, T)`` frame mask is all
    True, so symmetric: ``drop=`` took it for a pairwise ``(B, B)`` matrix, cut its frames
    too, and the re-run raised ("size of tensor a (4) must match ... (3)"). A length mask is
    no pairwise matrix; the drop now leaves its frames and the step is finite."""
    blank = 6
    with pytest.raises(NonFiniteError) as info:
        train(tmp_path, "make_slowfast", V.VideoDataset(12, blank=(blank,), per_clip=True),
              workers=1)
    err = info.value
    step, row = divmod(blank, 4)
    rep = nanreplay_json(err.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (err.event["step"], o["phase"], err.event["tensor"], o["samples"], rep["cause"]) \
        == (step, "input", "args[0]", [row], "input"), json.dumps(rep, indent=1)
    [what_if] = rep["what_if"]
    assert what_if["try"] == f"drop={row}" and what_if["finite"] is True, what_if


def test_a_drop_under_a_loop_average_over_views_says_it_cannot_tell(tmp_path):
    """Two views of each clip (the clip and its mirror) through the model as ``(b v)`` rows,
    averaged per clip by the loop before the loss. One view lost its frames: 0/0 in the
    pool, named on that (b v) row. ``drop=`` of that row re-ran the model without it, but the
    loss took the loop's average as recorded, NaN still, and the what-if said "nan at step 1
    (input, <loss>)": that the drop does not help. The re-run cannot tell, and now says so."""
    model = V.make_tsm_no_eps()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    crit = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    views, bad_clip, bad_view = 2, 1, 1
    loader = DataLoader(V.VideoDataset(8, [4, 3, 2, 4] * 2), batch_size=4)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="video_models:make_tsm_no_eps"):
            for step, (x, m, y) in enumerate(loader):
                x, m = torch.stack([x, x.flip(-1)], 1), torch.stack([m] * views, 1)
                if step == 1:
                    m[bad_clip, bad_view] = False
                b = x.shape[0]
                logits = model(x.flatten(0, 1), m.flatten(0, 1)).view(b, views, -1).mean(1)
                opt.zero_grad()
                crit(logits, y).backward()
                opt.step()
    row = bad_clip * views + bad_view
    rep = nanreplay_json(info.value.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (info.value.event["step"], o["phase"], o["module"], o["op"], o["samples"],
            rep["cause"]) == (1, "forward", "pool", "aten.div", [row], "invalid"), \
        json.dumps(rep, indent=1)
    [what_if] = rep["what_if"]
    assert what_if["try"] == f"drop={row}" and what_if["finite"] is None, what_if
    assert what_if["ran"] and "recorded copy" in what_if["note"], what_if


def test_a_motion_cue_at_two_padded_frames_is_named_in_backward_on_those_clips(tmp_path):
    """TEA/TDN-style motion gate: sqrt of the summed squared frame differences of the
    ``(n t)`` features is 0 between two padded frames (both the stem's bias alone), so its
    derivative is inf there: a backward event, named at SqrtBackward0 in the gate, on the
    clips with two padded frames or more, whose rows the ``(n t)`` view spread over T."""
    lengths = [4] * 4 + [4, 2, 3, 1]
    with pytest.raises(NonFiniteError) as info:
        train(tmp_path, "make_tsm_motion", V.VideoDataset(8, lengths))
    err = info.value
    two_padded = [i - 4 for i in range(4, 8) if V.T - lengths[i] >= 2]
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (err.event["step"], o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) \
        == (1, "backward", "motion", "SqrtBackward0", two_padded, "invalid"), \
        json.dumps(rep, indent=1)

"""End to end: scene text recognition as its practitioners write it
(``scene_text_recognition_models``: a CRNN — conv backbone, BiLSTM, ``log_softmax`` over
``T x N x C`` — under ``nn.CTCLoss`` with blank 0, optionally behind a spatial transformer
(``affine_grid``/``grid_sample``); an attention decoder over the columns with a padding mask
from each crop's width, a hand-written LSTM cell, teacher forcing and label-smoothed
cross-entropy), trained from a ``DataLoader`` with Adam and gradient clipping under the
recorder until a planted bug of the domain fires, then replayed with the CLI."""

from __future__ import annotations

import contextlib
import json

import pytest
import scene_text_recognition_models as M
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

B = 8


def line_of(text: str) -> str:
    return source_line("scene_text_recognition_models.py", text)


def data(n=32, lengths=None, edit=None, stretch=True) -> DataLoader:
    labels, lens = M.words(n, lengths=lengths)
    x = M.render(labels, lens)
    if edit is not None:
        edit(x)
    return DataLoader(M.WordCrops(x, labels, lens, stretch), batch_size=B)


def ctc_run(out, make="make_crnn", loss=None, loader=None, fp16=False, record=True):
    """CTC training: Adam, clip_grad_norm_, the forward under float16 autocast if ``fp16``."""
    model, loss = getattr(M, make)(), loss or M.CTCLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    rec = FlightRecorder(model, opt, loss_fn=loss, out_dir=out,
                         factory=f"scene_text_recognition_models:{make}") if record else None
    losses = []
    with rec if rec is not None else contextlib.nullcontext():
        fn = rec.loss_fn if rec is not None else loss
        for x, labels, lens in loader or data():
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
                out_ = model(x)
            value = fn(out_, labels, lens)
            value.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            losses.append(float(value.detach()))
    return losses, model


def attn_run(out, loader, loss=None, widths=None, eps=1e-8):
    """Attention decoding, teacher-forced; ``widths(i, lens)``: each crop's width in pixels."""
    model, loss = M.make_attn(), loss or M.SmoothedCE()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=eps)
    with FlightRecorder(model, opt, loss_fn=loss, out_dir=out,
                        factory="scene_text_recognition_models:make_attn") as rec:
        for i, (x, labels, lens) in enumerate(loader):
            inp, tgt = M.teacher_forcing(labels, lens)
            opt.zero_grad()
            value = rec.loss_fn(model(x, inp, (lens * 8 + 8) if widths is None
                                      else widths(i, lens)), tgt)
            value.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()


def report(run, *args, step, phase, **kw) -> tuple[dict, dict]:
    with pytest.raises(NonFiniteError) as info:
        run(*args, **kw)
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (step, phase), ev
    rep = nanreplay_json(info.value.bundle_path)
    assert rep["reproduced"] is True, json.dumps(rep, indent=1)
    return rep, rep["origin"]


def test_healthy_rectified_crnn_raises_nothing_and_trains_bit_identically(tmp_path):
    runs = [ctc_run(tmp_path, "make_stn_crnn", record=r) for r in (False, True)]
    (plain, m0), (watched, m1) = runs
    assert plain == watched and all(v == v for v in plain)
    assert all(torch.equal(a, b) for a, b in zip(m0.parameters(), m1.parameters()))
    assert not list(tmp_path.glob("*.nan"))


def test_contrast_stretch_of_a_blank_crop_is_an_input_event_at_its_row(tmp_path):
    """Crop 13 (row 5 of the second batch) is uniform grey: the loader's
    ``(img - min) / (max - min)`` is 0/0 in every pixel."""
    rep, o = report(ctc_run, tmp_path, loader=data(edit=lambda x: x[13].fill_(0.5)),
                    step=1, phase="input")
    assert (o["samples"], o["made"], rep["cause"]) == ([5], "nan", "input"), rep
    assert "division by zero in normalisation" in rep["hint"], rep["hint"]


def test_a_line_label_on_a_word_crop_is_unalignable_in_ctc(tmp_path):
    """Crop 11 (row 3 of the second batch) carries a 20-character label; the backbone leaves
    16 columns, fewer than the label needs: CTC's +inf at that row."""
    rep, o = report(ctc_run, tmp_path, loader=data(lengths={11: 20}), step=1, phase="loss")
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "<loss>", "aten._ctc_loss", "+inf", [3], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("return self.ctc(logp.float(), labels, input_lengths, lens)")
    assert "row 3: target of 20 labels needs 23 frames, the input has 16" in rep["hint"]
    assert "zero_infinity=True" in rep["hint"], rep["hint"]


def test_an_stn_head_with_a_zero_bias_names_the_bias_of_the_singular_theta(tmp_path):
    """The localisation head zeroed as the STN tutorial does, but its bias left at 0 instead of
    the identity: theta is the zero matrix, and the unit-area rescaling divides by
    sqrt|det| = 0. The hint blamed 'parameters started at the same value' (a Bateman
    function's rates); it now names the layer's bias and the identity it should start at."""
    rep, o = report(ctc_run, tmp_path, "make_unit_area_stn_crnn", step=0, phase="forward")
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "rectifier", "aten.div", "nan", list(range(B)), "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("a = a / det.abs().sqrt()[:, None, None]")
    assert "parameter rectifier.fc.weight and rectifier.fc.bias, both all 0" in rep["hint"]
    assert "bias the identity transform" in rep["hint"], rep["hint"]


def test_an_identity_pull_on_an_identity_started_theta_is_nan_in_backward_only(tmp_path):
    """The tutorial's init makes theta exactly the identity at step 0; the regulariser's
    ``sqrt(sum (theta - I)^2)`` is 0 forward, and sqrt's derivative at 0 is +inf. The hint
    listed points coinciding in the data (padded vectors, an entity paired with itself); it
    now names the zero-initialised head whose start the distance is measured to."""
    rep, o = report(ctc_run, tmp_path, "make_stn_crnn", M.RectifiedCTCLoss(),
                    step=0, phase="backward")
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "<loss>", "SqrtBackward0", "+inf", list(range(B)), "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("dist = ((theta - self.identity) ** 2).sum((1, 2)).sqrt()")
    assert "torch.linalg.vector_norm" in rep["hint"], rep["hint"]
    assert "because parameter rectifier.fc.weight is all 0 as the step began" in rep["hint"]


def test_an_empty_word_under_per_word_smoothed_ce_names_its_row(tmp_path):
    """Crop 10 (row 2 of the second batch) has an empty label; the token count leaves out
    ``<eos>``, so its per-word average is 0/0."""
    rep, o = report(attn_run, tmp_path, data(lengths={10: 0}), M.SmoothedCE(count_eos=False),
                    step=1, phase="loss")
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "<loss>", "aten.div", "nan", [2], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("per_word = (tok * keep).sum(1) / keep.sum(1)")
    assert "Sample(s) 2 are empty records" in rep["hint"], rep["hint"]


def test_a_crop_of_width_0_masks_every_column_of_its_attention(tmp_path):
    """Crop 3 of the second batch was resized to width 0: every column of its attention is
    masked, softmax of -inf only. The NaN then met the hand-written LSTM cell's first
    ``sigmoid(f) * c`` with ``c`` all zeros, which the hint took for a mask meant to drop it
    ('drop them with torch.where(mask, x, 0)'); a zero state is no mask, and it is no longer
    named."""
    def widths(i, lens):
        w = lens * 8 + 8
        return w.masked_fill(torch.arange(len(w)) == 3, 0) if i == 1 else w

    rep, o = report(attn_run, tmp_path, data(), widths=widths, step=1, phase="forward")
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "", "aten._softmax", "nan", [3], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == line_of('alpha = e.masked_fill(pad, float("-inf")).softmax(-1)')
    assert "a fully masked row" in rep["hint"], rep["hint"]
    assert "by a mask's 0" not in rep["hint"], rep["hint"]


def test_a_16_bit_crop_never_scaled_overflows_float16_autocast(tmp_path):
    """Crop 12 (row 4 of the second batch) read as uint16 and never divided by 65535, with the
    stretch augmentation off: autocast's cast to float16 of 65535 is +inf."""
    loader = data(stretch=False, edit=lambda x: x[12].mul_(65535))
    rep, o = report(ctc_run, tmp_path, loader=loader, fp16=True, step=1, phase="forward")
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "backbone.conv.0", "aten._to_copy", "+inf", [4], "overflow"), json.dumps(rep, indent=1)
    assert "the data of these samples is out of scale" in rep["hint"], rep["hint"]


def test_adamw_with_eps_0_makes_dead_filters_0_over_0(tmp_path):
    """eps=0: a conv filter whose ReLU is dead on every crop has a gradient of exactly 0, m = v
    = 0, and Adam's m / (sqrt(v) + eps) is 0/0 at the first update."""
    with pytest.raises(NonFiniteError) as info:
        attn_run(tmp_path, data(), eps=0.0)
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (0, "optimizer"), ev
    rep = nanreplay_json(info.value.bundle_path, code=1)
    assert (rep["reproduced"], rep["cause"]) == (False, "optimizer"), json.dumps(rep, indent=1)
    assert "backbone.conv.0.weight" in ev["params"], ev["params"]
    assert "with eps=0 an element whose gradients have all been exactly 0" in rep["hint"]

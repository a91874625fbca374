"""A causal transformer whose attention mask holds -inf on purpose trains with no event."""

from __future__ import annotations

import contextlib
import json

import models as M
import pytest
import torch
from bundles import invoke_cli
from models import bundles, check_event
from torch import nn

from recorder import FlightRecorder, NonFiniteError

VOCAB = 11


def _lm_train(model, steps, out_dir, **rec_kwargs):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    crit = nn.CrossEntropyLoss()
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, **rec_kwargs) as rec:
        for step in range(steps):
            idx, tgt = M.token_batch(step)
            opt.zero_grad()
            logits = model(idx)
            loss = crit(logits.reshape(-1, VOCAB), tgt.reshape(-1))
            loss.backward()
            opt.step()
    return rec


@pytest.mark.parametrize("allow_inf", [[], ["*.mask"]])
def test_inline_causal_mask_buffer_trains_without_event(out_dir, allow_inf):
    model = M.TinyGPT(mask_module=False)
    assert torch.isneginf(model.blocks[0].attn.mask).any()
    rec = _lm_train(model, 4, out_dir, allow_inf=allow_inf)
    assert rec.event is None and rec.step == 4 and bundles(out_dir) == []


def test_mask_module_output_allowed_by_pattern(out_dir):
    model = M.TinyGPT(mask_module=True)
    rec = _lm_train(model, 4, out_dir, allow_inf=["*.mask"])
    assert rec.event is None and rec.step == 4 and bundles(out_dir) == []


def test_mask_module_output_without_pattern_is_an_event(out_dir):
    with pytest.raises(NonFiniteError) as info:
        _lm_train(M.TinyGPT(mask_module=True), 4, out_dir, strict_inf=True)
    check_event(info.value.event, step=0, phase="forward", module="blocks.0.attn.mask",
                module_type="models.MaskAdd", call=0, kind="-inf")


def test_mask_module_nan_is_an_event_even_when_allowed(out_dir):
    model = M.TinyGPT(mask_module=True)
    mask = model.blocks[1].attn.mask

    def poison(module, args, output):
        if poison.armed:
            return output.masked_fill(torch.isneginf(output), float("nan"))
        return None

    poison.armed = False
    mask.register_forward_hook(poison)  # registered before the recorder's: it sees the NaN
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, allow_inf=["*.mask"]):
            for step in range(5):
                poison.armed = step == 2
                idx, tgt = M.token_batch(step)
                opt.zero_grad()
                crit(model(idx).reshape(-1, VOCAB), tgt.reshape(-1)).backward()
                opt.step()
    check_event(info.value.event, step=2, phase="forward", module="blocks.1.attn.mask",
                kind="nan", inputs_finite=True)


class BufferMaskNet(nn.Module):
    """Takes its own -inf ``mask`` buffer as a keyword input (as masks are passed to HF
    models): a root input that may hold -inf when allowed."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(M.D_IN, M.HIDDEN)
        self.head = nn.Linear(M.HIDDEN, M.N_CLASSES)
        mask = torch.zeros(M.HIDDEN)
        mask[-2:] = -float("inf")
        self.register_buffer("mask", mask)

    def forward(self, x, mask):
        return self.head(torch.softmax(self.lin(x) + mask, dim=-1))


def _buffer_mask_train(out_dir, **kw):
    model = BufferMaskNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.CrossEntropyLoss()
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, **kw) as rec:
        for step in range(3):
            x, y = M.batch(step)
            opt.zero_grad()
            crit(model(x, mask=model.mask), y).backward()
            opt.step()
    return rec


def test_allowed_buffer_as_root_input(out_dir):
    rec = _buffer_mask_train(out_dir, allow_inf=["mask"])
    assert rec.event is None and rec.step == 3


def test_buffer_as_root_input_not_allowed(out_dir):
    with pytest.raises(NonFiniteError) as info:
        _buffer_mask_train(out_dir, strict_inf=True)
    check_event(info.value.event, step=0, phase="input", module="", tensor='kwargs["mask"]',
                kind="-inf")


# torch's own warning when the encoder's fast path builds its nested tensors (in training too)
NESTED_WARNING = pytest.mark.filterwarnings(
    "ignore:The PyTorch API of nested tensors is in prototype stage:UserWarning")


def _encoder_run(out_dir, recorded: bool, eval_all_padding_at: int | None = None):
    """Train ``PaddedEncoder`` 4 steps, validating after each in eval mode with gradients off
    (the encoder's nested-tensor fast path); returns (losses, recorder or None)."""
    model = M.make_padded_encoder()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss()
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory="models:make_padded_encoder") if recorded else None
    losses = []
    with rec if rec is not None else contextlib.nullcontext():
        for step in range(4):
            model.train()
            tokens, pad, y = M.padded_tokens(step)
            opt.zero_grad()
            loss = crit(model(tokens, pad), y)
            loss.backward()
            opt.step()
            model.eval()
            with torch.no_grad():
                tokens, pad, y = M.padded_tokens(100 + step, all_padding=(
                    4 if step == eval_all_padding_at else None))
                losses += [loss.item(), crit(model(tokens, pad), y).item()]
    return losses, rec


@NESTED_WARNING
def test_encoder_fast_path_in_validation_keeps_recording(out_dir, caplog):
    """``nn.TransformerEncoder``'s eval fast path passes nested tensors to its layers: the
    recorder measures them (it was disabled by an internal error at the first validation,
    'Could not run aten::sum.IntList_out with arguments from the NestedTensorCPU backend')
    and training computes what it computes without the recorder."""
    bare, _ = _encoder_run(out_dir, recorded=False)
    with caplog.at_level("WARNING", logger="nanreplay"):
        recorded, rec = _encoder_run(out_dir, recorded=True)
    assert recorded == bare
    assert "internal error" not in caplog.text, caplog.text
    assert rec.step == 4 and rec.event is None and bundles(out_dir) == []


@NESTED_WARNING
def test_a_nan_in_the_encoder_fast_path_is_found_and_replayed(out_dir):
    """The 0/0 pooling of an all-padding sequence in a validation batch: an evaluation event;
    the replay re-runs the fast path (nested tensors) and names the division, sample 4."""
    with pytest.raises(NonFiniteError) as info:
        _encoder_run(out_dir, recorded=True, eval_all_padding_at=2)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["evaluation"]) == (3, "forward", True), ev
    r = invoke_cli(info.value.bundle_path, "--json")
    rep = json.loads(r.stdout)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"], rep["reproduced"]) == (
        "", "aten.div", [4], "invalid", True), rep

"""End to end: attention written the way current LLM code writes it by hand
(``attention_masks_models``: RoPE, QK-norm, grouped-query K/V heads, an HF-style padding mask
made additive with ``finfo.min``, logit soft-capping), trained under the recorder until a
planted bug fires, then replayed with the CLI."""

from __future__ import annotations

import attention_masks_models as M
import pytest
import torch
from bundles import line_number, nanreplay_json

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> int:
    return line_number("attention_masks_models.py", text)


def train(out_dir, factory: str, pads_at: dict[int, list[int]], steps: int = 4):
    model = getattr(M, factory)()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.lm_loss, out_dir=out_dir,
                            factory=f"attention_masks_models:{factory}") as rec:
            for step in range(steps):
                ids, am, pos = M.batch(g, pads_at.get(step, [0] * M.BATCH))
                loss = rec.loss_fn(model(ids, M.additive_mask(am), pos), ids, am)
                opt.zero_grad()
                loss.backward()
                opt.step()
    return info.value


def test_softcap_of_zero_names_the_constant_divisor_not_an_eps(tmp_path):
    # cap = 0 meant "no soft-capping": s / 0 is +-inf, tanh makes it +-1, 0 * +-1 is 0, so the
    # forward is finite and the backward's 1/cap is not
    err = train(tmp_path, "make_lm_softcap0", {})
    assert (err.event["step"], err.event["phase"]) == (0, "backward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["samples"]) == (
        True, "invalid", "attn", "DivBackward0", list(range(M.BATCH))), rep
    assert o["source"] == f"attention_masks_models.py:{line_of('torch.tanh(s / self.softcap)')}"
    # (was: "add an eps ... torch.where(mask, x, 1)", which a constant 0 divisor ignores)
    assert "divisor is a constant exactly 0" in rep["hint"], rep["hint"]
    assert "if cap:" in rep["hint"] and "add an eps" not in rep["hint"], rep["hint"]


def test_qk_norm_without_eps_at_a_pad_token_asks_for_the_eps_not_an_earlier_mask(tmp_path):
    # pad tokens embed to zero rows (padding_idx), so q = W @ 0 = 0 and RMSNorm with eps = 0
    # takes rsqrt(0) = inf, times the row's own 0: NaN in the left-padded rows
    pads = [0, 0, 3, 0, 1, 0]
    err = train(tmp_path, "make_lm_no_eps", {3: pads}, steps=5)
    assert (err.event["step"], err.event["phase"]) == (3, "forward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    padded = [i for i, p in enumerate(pads) if p > 0]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "invalid", "attn.q_norm", "aten.rsqrt", "+inf", padded), rep
    assert o["source"] == f"attention_masks_models.py:{line_of('torch.rsqrt(')}"
    assert "add an eps" in rep["hint"], rep["hint"]
    # (was: "then aten.mul multiplied that infinity by a mask's 0 ... select the valid entries
    # before it": the 0 is the row itself, not a mask)
    assert "mask's 0" not in rep["hint"], rep["hint"]

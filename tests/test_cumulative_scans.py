"""Sequence blocks whose NaN come from running sums and exponentials
(``cumulative_scans_models``): Mamba-2's segsum of ``A * dt``, linear attention's cumulative
normaliser, a conv + gated MLP block given an additive -inf mask; the recorder on the loop,
then ``nanreplay``."""

from __future__ import annotations

import json
from pathlib import Path

import cumulative_scans_models as C
import pytest
import torch
from bundles import nanreplay_json

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")
B, T = 4, 12
FLOAT32_MAX = torch.finfo(torch.float32).max


def train(model, factory: str | None, batches, loss_fn, out_dir: Path) -> list[float]:
    """AdamW over ``batches`` (``(inputs..., target)``); ``factory=None``: no recorder."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses: list[float] = []

    def loop():
        for *inputs, target in batches:
            opt.zero_grad()
            loss = loss_fn(model(*inputs), target)
            loss.backward()
            opt.step()
            losses.append(loss.item())

    if factory is None:
        loop()
    else:
        with FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir,
                            factory=f"cumulative_scans_models:{factory}"):
            loop()
    return losses


def windows(lengths: list[int], g: torch.Generator, t: int = T):
    """Sensor windows right-padded to ``t``: (x, padding mask, next value of feature 0)."""
    x = torch.randn(len(lengths), t, C.FEATURES, generator=g)
    mask = (torch.arange(t) < torch.tensor(lengths)[:, None]).float()
    return x, mask, x[..., 0].roll(-1, 1) * mask


def left_padded(lengths: list[int], g: torch.Generator):
    ids = torch.randint(1, C.VOCAB, (len(lengths), T), generator=g)
    ids = ids.masked_fill(torch.arange(T) < T - torch.tensor(lengths)[:, None], 0)
    return ids, ids


def lm_loss(logits, ids):
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, C.VOCAB), ids[:, 1:].reshape(-1), ignore_index=0)


def test_healthy_scans_masks_and_normalisers_are_bit_identical_and_raise_no_event(tmp_path):
    """The segsum's -inf above the diagonal before its exp, an additive -inf causal mask passed
    into forward, an ``elu + 1`` normaliser over left-padded rows: intended infinities, no
    event, and the losses of the recorded run are those of the bare one, bit for bit."""
    g = torch.Generator().manual_seed(0)
    causal = torch.full((T, T), float("-inf")).triu(1)
    runs = {"make_ssd": ([windows([12, 9, 6, 12], g) for _ in range(3)], torch.nn.MSELoss()),
            "make_conv_glu": ([(x, causal, y) for x, _, y in
                               (windows([T] * B, g) for _ in range(3))], torch.nn.MSELoss()),
            "make_elu_linear": ([left_padded([12, 8, 12, 5], g) for _ in range(3)], lm_loss)}
    for factory, (batches, loss_fn) in runs.items():
        bare = train(getattr(C, factory)(), None, batches, loss_fn, tmp_path)
        recorded = train(getattr(C, factory)(), factory, batches, loss_fn, tmp_path / factory)
        assert recorded == bare, (factory, recorded, bare)
    assert not list(tmp_path.rglob("*.nan"))


def overflowing_rows(model, x, mask) -> list[int]:
    """The rows whose running sum of ``A * dt`` passes float32's range, in float64."""
    mixer = model.mixer
    with torch.no_grad():
        u = model.inp(x)
        dt = torch.nn.functional.softplus(mixer.dt_proj(u) + mixer.dt_bias) * mask[..., None]
        sums = (-torch.exp(mixer.A_log.double()) * dt.double()).cumsum(1)
    return torch.nonzero(sums.abs().flatten(1).amax(1) > FLOAT32_MAX).flatten().tolist()


def test_a_segsum_cumsum_past_float32_is_an_overflow_of_the_mixer_not_of_the_targets(
        tmp_path):
    """Mamba-2's segsum with an ``A_log`` of 86 (``A = -2e37``): the running sum of
    ``A * dt`` reaches -inf on the rows long enough, and ``-inf - -inf`` makes the segsum's
    NaN. Named at the cumsum, on those rows, as an overflow; the report went on to blame the
    targets (``loss_args[1]``) of those rows as data out of scale in a 'feature' (a time step
    the shorter rows' padding zeroed), though the mixer never reads the targets; now it does
    not."""
    g = torch.Generator().manual_seed(0)
    batches = [windows([3, 24, 2, 22], g, t=24)]
    model = C.make_ssd()
    with torch.no_grad():
        model.mixer.A_log.fill_(86.0)
    rows = overflowing_rows(model, *batches[0][:2])
    # (the long rows' targets stand 10x above the short rows' at some time step: bait)
    y = batches[0][2].abs()
    short = [r for r in range(B) if r not in rows]
    assert bool(((y[short].amax(0) > 0) & (y[rows].amax(0) > 10 * y[short].amax(0))).any())
    with pytest.raises(NonFiniteError) as info:
        train(model, "make_ssd", batches, torch.nn.MSELoss(), tmp_path)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (0, "forward"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == \
        ("mixer", "aten.cumsum", "-inf", rows, "overflow"), json.dumps(rep, indent=1)
    assert rows == [1, 3], rows  # (the two long rows)
    assert "loss_args" not in rep["hint"] and "stand out" not in rep["hint"], rep["hint"]


def test_a_relu_linear_attention_normaliser_is_0_on_left_padding_and_says_so(tmp_path):
    """Causal linear attention with a relu feature map and bias-free projections: a padded
    token's zero embedding gives ``q = k = 0``, so ``q . cumsum(k)`` is 0 at a left-padded row's
    leading positions, and the division 0/0. Named at the division, on the rows whose
    normaliser is 0 somewhere (the left-padded ones here), as invalid; the advice was the
    padding id's alone (a symbol the tokenizer maps to id 0 among the real tokens: give
    unknown symbols their own id), silent on padding put there on purpose; now also that the
    divisor is a cumulative sum, 0 before its first nonzero term, and the strictly positive
    ``elu + 1``."""
    g = torch.Generator().manual_seed(0)
    batches = [left_padded([T, 9, T, 7], g)]
    model = C.make_relu_linear()
    with torch.no_grad():
        h, attn = model.emb(batches[0][0]), model.attn
        q, k = attn.phi(attn.q(h)), attn.phi(attn.k(h))
        zero = torch.nonzero(((q * k.cumsum(1)).sum(-1) == 0).any(1)).flatten().tolist()
    with pytest.raises(NonFiniteError) as info:
        train(model, "make_relu_linear", batches, lm_loss, tmp_path)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (0, "forward"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == \
        ("attn", "aten.div", "nan", zero, "invalid"), json.dumps(rep, indent=1)
    assert zero == torch.nonzero(batches[0][0][:, 0] == 0).flatten().tolist() == [1, 3], zero
    assert "0 by 0" in rep["hint"] and "cumulative sum" in rep["hint"] \
        and "elu(x) + 1" in rep["hint"], rep["hint"]

"""State-space models and linear recurrences trained as pure-PyTorch repositories train them
(``state_space_models``): a Mamba-2 style chunked scan, S4D's complex Vandermonde kernel with an
FFT convolution, RWKV's WKV recurrence, minGRU's log-space scan, causal linear attention, blocks
under ``torch.utils.checkpoint``; the recorder on the loop, then ``nanreplay``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import state_space_models as S
import torch
import torch.nn.functional as F
from bundles import nanreplay_json

from recorder import FlightRecorder, NonFiniteError

MAX_EXP = 88.72  # log of float32's largest value: exp overflows above it


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def lm_loss(logits, ids):
    """Next-token cross entropy over the real tokens (padding is token 0)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, S.VOCAB), ids[:, 1:].reshape(-1),
                           ignore_index=0)


def padded(lengths: list[int], t: int, g: torch.Generator, left: bool = False):
    ids = torch.randint(1, S.VOCAB, (len(lengths), t), generator=g)
    pos = torch.arange(t)
    pad = pos < t - torch.tensor(lengths)[:, None] if left else pos >= torch.tensor(lengths)[:, None]
    return ids.masked_fill(pad, 0)


def train_lm(out_dir: Path, model, factory: str, batches: list[torch.Tensor],
             lr: float = 1e-3):
    """AdamW on ``batches``; the recorder raises before the event step's update, so ``model``
    then holds the weights that step ran with."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    with FlightRecorder(model, opt, loss_fn=lm_loss, out_dir=out_dir,
                        factory=f"state_space_models:{factory}"):
        for ids in batches:
            opt.zero_grad()
            lm_loss(model(ids), ids).backward()
            opt.step()


def test_healthy_scans_kernels_and_masks_raise_no_event(tmp_path):
    """Mamba-2's segsum masked with -inf before its exp, S4D's complex kernel and FFT
    convolution, minGRU's -inf log values at right padding (logcumsumexp's result stays
    finite there), causal linear attention with an eps under torch.utils.checkpoint, the
    stable WKV with its -1e38 start: infinities inside a module and complex values are no
    event while every output, loss and gradient is finite."""
    g = torch.Generator().manual_seed(0)
    batches = [padded([24, 20, 16, 24], 24, g) for _ in range(2)]
    for name in ("make_mamba", "make_s4d", "make_mingru"):
        train_lm(tmp_path / name, getattr(S, name)(), name, batches)
    model = S.LinearLM(ckpt=True, eps=1e-6)
    train_lm(tmp_path / "linear", model, "make_linear_lm", batches)
    model, crit = S.make_rwkv(), torch.nn.MSELoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path / "rwkv",
                        factory="state_space_models:make_rwkv"):
        for x, y in series(2):
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()
    assert not list(tmp_path.rglob("*.nan"))


def overflowing_rows(model, ids, layer: int) -> list[int]:
    """The rows whose segsum in ``layers[layer]``'s scan reaches past exp's range: the sum of
    ``-dt * A`` over a row's positions after the first (the chunk's largest upper-triangle
    difference), recomputed from the mixer's input."""
    mixer = model.layers[layer].mixer
    seen = {}
    handle = mixer.register_forward_hook(
        lambda m, args, out: seen.update(u=args[0].detach(), mask=args[1]))
    model(ids)  # (with gradients: a reentrant checkpoint warns under no_grad)
    handle.remove()
    with torch.no_grad():
        dt = mixer.in_proj(seen["u"])[..., -mixer.heads:]
        dt = F.softplus(dt + mixer.dt_bias) * seen["mask"][..., None]
        decay = (dt * torch.exp(mixer.A_log))[:, 1:].sum(1)  # (b, h)
    return torch.nonzero(decay.amax(1) > MAX_EXP).flatten().tolist()


@pytest.mark.parametrize("factory", ["make_naive_mamba", "make_naive_mamba_ckpt",
                                     "make_naive_mamba_reentrant"])
def test_an_exp_before_the_causal_mask_in_the_scan_is_an_overflow_in_its_backward(
        tmp_path, factory):
    """Mamba-2's segsum as the difference of two cumsums, exp taken before the causal mask
    (``exp(diff).masked_fill(~causal, 0)``): the upper triangle, a positive sum of ``-dt * A``,
    overflows once a row is long enough (a length curriculum's step 2); the forward is finite,
    the backward multiplies the masked 0 by the saved +inf. Under torch.utils.checkpoint the
    node's saved result unpacks once (for the node), so the report said the gradient was too
    large for float32; now, as without checkpointing, ExpBackward0 multiplied a saved +Inf
    masked after the op, with the advice to make the input safe before the exp."""
    g = torch.Generator().manual_seed(0)
    batches = [padded([20, 16, 12, 8], 64, g), padded([18, 20, 10, 14], 64, g),
               padded([64, 20, 56, 16], 64, g)]
    model = getattr(S, factory)()
    with pytest.raises(NonFiniteError) as info:
        train_lm(tmp_path, model, factory, batches)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (2, "backward"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], rep["cause"]) == \
        ("backward", "layers.1.mixer", "ExpBackward0", "overflow"), json.dumps(rep, indent=1)
    assert o["source"].startswith("state_space_models.py:"), o["source"]
    assert "saved in the forward" in rep["hint"] and "before the op" in rep["hint"], rep["hint"]
    assert o["samples"] == overflowing_rows(model, batches[2], 1) != [], o["samples"]


def series(steps: int, t: int = 24) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Sensor windows, 4 features, and the next value of the first one as the target."""
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, t, 4, generator=g) for _ in range(steps)]
    return [(x, x[..., 0].roll(-1, 1)) for x in xs]


def nonfinite_rows_of(model, module: str, x) -> list[int]:
    """The rows of ``module``'s output that are non-finite while its input is finite in them."""
    seen = {}
    sub = model.get_submodule(module)
    handle = sub.register_forward_hook(lambda m, args, out: seen.update(i=args[0], o=out))
    with torch.no_grad():
        model(x)
    handle.remove()
    bad_in = ~torch.isfinite(seen["i"]).flatten(1).all(1)
    bad_out = ~torch.isfinite(seen["o"]).flatten(1).all(1)
    return torch.nonzero(bad_out & ~bad_in).flatten().tolist()


def scaled_naive_rwkv(scale: float):
    """The naive RWKV whose second block's key weights are ``scale`` times their init."""
    model = S.make_naive_rwkv()
    with torch.no_grad():
        model.layers[1].mixer.key.weight.mul_(scale)
    return model


def test_rows_overflowing_at_different_steps_of_a_wkv_loop_are_all_named(tmp_path):
    """RWKV-4's WKV written out without the max-subtraction trick (``exp(k)`` raw), with keys
    a too-high learning rate grew (set here: the key weights scaled up; the training path to
    them is chaotic, and which step and rows overflow first was the CPU's rounding, 43 on the
    AMD EPYC, 35 and one row on an Intel Xeon): one row's ``exp(k)`` overflows at one time
    step of the loop and another row's at a later one. The report named the first
    row only (the first call's), so ``--try drop=`` of it still ended in NaN; now every row an
    op of that module call made non-finite of its own finite values, and dropping them clears
    the step."""
    batches = series(60)
    # the smallest scale at which several, not all, rows overflow
    scale = next(c for c in range(40, 201, 10) if 1 < len(
        nonfinite_rows_of(scaled_naive_rwkv(c), "layers.1.mixer", batches[0][0])) < 4)
    model = scaled_naive_rwkv(scale)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = torch.nn.MSELoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="state_space_models:make_naive_rwkv"):
            for x, y in batches:
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    err = info.value
    step = err.event["step"]
    assert (step, err.event["module"]) == (0, "layers.1.mixer"), err.event
    rows = nonfinite_rows_of(model, "layers.1.mixer", batches[step][0])
    assert len(rows) > 1, rows
    rep = nanreplay_json(err.bundle_path, "--try", f"drop={','.join(map(str, rows))}")
    o = rep["origin"]
    assert (o["phase"], o["module"], o["call"], o["op"], rep["cause"]) == \
        ("forward", "layers.1.mixer", 0, "aten.exp", "overflow"), json.dumps(rep, indent=1)
    assert o["samples"] == rows, (o["samples"], rows)
    assert "subtract the row max before exp" in rep["hint"], rep["hint"]
    [what_if] = rep["what_if"]
    assert what_if["finite"] is True, what_if


def test_a_relu_parametrised_s4d_rate_at_zero_is_named_in_the_kernel_with_weights_advice(
        tmp_path):
    """S4D with ``A = -relu(A_real) + i * A_imag`` (S4's ``real_transform="relu"``) and a
    random init of ``A_real``: where it is negative relu makes the rate 0, and the S4D-Lin mode
    0 has no imaginary part, so the zero-order hold's ``C (exp(dt A) - 1) / A`` is 0/0 at the
    first step, in the kernel that no sample's data reaches. Named at the complex division in
    the kernel, every sample; the advice said to add an eps or skip the rows where the
    denominator is 0; now that the values came from the weights alone, and to keep the
    parametrisation off the pole (``-exp(A_log)``, a clamp)."""
    g = torch.Generator().manual_seed(0)
    batches = [padded([30, 20, 25, 12], 32, g) for _ in range(2)]
    model = S.make_s4d_relu()
    zero = [i for i, layer in enumerate(model.layers)
            if bool((layer.mixer.kernel.A_real[:, 0] <= 0).any())]  # mode 0: A_imag = 0
    with pytest.raises(NonFiniteError) as info:
        train_lm(tmp_path, model, "make_s4d_relu", batches)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (0, "forward"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["call"], o["op"], o["made"], rep["cause"]) == \
        (f"layers.{zero[0]}.mixer.kernel", 0, "aten.div", "nan", "invalid"), \
        json.dumps(rep, indent=1)
    assert o["samples"] == [0, 1, 2, 3] and o["all_samples"] is True, o
    assert "parameters and buffers alone" in rep["hint"] and "skip the rows" not in \
        rep["hint"], rep["hint"]


def test_a_left_padded_log_space_scan_is_named_at_logcumsumexp_with_its_own_advice(tmp_path):
    """minGRU in log space (Heinsen's scan, ``a* + logcumsumexp(log b - a*)``), padded steps
    filled with a log value of -inf; a left-padded batch (step 2) gives logcumsumexp a row
    whose first steps are all -inf: its result there is -inf, exp takes it to 0 and the
    forward is finite, but the derivative exp(x - result) is NaN. The report called it
    logcumsumexp "at its pole, in a branch masked before the output" (it has neither); now
    the slice of -inf it was given, and a finite fill or an initial state as the fix, on the
    left-padded rows."""
    g = torch.Generator().manual_seed(0)
    batches = [padded([16] * 4, 16, g, left=True), padded([16] * 4, 16, g, left=True),
               padded([16, 12, 16, 9], 16, g, left=True)]
    with pytest.raises(NonFiniteError) as info:
        train_lm(tmp_path, S.make_mingru(), "make_mingru", batches)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (2, "backward"), err.event
    left_padded = torch.nonzero(batches[2][:, 0] == 0).flatten().tolist()
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("backward", "layers.1.mixer", "LogcumsumexpBackward0", left_padded, "invalid"), \
        json.dumps(rep, indent=1)
    assert "every position of a slice" in rep["hint"] and "at its pole" not in rep["hint"], \
        rep["hint"]

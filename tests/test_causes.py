"""Causes as IEEE 754 and numerical analysis name them (issue 11, item 4), end to end.

Each test trains a model from ``cause_models`` as a user would (SGD with momentum, a real loss)
until the recorder raises, runs ``nanreplay BUNDLE --json`` through the command line, and
asserts the phase, step, module, op, samples and cause, and that the hint says what happened
and what fixes it: ``invalid`` (a pole, 0/0, an impossible CTC alignment), ``overflow``
(float64 holds the result, or does not), ``underflow`` (a softmax probability rounded to 0,
in float32 only or in float64 too) and ``precision`` (a variance E[x²] − E[x]² cancelled
below 0).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import cause_models as C
import pytest
import replay_models as R
import torch
from bundles import nanreplay_json
from click.testing import CliRunner
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle
from replay.cause_text import CAUSES, HINTS, MEANING
from replay.cli import main as cli
from replay.html import render_html

HERE = Path(__file__).parent
K = 3  # the step at which every planted bug fires
ROW = 5  # the row that carries it


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def train(factory: str, make, out_dir: Path, *, loss_fn=None, steps: int = 6,
          call=None) -> NonFiniteError:
    """Train ``cause_models.<factory>()`` until the recorder raises. ``make(step)`` gives
    ``(model args, target)``; ``call(loss_fn, output, target)`` computes the loss."""
    model = getattr(C, factory)()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir,
                            factory=f"cause_models:{factory}"):
            for step in range(steps):
                args, target = make(step)
                opt.zero_grad()
                out = model(*args)
                loss = call(loss_fn, out, target) if call else loss_fn(out, target)
                loss.backward()
                opt.step()
    return info.value


def with_row(values, step: int = K, row: int = ROW):
    """``replay_models.batch`` with row ``row`` set to ``values`` at ``step``."""

    def make(s):
        x, y = R.batch(s)
        if s == step:
            x[row] = torch.tensor(values)
        return (x,), y

    return make


def check(rep: dict, err: NonFiniteError, *, phase, module, op, samples, cause, made=None):
    o = rep["origin"]
    got = (rep["event"]["step"], o["phase"], o["module"], o["op"], o["samples"], rep["cause"])
    assert got == (K, phase, module, op, samples, cause), json.dumps(rep, indent=1)
    assert err.event["step"] == K and rep["reproduced"] is True
    if made is not None:  # what the blamed op made, in the origin and in the chain alike
        assert o["made"] == made == next(c["made"] for c in o["chain"] if c["op"] == o["op"]), o


# ---------------------------------------------------------------------------------------------
# input


def test_a_batch_infinity_the_forward_saturated_is_input_in_backward(tmp_path):
    """An +inf feature in one sample: Linear makes +-inf, tanh makes +-1, the loss is finite
    (by default an infinity that stays inside is no event); the first layer's weight gradient
    multiplies the saved input's +inf by gradients that include 0: NaN. Backward event, the
    node that saved the infinity, the sample that brought it, cause ``input`` (no pole)."""
    err = train("make_tanh_net", with_row([0.5, math.inf, -0.5, 1.0]), tmp_path)
    rep = nanreplay_json(err.bundle_path)
    check(rep, err, phase="backward", module="0", op="AddmmBackward0", samples=[ROW],
          cause="input", made="nan")
    assert "saved in the forward" in rep["hint"] and "+Inf" in rep["hint"], rep["hint"]
    assert "pole" not in rep["hint"], rep["hint"]


@pytest.mark.parametrize("value, wide", [(100.0, "float64 holds it"),
                                          (1000.0, "float64 overflows too")])
def test_an_overflow_masked_in_the_forward_is_overflow_in_backward(tmp_path, value, wide):
    """``torch.where(x < 20, exp(x), x)``: exp(100) and exp(1000) overflow float32 and are
    masked, so the forward is finite; exp's derivative multiplies the saved +inf by the
    masked branch's 0. The node is ExpBackward0, the cause ``overflow`` (exp has no pole), and
    the hint says whether float64 holds the value."""
    err = train("make_soft_clip_net", with_row([0.5, value, -0.5, 1.0]), tmp_path)
    rep = nanreplay_json(err.bundle_path)
    check(rep, err, phase="backward", module="1", op="ExpBackward0", samples=[ROW],
          cause="overflow", made="nan")
    assert "saved in the forward" in rep["hint"] and wide in rep["hint"], rep["hint"]
    assert "pole" not in rep["hint"], rep["hint"]


def test_a_nan_masked_in_the_forward_is_invalid_in_backward_and_says_so(tmp_path):
    """``torch.where(x >= -5, sqrt(x + 5), 0)`` at -9: sqrt's NaN is masked, so the forward
    is finite; sqrt's derivative divides the masked 0 by the saved NaN. The cause is
    ``invalid`` (a domain, in exact arithmetic too) and the hint says the NaN was saved in a
    masked branch, not that the derivative has a pole."""
    err = train("make_masked_sqrt_net", with_row([0.5, -9.0, 0.5, 1.0]), tmp_path)
    rep = nanreplay_json(err.bundle_path)
    check(rep, err, phase="backward", module="1", op="SqrtBackward0", samples=[ROW],
          cause="invalid", made="nan")
    assert "NaN it saved in the forward" in rep["hint"] and "pole" not in rep["hint"], rep["hint"]


def test_a_pole_that_rounding_reached_is_precision_in_backward(tmp_path):
    """``sqrt(1 - sigmoid(x))`` at x = 20: 1 - sigmoid(20) is 0 in float32 and 2e-9 in float64,
    so sqrt's derivative is infinite in float32 only. Not an overflow (no gradient too large
    for the type) and not invalid (exact arithmetic stays off the pole): ``precision``."""
    err = train("make_noise_scale_net", with_row([0.5, 20.0, -0.5, 1.0]), tmp_path)
    rep = nanreplay_json(err.bundle_path)
    check(rep, err, phase="backward", module="1", op="SqrtBackward0", samples=[ROW],
          cause="precision", made="+inf")
    hint = rep["hint"]
    assert "pole" in hint and "finite in float64" in hint and "sigmoid" in hint, hint


def test_a_pole_that_underflow_reached_is_underflow_in_backward(tmp_path):
    """``sqrt(exp(logvar))`` at logvar = -120: exp underflows to 0 in float32 (8e-53 in
    float64), so sqrt's derivative is infinite in float32 only. The 0 on the pole came from
    exp, positive in exact arithmetic: ``underflow`` (not the cancellation of 1 - sigmoid)."""
    err = train("make_logvar_std_net", with_row([0.5, -120.0, -0.5, 1.0]), tmp_path)
    rep = nanreplay_json(err.bundle_path)
    check(rep, err, phase="backward", module="1", op="SqrtBackward0", samples=[ROW],
          cause="underflow", made="+inf")
    hint = rep["hint"]
    assert "exp, softmax, sigmoid or softplus" in hint and "log space" in hint, hint


def test_a_unit_vectors_cosine_with_itself_is_a_pole_whatever_float64_rounds(tmp_path):
    """acos of the dot of a row's two unit embeddings, where both halves of row 5 are the same
    record: its cosine is 1 in exact arithmetic, 1 in float32, and 1 or 1 - 1e-16 in float64
    by the summation order of the CPU's kernels (1 - 1e-16 on AVX2, 1 on the scalar ones).
    acos's derivative is infinite there: ``invalid`` either way, not ``precision`` (the
    float64 cosine compares equal operands and is within rounding noise of the edge;
    replay.exact_edge). Its ``precision`` counterpart, distinct vectors a float32 rounding
    apart: test_numerics' ArcFace weight planted along an embedding."""
    err = train("make_twin_angle_net", with_row([0.4, 0.84, 0.4, 0.84]), tmp_path)
    rep = nanreplay_json(err.bundle_path)
    check(rep, err, phase="backward", module="0", op="AcosBackward0", samples=[ROW],
          cause="invalid")
    hint = rep["hint"]
    assert "exactly +-1" in hint and "cos.clamp(-1 + eps, 1 - eps)" in hint, hint


def test_a_pole_masked_in_the_forward_is_invalid_not_overflow(tmp_path):
    """``torch.where(h != 0, 1 / h, 0)`` at a zero row: the reciprocal saves its +inf result
    (a pole, not an overflow), the masked branch's 0 meets it in the backward."""
    err = train("make_safe_inverse_net", with_row([0.0] * 4), tmp_path)
    rep = nanreplay_json(err.bundle_path)
    check(rep, err, phase="backward", module="1", op="ReciprocalBackward0", samples=[ROW],
          cause="invalid", made="nan")
    assert "reciprocal at its pole" in rep["hint"], rep["hint"]


# ---------------------------------------------------------------------------------------------
# invalid


def test_zero_over_zero_is_invalid(tmp_path):
    err = train("make_share_net", with_row([0.0] * 4), tmp_path)
    rep = nanreplay_json(err.bundle_path)
    check(rep, err, phase="forward", module="share", op="aten.div", samples=[ROW],
          cause="invalid", made="nan")
    assert "0/0" in rep["hint"] and "eps" in rep["hint"], rep["hint"]


def test_modules_that_pass_another_call_through_are_not_recorded_and_still_replay(tmp_path):
    """Plain ``Sequential``s and ``Identity``s are not hooked (their output is another call's):
    the bundle names them, the ring has no calls of theirs, the event names the leaf that made
    the NaN, and the re-run, which calls them, still matches the recorded step."""
    err = train("make_nested_share_net", with_row([0.0] * 4), tmp_path)
    assert err.event["module"] == "1.1.1" and err.event["phase"] == "forward"
    meta, tensors = read_bundle(err.bundle_path)
    assert meta["passthrough_modules"] == ["0", "1", "1.1", "1.1.0"]
    names = [m["name"] for m in meta["modules"]]
    recorded = {names[i] for i in tensors["ring/call_module"].flatten().tolist() if i >= 0}
    assert recorded == {"", "1.0", "1.1.1", "2"}
    rep = nanreplay_json(err.bundle_path)
    check(rep, err, phase="forward", module="1.1.1", op="aten.div", samples=[ROW],
          cause="invalid", made="nan")
    assert rep["fidelity"]["matches"] is True, rep["fidelity"]


def test_rsqrt_of_zero_is_a_pole(tmp_path):
    """RMSNorm without eps on an all-zero row: rsqrt(0) = +inf (then 0 * inf = NaN)."""
    err = train("make_rms_net", with_row([0.0] * 4), tmp_path)
    rep = nanreplay_json(err.bundle_path)
    check(rep, err, phase="forward", module="norm", op="aten.rsqrt", samples=[ROW],
          cause="invalid", made="+inf")
    assert "rsqrt of 0" in rep["hint"] and "pole" in rep["hint"], rep["hint"]


def ctc_batches(step: int):
    """Frames (4, 6, D), targets of 2-3 labels; at step K row 2 has 2 frames for 3 labels."""
    g = torch.Generator().manual_seed(500 + step)
    n, t = 4, 6
    x = torch.randn(n, t, C.D_IN, generator=g)
    targets = torch.randint(1, 5, (n, 8), generator=g)
    target_lengths = torch.tensor([3, 2, 3, 2])
    input_lengths = torch.full((n,), t, dtype=torch.long)
    if step == K:
        input_lengths[2] = 2
    return (x,), (targets, input_lengths, target_lengths)


def test_ctc_target_longer_than_its_input_is_invalid(tmp_path):
    err = train("make_ctc_net", ctc_batches, tmp_path, loss_fn=nn.CTCLoss(),
                call=lambda fn, out, t: fn(out, *t))
    assert err.event["phase"] == "loss"
    rep = nanreplay_json(err.bundle_path)
    check(rep, err, phase="loss", module="<loss>", op="aten._ctc_loss", samples=[2],
          cause="invalid", made="+inf")
    hint = rep["hint"]
    assert "cannot be aligned" in hint and "zero_infinity=True" in hint, hint
    assert "row 2: target of 3 labels needs 3 frames, the input has 2" in hint, hint


def test_std_of_a_one_sample_batch_is_invalid(tmp_path):
    """The epoch's last batch holds one sample: torch.std over the batch divides by n - 1 = 0
    (NaN, with torch's warning), the same in exact arithmetic."""

    def make(s):
        x, y = R.batch(s)
        return ((x[:1],), y[:1]) if s == K else ((x,), y)

    with pytest.warns(UserWarning, match="degrees of freedom"):  # torch's, in training...
        err = train("make_batch_standardize", make, tmp_path)
    with pytest.warns(UserWarning, match="degrees of freedom") as seen:  # ...in the re-runs
        rep = nanreplay_json(err.bundle_path)
    # once, not once per re-run (the CLI shows each of the step's warnings once)
    assert sum("degrees of freedom" in str(w.message) for w in seen) == 1, seen.list
    check(rep, err, phase="forward", module="0", op="aten.std", samples=[0],
          cause="invalid", made="nan")
    assert "too few values" in rep["hint"] and "correction=0" in rep["hint"], rep["hint"]
    assert rep["origin"]["all_samples"] is True


def test_multihead_attention_over_an_all_padding_sample_is_invalid(tmp_path):
    """nn.MultiheadAttention (need_weights, the default) with a key-padding mask: a sample
    that is padding only has no key; MHA fills -inf itself (intentional), its softmax is
    NaN."""

    def make(s):
        g = torch.Generator().manual_seed(300 + s)
        ids = torch.randint(0, 11, (6, 5), generator=g)
        pad = torch.zeros(6, 5, dtype=torch.bool)
        pad[:, 4] = True  # every sample has one padding position
        if s == K:
            pad[2] = True  # sample 2 is empty
        return (ids, pad), torch.randint(0, C.N_CLASSES, (6,), generator=g)

    err = train("make_padded_attention_net", make, tmp_path)
    rep = nanreplay_json(err.bundle_path)
    check(rep, err, phase="forward", module="attn", op="aten._softmax", samples=[2],
          cause="invalid", made="nan")
    chain = rep["origin"]["chain"]
    assert chain[0]["made"] == "-inf" and chain[0]["intentional"] is True, chain
    assert "fully masked row" in rep["hint"] and "keep at least one key" in rep["hint"]
    page = tmp_path / "r.html"
    assert CliRunner().invoke(cli, [str(err.bundle_path), "--html", str(page)]).exit_code == 0
    assert "NaN first made by <code>aten._softmax</code>" in page.read_text()


def test_an_all_padding_sample_of_a_sequence_first_batch_is_named_by_its_batch_index(tmp_path):
    """The same bug with MultiheadAttention's default layout, ids ``(T, B)``: the samples are
    the batch's dim 1, so the report names sample 2, not time steps (dim 0 is the sequence)."""

    def make(s):
        g = torch.Generator().manual_seed(300 + s)
        ids = torch.randint(0, 11, (5, 6), generator=g)  # 5 positions of 6 samples
        pad = torch.zeros(6, 5, dtype=torch.bool)
        pad[:, 4] = True
        if s == K:
            pad[2] = True  # sample 2 is empty
        return (ids, pad), torch.randint(0, C.N_CLASSES, (6,), generator=g)

    err = train("make_seq_first_attention_net", make, tmp_path)
    assert err.event["samples"] == [2], err.event
    rep = nanreplay_json(err.bundle_path)
    check(rep, err, phase="forward", module="attn", op="aten._softmax", samples=[2],
          cause="invalid", made="nan")
    assert rep["origin"]["batch_size"] == 6 and rep["origin"]["all_samples"] is False


def test_a_bad_sample_of_a_sequence_first_lstm_batch_is_named_by_its_batch_index(tmp_path):
    """``nn.LSTM``'s default ``(T, B, F)``: sample 3's features are NaN at every time step.
    The event and the report name sample 3 of 5, not the 7 time steps."""

    def make(s):
        g = torch.Generator().manual_seed(400 + s)
        x = torch.randn(7, 5, C.D_IN, generator=g)
        if s == K:
            x[:, 3] = math.nan
        return (x,), torch.randint(0, C.N_CLASSES, (5,), generator=g)

    err = train("make_seq_first_lstm", make, tmp_path)
    assert (err.event["phase"], err.event["samples"]) == ("input", [3]), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["phase"], o["samples"], o["batch_size"]) == ("input", "input", [3], 5)
    # --try drop= removes the samples the report names, along the same dim
    res = CliRunner().invoke(cli, [str(err.bundle_path), "--json", "--try", "drop=3",
                                   "--try", "drop=4"])
    tries = {t["try"]: t for t in json.loads(res.stdout)["what_if"]}
    assert tries["drop=3"]["finite"] is True, tries
    assert tries["drop=4"]["finite"] is False, tries


# ---------------------------------------------------------------------------------------------
# overflow


def test_exp_overflow_that_float64_holds(tmp_path):
    err = train("make_exp_first", with_row([100.0, 0.0, 0.0, 0.0]), tmp_path)
    rep = nanreplay_json(err.bundle_path)
    check(rep, err, phase="forward", module="0", op="aten.exp", samples=[ROW],
          cause="overflow", made="+inf")
    hint = rep["hint"]  # e^100 = 2.69e43 > float32's 3.4e38
    assert "float64 holds it" in hint and "2.69e+43" in hint, hint
    assert "subtract the row max" in hint and "compute it in float64" in hint, hint


def test_a_power_overflow_beyond_float64_is_not_told_to_subtract_the_row_max(tmp_path):
    """x ** 40 of 1e9 is 1e360, beyond float64 too. The hint was exp's ('clamp the exponent
    or the input range (subtract the row max before exp, ...)'), which does not apply."""
    err = train("make_power_first", with_row([1e9, 0.0, 0.0, 0.0]), tmp_path)
    rep = nanreplay_json(err.bundle_path)
    check(rep, err, phase="forward", module="0", op="aten.pow", samples=[ROW],
          cause="overflow", made="+inf")
    hint = rep["hint"]
    assert "for float64 as well" in hint and "clamp the input range" in hint, hint
    assert "row max" not in hint, hint


def test_exp_overflow_beyond_float64(tmp_path):
    err = train("make_exp_first", with_row([1000.0, 0.0, 0.0, 0.0]), tmp_path)
    rep = nanreplay_json(err.bundle_path)
    check(rep, err, phase="forward", module="0", op="aten.exp", samples=[ROW],
          cause="overflow", made="+inf")
    hint = rep["hint"]
    assert "for float64 as well" in hint and "clamp the exponent" in hint, hint
    assert "compute it in float64" not in hint, hint


def test_auto_tries_dropping_the_samples_of_an_overflow_confined_to_them(tmp_path):
    """exp overflows in sample 5 only (a record 100x out of scale): --try auto proposed only
    a wider type, a smaller learning rate and clipping, none of which tests the data; dropping
    that sample does, and the step is then finite."""
    err = train("make_exp_first", with_row([1000.0, 0.0, 0.0, 0.0]), tmp_path)
    res = CliRunner().invoke(cli, [str(err.bundle_path), "--json", "--try", "auto"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["cause"] == "overflow" and rep["origin"]["samples"] == [ROW], rep["origin"]
    tries = {t["try"]: t for t in rep["what_if"]}
    assert f"drop={ROW}" in tries and tries[f"drop={ROW}"]["finite"] is True, tries


def tiny_row_in_float16(step):
    """The batch in float16, row ROW at step K 1e-4 in scale: its squares underflow."""
    x, y = R.batch(step)
    if step == K:
        x[ROW] = torch.tensor([1e-4, -1e-4, 2e-4, 1e-4])
    return (x.half(),), y


def test_a_try_re_runs_the_loss_on_a_cast_of_the_re_run_output(tmp_path):
    """A float16 model whose loop gives the loss ``model(x).float()``: the bundle kept that
    cast as a recorded copy, so --try dtype=float32 fed the loss the recorded non-finite
    values and reported "nan at step 3 (loss)" although the float32 re-run of the model is
    finite. The cast is now recorded as a cast of the output and re-done on the re-run's."""
    err = train("make_half_rms_net", tiny_row_in_float16, tmp_path,
                call=lambda fn, out, y: fn(out.float(), y))
    meta, _ = read_bundle(err.bundle_path)
    tree = json.dumps(meta["micro_batches"][0]["loss_inputs"])
    assert '{"$out": 0, "dtype": "float32"}' in tree, tree
    res = CliRunner().invoke(cli, [str(err.bundle_path), "--json", "--try", "dtype=float32"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    check(rep, err, phase="forward", module="0", op="aten.rsqrt", samples=[ROW],
          cause="underflow", made="+inf")
    (t,) = rep["what_if"]
    assert t["finite"] is True and t["inconclusive"] is False, t


def test_a_float16_underflow_that_float32_holds_says_so_and_auto_tries_float32(tmp_path):
    """The same float16 RMSNorm: the mean square, 1.75e-8, is below float16's range but a
    normal float32 number. The hint offered only log space and a clamp; it now says float32
    holds it, and --try auto tries float32 (finite), as it does for a float16 overflow."""
    err = train("make_half_rms_net", tiny_row_in_float16, tmp_path,
                call=lambda fn, out, y: fn(out.float(), y))
    res = CliRunner().invoke(cli, [str(err.bundle_path), "--json", "--try", "auto"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["cause"] == "underflow", rep["hint"]
    assert "below float16's smallest normal number" in rep["hint"], rep["hint"]
    assert "float32 holds it: compute in float32" in rep["hint"], rep["hint"]
    tries = {t["try"]: t for t in rep["what_if"]}
    assert tries["dtype=float32"]["finite"] is True, tries


def test_autocast_float16_overflow_says_float32_holds_it(tmp_path):
    """A matmul under float16 autocast past 65504: float32 (and float64) hold it, so the
    hint is the wider type, outside autocast."""
    model = R.make_amp_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="replay_models:make_amp_net"):
            for step in range(6):
                x, y = R.batch(step)
                if step == K:
                    x[ROW] = 6e4
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = crit(model(x), y)
                loss.backward()
                opt.step()
    rep = nanreplay_json(info.value.bundle_path)
    check(rep, info.value, phase="forward", module="lin", op="aten.addmm", samples=[ROW],
          cause="overflow", made="+inf")
    hint = rep["hint"]
    assert "float16's largest value 6.55e+04; float64 holds it" in hint, hint
    assert "compute this op in float32 (outside autocast" in hint, hint


def test_float32_backward_overflow_after_a_learning_rate_jump(tmp_path):
    """A float32 model of PyTorch's modules whose schedule multiplies the learning rate by
    2000: backward overflows a few steps later. float64 holds the gradient, and the model is
    float32 already, so the hint is rescaling or float64 (not "compute it in float32"); no
    line of the user's made the node (the replay's own callers are not named); the jump is
    one precursor line, however many steps it lasts."""
    model = C.make_tanh_regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 if s < 20 else 2000.0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 8, generator=g)
    y = (x ** 2).sum(1, keepdim=True)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=tmp_path, factory="cause_models:make_tanh_regressor"):
            for _ in range(200):
                idx = torch.randint(0, 512, (32,), generator=g)
                loss = ((model(x[idx]) - y[idx]) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
    rep = nanreplay_json(info.value.bundle_path)
    assert (rep["origin"]["phase"], rep["cause"], rep["reproduced"]) == \
        ("backward", "overflow", True), json.dumps(rep, indent=1)
    assert "float64" in rep["hint"] and "in float32" not in rep["hint"], rep["hint"]
    assert rep["origin"]["source"] is None, rep["origin"]
    jumps = [p for p in rep["precursors"] if p["kind"] == "lr_jump"]
    assert [p["step"] for p in jumps] == [20], rep["precursors"]
    assert f"through step {rep['event']['step']}" in jumps[0]["detail"], jumps


# ---------------------------------------------------------------------------------------------
# underflow


def test_log_of_a_softmax_probability_rounded_to_zero_is_underflow(tmp_path):
    """A logit 260 below the others: softmax gives 1.1e-114, 0 in float32, kept by float64."""
    err = train("make_naive_log_softmax", with_row([0.0, -260.0, 1.0, 2.0]), tmp_path)
    rep = nanreplay_json(err.bundle_path)
    check(rep, err, phase="forward", module="0", op="aten.log", samples=[ROW],
          cause="underflow", made="-inf")
    hint = rep["hint"]
    assert "1.09e-114 in float64" in hint and "log_softmax" in hint, hint
    assert "float32 (outside autocast)" not in hint, hint  # the old advice fixes nothing here


def test_underflow_that_float64_shares_is_still_underflow(tmp_path):
    """A gap of 800: exp(-800) is 0 in float64 as well, but positive in exact arithmetic,
    and the 0 came from softmax of a finite row."""
    err = train("make_naive_log_softmax", with_row([0.0, -800.0, 1.0, 2.0]), tmp_path)
    rep = nanreplay_json(err.bundle_path)
    check(rep, err, phase="forward", module="0", op="aten.log", samples=[ROW],
          cause="underflow", made="-inf")
    assert "softmax" in rep["hint"] and "below float64's range as well" in rep["hint"]


def test_log_of_an_exact_zero_is_invalid_not_underflow(tmp_path):
    """The log-energy of a silent row: the energy is exactly 0 (a sum of squares of zeros),
    in float64 too and in exact arithmetic, so log(0) is a pole, not an underflow."""
    err = train("make_energy_net", with_row([0.0] * 4), tmp_path)
    rep = nanreplay_json(err.bundle_path)
    check(rep, err, phase="forward", module="energy", op="aten.log", samples=[ROW],
          cause="invalid", made="-inf")
    assert "log of 0" in rep["hint"] and "pole" in rep["hint"], rep["hint"]


# ---------------------------------------------------------------------------------------------
# precision


def test_sqrt_of_a_cancelled_variance_is_precision(tmp_path):
    """E[x²] − E[x]² of a row with mean 1e4 and spread 0.05: -8 in float32 (the squares'
    rounding step is 8), 0.0031 in float64; sqrt of it is NaN."""
    row = [1e4, 1e4 + 0.05, 1e4 + 0.1, 1e4 + 0.15]
    err = train("make_one_pass_norm", with_row(row), tmp_path)
    rep = nanreplay_json(err.bundle_path)
    check(rep, err, phase="forward", module="0", op="aten.sqrt", samples=[ROW],
          cause="precision", made="nan")
    hint = rep["hint"]
    assert "negative" in hint and "0.00314" in hint and "torch.var" in hint, hint
    assert "float32 (outside autocast)" not in hint, hint


def test_auto_tries_float64_for_a_float32_cancellation(tmp_path):
    """The same cancelled variance: --try auto proposed only dropping the row, which says
    nothing of the formula; float64, where the variance stays positive, trains on finite (the
    stable formula is then the fix the hint names)."""
    row = [1e4, 1e4 + 0.05, 1e4 + 0.1, 1e4 + 0.15]
    err = train("make_one_pass_norm", with_row(row), tmp_path)
    res = CliRunner().invoke(cli, [str(err.bundle_path), "--json", "--try", "auto"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["cause"] == "precision", rep["hint"]
    tries = {t["try"]: t for t in rep["what_if"]}
    assert tries["dtype=float64"]["finite"] is True, tries


def test_log_of_one_minus_a_rounded_sigmoid_is_precision_not_underflow(tmp_path):
    """A hand-written binary cross entropy: sigmoid(z) for z near 20 rounds to 1 in float32,
    1 - p to 0, and log(0) is -inf. The 0 is a cancellation, not an underflow: float64 keeps
    about 2e-9, far above float32's smallest normal number."""
    made = C.make_naive_bce()
    model, loss_fn = made["model"], made["loss_fn"]
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=tmp_path,
                            factory="cause_models:make_naive_bce"):
            for step in range(6):
                x, _ = R.batch(step)
                y = torch.zeros(len(x))  # every target is the negative class
                if step == K:
                    x[ROW] = 5.0  # z = 20: a confident, wrong prediction
                opt.zero_grad()
                loss_fn(model(x), y).backward()
                opt.step()
    rep = nanreplay_json(info.value.bundle_path)
    check(rep, info.value, phase="loss", module="<loss>", op="aten.log", samples=[ROW],
          cause="precision", made="-inf")
    hint = rep["hint"]
    m = re.search(r"float64 has (\S+) there", hint)
    assert "aten.log of 0" in hint and m and 1e-10 < float(m.group(1)) < 1e-7, hint
    assert "binary_cross_entropy_with_logits" in hint, hint


def test_acos_of_a_cosine_rounded_past_one_prints_the_value_past_the_edge(tmp_path):
    """Two equal halves: the dot product of their unit vectors is 1.0000001 in float32 (1 in
    float64), so acos is NaN. The hint must show the value past the edge, not round it to the
    "1" it crossed ("|x| up to 1 (float64 has 1 there)" read as acos of 1, inside the domain),
    and give the clamp for a cosine, not the variance advice."""
    u = [0.8487103581428528, 0.6920091509819031]
    err = train("make_angle_net", with_row(u + u), tmp_path)
    rep = nanreplay_json(err.bundle_path)
    check(rep, err, phase="forward", module="0", op="aten.acos", samples=[ROW],
          cause="precision", made="nan")
    hint = rep["hint"]
    assert "outside [-1, 1] (1.0000001)" in hint and "float64 has 1 there" in hint, hint
    assert "clamp(-1 + eps, 1 - eps)" in hint and "variance" not in hint, hint


def test_a_cosine_that_float64_also_rounds_past_one_is_still_precision(tmp_path):
    """The same equal halves, but a pair whose unit vectors' dot product is past 1 in float64
    too (1.0000000000000004, against float32's 1.0000001): exact arithmetic gives exactly 1,
    so acos's NaN is rounding, not invalid math. The margin past the edge shrank with the
    type's epsilon, which is what tells it from a value truly outside the domain."""
    u = [-0.07439491897821426, -1.0922236442565918]
    err = train("make_angle_net", with_row(u + u), tmp_path)
    rep = nanreplay_json(err.bundle_path)
    check(rep, err, phase="forward", module="0", op="aten.acos", samples=[ROW],
          cause="precision", made="nan")
    hint = rep["hint"]
    assert "float64 is past the edge too, but by 4.44e-16 against float32's 1.19e-07" in hint, hint
    assert "exact arithmetic makes too" not in hint, hint


# ---------------------------------------------------------------------------------------------
# one table of cause texts


def test_every_cause_has_one_meaning_and_one_hint_used_by_every_report():
    assert set(MEANING) == set(CAUSES) and set(CAUSES) <= set(HINTS)
    for cause in CAUSES:
        page = render_html({"event": {"step": 1}, "origin": {"phase": "forward"},
                            "reproduced": True, "cause": cause, "hint": HINTS[cause]}, {})
        assert MEANING[cause].replace("'", "&#x27;") in page, cause
    guide = (HERE.parent / "docs" / "guide.md").read_text()
    for cause in CAUSES:
        assert f"| `{cause}` |" in guide, cause


def test_a_sum_of_squares_past_float32_whose_mean_fits_says_so(tmp_path):
    """MSELoss of outputs near 1.7e19: each square (3e38) fits float32, their sum does not,
    and the mean (2e37) fits again. The hint said "true result (up to 1.99e+37) is finite but
    beyond float32's largest value 3.4e+38"; it must say what went beyond it."""
    model, crit = R.make_mlp(), nn.MSELoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="replay_models:make_mlp"):
            x, _ = R.batch(K)
            x[ROW] *= 4e19
            opt.zero_grad()
            out = model(x)
            crit(out, torch.zeros_like(out)).backward()
            opt.step()
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (info.value.event["step"], o["phase"], o["module"], o["op"], rep["cause"]) == \
        (0, "loss", "<loss>", "aten.mse_loss", "overflow"), json.dumps(rep, indent=1)
    hint = rep["hint"]
    assert "(up to 1.99e+37) fits in float32, but a value it computes on the way" in hint, hint
    assert "is finite but beyond" not in hint and "float64 holds it" in hint, hint

"""Mixture-of-experts language models and probabilistic models trained under the recorder,
with the bugs such code has, and what ``nanreplay`` says of them."""

from __future__ import annotations

import json
from pathlib import Path

import moe_probabilistic_models as M
import pytest
import torch
import torch.nn.functional as F
from bundles import invoke_cli, nanreplay_json

from recorder import FlightRecorder, NonFiniteError


def _lm_batches(n, vocab, repeated_at=None, B=4, T=16, short_at=None, short=8):
    g = torch.Generator().manual_seed(0)
    for s in range(n):
        x = torch.randint(1, vocab, (B, (T if s != short_at else short) + 1), generator=g)
        if s == repeated_at:
            x[:] = 7  # a shard of one repeated token: every token routes alike
        yield x[:, :-1], x[:, 1:]


def _train_moe(out_dir, factory_kwargs, repeated_at=None, short_at=None, **lengths):
    torch.manual_seed(0)
    model = M.make_moe_lm(**factory_kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    in_loop = factory_kwargs.get("aux_out") is False  # the loop adds the aux loss itself
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.lm_loss if in_loop else M.moe_lm_loss,
                            out_dir=out_dir, factory="moe_probabilistic_models:make_moe_lm",
                            factory_kwargs=factory_kwargs) as rec:
            for x, y in _lm_batches(8, 32, repeated_at, short_at=short_at, **lengths):
                opt.zero_grad()
                loss = rec.loss_fn(model(x), y)
                if in_loop:
                    loss = loss + model.aux_loss()
                loss.backward()
                opt.step()
    return info.value


def test_an_idle_experts_mean_in_the_aux_loss_is_invalid_not_underflow(out_dir):
    """The 0/0 of an expert no token chose is in the aux loss the MoE layer keeps aside, so the
    layer's own output is finite and only the root's output carries it. The op's occurrence
    was counted from the root's call, the float64 re-run looked for it from the layer's, found
    nothing, took the layer's finite output for a finite float64 step and said ``underflow``
    (a 0 rounded to 0) for an exact count of 0."""
    err = _train_moe(out_dir, {"idle_mean": True}, repeated_at=4)
    assert (err.event["step"], err.event["phase"]) == (4, "forward"), err.event
    res = invoke_cli(err.bundle_path, "--json")
    assert res.exit_code in (0, 1), res.output
    rep = json.loads(res.stdout)
    o = rep["origin"]
    assert (o["module"], o["op"], rep["cause"]) == ("blocks.0.moe", "aten.div", "invalid"), rep
    assert "0 by 0" in rep["hint"], rep["hint"]


def test_a_negative_rotary_base_is_a_power_outside_its_domain_not_an_overflow(out_dir):
    """Dynamic NTK scaling applied to a batch shorter than the trained length makes the
    rotary base negative, and ``base ** (i / d)`` is NaN. The float tensor of that
    ``pow(number, tensor)`` is the exponent, not the base: the exponent being positive read as
    a positive base, whose NaN could only be an overflow beyond float64."""
    err = _train_moe(out_dir, {"ntk": 4.0, "max_pos": 32}, short_at=3, T=32, short=16)
    assert (err.event["step"], err.event["phase"]) == (3, "forward"), err.event
    rep = nanreplay_json(err.bundle_path, code=None)
    o = rep["origin"]
    assert (o["module"], o["op"], rep["cause"]) == ("blocks.0.attn", "aten.pow", "invalid"), rep
    assert "negative base (-1e+04) to a fractional power" in rep["hint"], rep["hint"]


def _fused_attention_drops_nan() -> bool:
    """Whether this CPU's fused attention returns finite rows where the rotary NaN of the
    next test makes the scores NaN (the model's shapes: 4 x 2 heads x 8 positions x 8): it
    does on an Intel Xeon's kernels; on an AMD EPYC's the NaN comes out of the forward."""
    cos, sin = M.rope_cache(8, 8, -1e4, "cpu")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 2, 8, 8, generator=g) for _ in range(3))
    q, k = M.apply_rope(q, cos, sin), M.apply_rope(k, cos, sin)
    return bool(torch.isfinite(F.scaled_dot_product_attention(q, k, v, is_causal=True)).all())


def test_a_nan_that_attention_dropped_is_named_where_the_forward_made_it(out_dir):
    """The same rotary NaN at 8 positions: where CPU's fused attention returns 0 for rows
    whose scores are NaN, the forward is finite and its backward makes the NaN from the q and
    k it saved. The node is named, and the hint and chain the forward op that made that NaN
    (the power of a negative base), not a torch.where the model does not have. Where the
    kernel passes the NaN on, it is the forward's, named at that power."""
    err = _train_moe(out_dir, {"ntk": 4.0}, short_at=3)
    rep = nanreplay_json(err.bundle_path, code=None)
    o = rep["origin"]
    if not _fused_attention_drops_nan():
        assert (err.event["step"], err.event["phase"]) == (3, "forward"), err.event
        assert (o["phase"], o["module"], o["op"], rep["cause"]) == \
            ("forward", "blocks.0.attn", "aten.pow", "invalid"), rep
        assert "negative base (-1e+04) to a fractional power" in rep["hint"], rep["hint"]
        return
    assert (err.event["step"], err.event["phase"]) == (3, "backward"), err.event
    assert (o["module"], o["op"], rep["cause"]) == \
        ("blocks.1.attn", "ScaledDotProductFlashAttentionForCpuBackward0", "invalid"), rep
    assert o["chain"][0]["op"] == "aten.pow", o["chain"]
    assert "made by aten.pow at tests/moe_probabilistic_models.py:24 " in rep["hint"], rep["hint"]
    assert "negative base (-1e+04) to a fractional power" in rep["hint"], rep["hint"]
    assert "torch.where" not in rep["hint"], rep["hint"]


def test_an_aux_loss_added_in_the_loop_names_the_op_no_module_output_carried(out_dir):
    """The idle expert's 0/0, with the aux loss added in the loop (``ce + model.aux_loss()``)
    rather than returned: no module output and no loss_fn value is non-finite, the gradients
    are, so the event is a backward one that the re-run of loss_fn does not make. The report
    said only "NOT reproduced"; it now names the forward op that made the NaN no output
    carried, with its cause, and says how to make such a term replayable."""
    err = _train_moe(out_dir, {"idle_mean": True, "aux_out": False}, repeated_at=4)
    assert (err.event["step"], err.event["phase"]) == (4, "backward"), err.event
    rep = nanreplay_json(err.bundle_path, code=None)
    o = rep["origin"]
    assert rep["reproduced"] is False, rep
    assert (o["phase"], o["module"], o["op"], rep["cause"]) == \
        ("forward", "blocks.0.moe", "aten.div", "invalid"), rep
    assert "0 by 0" in rep["hint"] and "inside loss_fn" in rep["hint"], rep["hint"]
    assert any("no module output carries" in p for p in rep["problems"]), rep["problems"]


def test_a_nan_in_the_batch_that_validate_args_refused_is_an_input_event(out_dir):
    """A NaN reading in series 2 reaches ``Normal``'s ``validate_args``, which raises inside
    the forward: the recorder's note named the GRU that passed it on; it is an input event of
    the root's batch, on that series."""
    def bad(step):
        (past, cov), y = M.series(step)
        if step == 3:
            past[2, 5] = float("nan")
        return (past, cov), y
    torch.manual_seed(0)
    model = M.make_deepar(validate=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError) as info:
        with FlightRecorder(model, opt, loss_fn=M.gaussian_nll, out_dir=out_dir,
                            factory="moe_probabilistic_models:make_deepar",
                            factory_kwargs={"validate": True}) as rec:
            for s in range(6):
                (past, cov), y = bad(s)
                opt.zero_grad()
                rec.loss_fn(model(past, cov), y).backward()
                opt.step()
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "at step 3, phase input" in notes and "args[0], samples [2]" in notes, notes


def _train_deepar(out_dir, factory_kwargs, bad_at=None, steps=8, zeros_at=None, raises=None):
    torch.manual_seed(0)
    model = M.make_deepar(**factory_kwargs)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.raises(raises or NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.gaussian_nll, out_dir=out_dir,
                            factory="moe_probabilistic_models:make_deepar",
                            factory_kwargs=factory_kwargs) as rec:
            for s in range(steps):
                (past, cov), y = M.series(s, bad_at, zeros_at=zeros_at)
                opt.zero_grad()
                rec.loss_fn(model(past, cov), y).backward()
                opt.step()
    return info.value


def test_a_model_returning_a_distribution_is_replayed_with_its_loss(out_dir):
    """A forecaster returns ``torch.distributions.Normal`` and the loss is its ``log_prob``:
    the bundle held the loss's first argument as the object's repr, and every replay failed
    (``UnrebuildableLeaf: Normal``). The output as a whole is now a reference to the re-run's
    own output: the loss is re-run and the op, sample and cause are named."""
    err = _train_deepar(out_dir, {}, bad_at=5)
    assert (err.event["step"], err.event["phase"]) == (5, "loss"), err.event
    rep = nanreplay_json(err.bundle_path, code=None)
    o = rep["origin"]
    assert rep["reproduced"] is True, rep
    assert (o["phase"], o["op"], o["samples"], rep["cause"]) == \
        ("loss", "aten.pow", [4], "overflow"), rep
    assert "out of scale" in rep["hint"], rep["hint"]


def test_a_nan_that_validate_args_refused_is_named_in_the_forward_that_raised(out_dir):
    """DeepAR's mean scaling without its + 1 divides a series of zeros by 0, and ``Normal``'s
    ``validate_args`` (on by default) raises ValueError on the NaN loc inside the forward, so
    the root call never returns. The recorder bundles the cut-short step; the replay named the
    GRU that passed the NaN on (its inputs already NaN, its source torch's rnn.py, a generic
    cause), not the division in the forward that raised."""
    err = _train_deepar(out_dir, {"mean_scaling": True, "validate": True}, zeros_at=5,
                        raises=ValueError)
    notes = " ".join(getattr(err, "__notes__", []))
    # (the recorder's note named the GRU too: the root call, which raised, was never seen)
    assert "First made by module '<root>'" in notes and "inputs were finite" in notes, notes
    bundle = notes.split("Bundle: ")[1].split(";")[0]
    rep = nanreplay_json(bundle, code=None)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], o["samples"],
            rep["cause"]) == (5, "forward", "", "aten.div", [5], "invalid"), rep
    text = Path(M.__file__).read_text().splitlines()
    line = next(i for i, t in enumerate(text, 1) if "[past / v, covariate]" in t)
    assert o["source"].endswith(f"moe_probabilistic_models.py:{line}"), o["source"]
    assert "0 by 0" in rep["hint"], rep["hint"]

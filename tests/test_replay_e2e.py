"""End to end: record a real training loop until a planted bug fires, replay the bundle, and
check what the report says about it.

Every test trains a tiny model from ``replay_models`` with a real optimizer and a real loss under
:class:`~recorder.FlightRecorder`, catches the :class:`~recorder.NonFiniteError`, replays the
bundle with :func:`replay.replay` (the recorded factory is trusted because the tests run from
this directory, where ``replay_models.py`` lives) and asserts the origin's phase, module, call,
op, source line, samples and cause, and whether the event was reproduced.
"""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path

import pytest
import replay_models as R
import torch
from click.testing import CliRunner
from models import check_event
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle
from replay import replay
from replay.cli import main as cli

HERE = Path(__file__).parent
K = 3  # the step at which the planted bugs fire


pytestmark = pytest.mark.usefixtures("in_tests_dir")


# ---------------------------------------------------------------------------------------------
# the loop


def single(make):
    """Turn ``make(step) -> (x, y)`` into the loop's micro-batch list ``[((x,), {}, y)]``."""

    def batches(step):
        x, y = make(step)
        return [((x,), {}, y)]

    return batches


def record(factory: str, batches, out_dir: Path, *, steps: int = 6, lr: float = 0.05,
           optimizer=None, loss_fn=None, at=None, autocast=None, **rec_kwargs):
    """Train ``replay_models.<factory>()`` until the recorder raises; return (error, model,
    optimizer). ``batches(step)`` gives the step's micro-batches as ``(args, kwargs, target)``;
    the loss of each is divided by their number (gradient accumulation). ``at(step, opt)`` runs
    before each step; ``autocast`` (a dtype): forward and loss run under CPU autocast."""
    made = getattr(R, factory)()
    if not isinstance(made, dict):
        made = {"model": made}
    model = made["model"]
    if optimizer is None:
        optimizer = (made["optimizer"](model.parameters()) if "optimizer" in made
                     else torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
    opt = optimizer
    loss_fn = loss_fn or made.get("loss_fn") or nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir,
                            factory=f"replay_models:{factory}", **rec_kwargs):
            for step in range(steps):
                if at is not None:
                    at(step, opt)
                mbs = batches(step)
                opt.zero_grad()
                for args, kwargs, y in mbs:
                    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                        out = model(*args, **kwargs)
                        loss = loss_fn(out.reshape(-1, out.shape[-1]), y.reshape(-1)) / len(mbs)
                    loss.backward()
                opt.step()
    err = info.value
    assert err.bundle_path is not None and err.bundle_path.exists(), err
    return err, model, opt


def scaled_row(row: int, factor: float, step: int = K):
    """Batches of ``replay_models.batch`` with one row multiplied by ``factor`` at ``step``."""

    def make(s):
        x, y = R.batch(s)
        if s == step:
            x[row] *= factor
        return x, y

    return make


# ---------------------------------------------------------------------------------------------
# assertions


def source_of(obj, marker: str) -> str:
    """``replay_models.py:<line>`` of the first line of ``obj``'s source containing ``marker``."""
    lines, start = inspect.getsourcelines(obj)
    hits = [start + i for i, text in enumerate(lines) if marker in text]
    assert hits, f"{marker!r} not in the source of {obj}"
    return f"{Path(inspect.getsourcefile(obj)).name}:{hits[0]}"


def check_source(got: str | None, expected: str) -> None:
    """Same file name and line number (the report's path is relative to the working dir)."""
    assert got is not None, "the report names no source line"
    path, _, line = got.rpartition(":")
    assert (Path(path).name, line) == tuple(expected.split(":")), (got, expected)
    assert Path(path).resolve() == (HERE / Path(path).name).resolve(), got


def check(report: dict, **expected) -> None:
    """Assert origin fields, reporting the whole report on a mismatch; every cause comes with
    a hint."""
    o = report["origin"]
    got = {k: o.get(k) for k in expected}
    assert got == expected, json.dumps({k: v for k, v in report.items() if k != "history"},
                                       indent=1, default=str)
    assert report["cause"] and report["hint"], (report["cause"], report["hint"])


def check_bisection(report: dict) -> None:
    b = report["bisection"]
    assert b is not None, "no bisection for a forward origin"
    assert b["agrees"] is True, b
    assert b["calls"] > 0
    # the documented bound: ceil(log2 calls) bisection runs, then one run for the origin call
    assert b["limit"] == math.ceil(math.log2(b["calls"])) + 1, b
    assert b["probes"] <= b["limit"], b


def check_step(report: dict, step: int, event: dict | None = None) -> None:
    """The report's step, and the raised event's, is the step the test planted its bug in."""
    assert report["event"]["step"] == step, report["event"]
    if event is not None:
        assert event["step"] == step, event


def bare_first_nan_step(factory: str, batches, steps: int, lr: float = 0.05) -> int:
    """The first step whose loss is non-finite when ``record``'s loop runs the same seeded model
    without the recorder: the step a bug that depends on the RNG fires at, found apart from
    the tool (and equal only if the recorder consumed no random number)."""
    torch.manual_seed(0)  # as the autouse fixture seeded ``record``'s model
    model = getattr(R, factory)()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    for step in range(steps):
        [(args, kwargs, y)] = batches(step)
        opt.zero_grad()
        loss = loss_fn(model(*args, **kwargs), y)
        if not torch.isfinite(loss):
            return step
        loss.backward()
        opt.step()
    raise AssertionError(f"no non-finite loss in {steps} steps without the recorder")


def exit_code(bundle: Path) -> int:
    """What ``nanreplay BUNDLE`` exits with (0 reproduced and localised, 1 not reproduced)."""
    res = CliRunner().invoke(cli, [str(bundle), "--json"])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.output
    return res.exit_code


def ops(chain: list[dict]) -> list[tuple[str, str]]:
    return [(c["op"], c["made"]) for c in chain]


# ---------------------------------------------------------------------------------------------
# (a) a custom op making NaN mid-network


def test_custom_op_log_of_negative(tmp_path):
    err, _, _ = record("make_log_net", single(scaled_row(5, 100.0)), tmp_path)
    assert err.event["step"] == K and err.event["phase"] == "forward"
    rep = replay(err.bundle_path)
    check_step(rep, K, err.event)
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    check(rep, phase="forward", module="act", call=0, micro_batch=0, op="aten.log",
          made="nan", inputs_finite=True, samples=[5])
    check_source(rep["origin"]["source"], source_of(R.ShiftedLog, "torch.log"))
    lo, hi = rep["origin"]["input_range"]  # what aten.log was given: x + 3 < 0 somewhere
    assert lo < 0 < hi and math.isfinite(lo) and math.isfinite(hi)
    assert ops(rep["origin"]["chain"]) == [("aten.log", "nan")]
    assert rep["hint"] and "log" in rep["hint"]
    check_bisection(rep)
    assert exit_code(err.bundle_path) == 0


# ---------------------------------------------------------------------------------------------
# (b) a NaN in one input sample


def test_nan_in_one_input_sample(tmp_path):
    def make(s):
        x, y = R.batch(s)
        if s == K:
            x[2, 1] = float("nan")
        return x, y

    err, _, _ = record("make_mlp", single(make), tmp_path)
    assert err.event["phase"] == "input"
    rep = replay(err.bundle_path)
    check_step(rep, K, err.event)
    assert rep["cause"] == "input" and rep["reproduced"] is True
    check(rep, phase="input", tensor="batch", samples=[2], micro_batch=0, made="nan")
    assert "data" in rep["hint"]
    assert exit_code(err.bundle_path) == 0


def train_and_validate(out_dir: Path, spoil, steps: int = 4):
    """``make_mlp`` trained with SGD, three validation batches (eval mode, no_grad) after each
    step; ``spoil(step, i, x, y)`` may plant a bug in batch i after step ``step``. Returns the
    NonFiniteError, the recorder and the validation losses computed."""
    model, crit = R.make_mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="replay_models:make_mlp") as rec:
            for step in range(steps):
                x, y = R.batch(step)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
                model.eval()
                with torch.no_grad():
                    for i in range(3):
                        vx, vy = R.batch(100 + 10 * step + i)
                        spoil(step, i, vx, vy)
                        losses.append(crit(model(vx), vy))
                model.train()
    return info.value, rec, losses


def test_nan_in_a_validation_batch(tmp_path):
    """Validation between steps (eval mode, no_grad) with a NaN in one sample: caught when that
    forward returns, replayed as bad input with the sample named, gradients off."""

    def spoil(step, i, x, y):
        if (step, i) == (2, 1):
            x[5, 0] = float("nan")

    err, _, _ = train_and_validate(tmp_path, spoil)
    assert err.event["evaluation"] is True and err.event["step"] == 3
    rep = replay(err.bundle_path)
    check_step(rep, 3, err.event)
    assert rep["cause"] == "input" and rep["reproduced"] is True
    check(rep, phase="input", tensor="batch", samples=[5], micro_batch=0, made="nan")
    assert exit_code(err.bundle_path) == 0
    res = CliRunner().invoke(cli, [str(err.bundle_path)])
    assert res.output.startswith("nanreplay: evaluation forward before step 3, input event"), \
        res.output


def test_nan_loss_of_an_all_padding_validation_batch(tmp_path):
    """A validation batch whose targets are all ``ignore_index`` (padding): finite outputs, and
    cross entropy's mean over no target is 0/0. The loss is checked when it is computed: a loss
    event of that evaluation forward, raised in the loss call, replayed to the op."""

    def spoil(step, i, x, y):
        if (step, i) == (1, 2):
            y[:] = nn.CrossEntropyLoss().ignore_index

    err, rec, losses = train_and_validate(tmp_path, spoil)
    assert len(losses) == 5 and rec.step == 2  # raised in the sixth batch's loss call
    check_event(err.event, step=2, phase="loss", module="<loss>", evaluation=True, kind="nan")
    rep = replay(err.bundle_path)
    check_step(rep, 2, err.event)
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    check(rep, phase="loss", module="<loss>", micro_batch=0, op="aten.nll_loss_forward",
          made="nan")
    assert exit_code(err.bundle_path) == 0


def test_nan_in_a_loaded_weight(tmp_path):
    """Training resumes from a checkpoint holding a NaN weight: cause weights, named."""

    def at(step, opt):
        if step == 0:
            with torch.no_grad():
                opt.param_groups[0]["params"][2][1, 3] = float("nan")  # "2.weight"

    err, _, _ = record("make_mlp", single(R.batch), tmp_path, at=at)
    assert err.event["phase"] == "weights"
    rep = replay(err.bundle_path)
    check_step(rep, 0, err.event)
    assert rep["cause"] == "weights" and rep["reproduced"] is True
    check(rep, phase="weights", params=["2.weight"], param="2.weight")
    assert "checkpoint" in rep["hint"]
    assert exit_code(err.bundle_path) == 0


def test_recorded_factory_only_trusted_from_its_directory(tmp_path, monkeypatch):
    err, _, _ = record("make_log_net", single(scaled_row(5, 100.0)), tmp_path / "b")
    monkeypatch.chdir(tmp_path)  # replay_models.py is not under this directory
    rep = replay(err.bundle_path)
    check_step(rep, K, err.event)
    assert rep["reproduced"] is False and rep["cause"] is None  # nothing re-run: no guess
    assert rep["origin"]["module"] == "act" and "unknown" in rep["hint"]
    assert any("replay_models:make_log_net" in p for p in rep["problems"]), rep["problems"]
    assert exit_code(err.bundle_path) == 1
    rep = replay(err.bundle_path, factory="replay_models:make_log_net")  # trusted explicitly
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    check(rep, phase="forward", module="act", call=0, op="aten.log", samples=[5])
    check_source(rep["origin"]["source"], source_of(R.ShiftedLog, "torch.log"))


def test_loss_log_of_zero_probability(tmp_path):
    """The model output is finite, the loss is not: phase loss, the op and line in the loss,
    the rows whose own loss is infinite (re-run with reduction='none')."""
    err, _, _ = record("make_mlp_naive_nll", single(scaled_row(2, 1000.0)), tmp_path)
    assert err.event["phase"] == "loss" and err.event["step"] == K
    rep = replay(err.bundle_path)
    check_step(rep, K, err.event)
    # the target's probability, exp(-286) or so, is 0 in float32 but not in float64
    assert rep["reproduced"] is True and rep["cause"] == "underflow"
    check(rep, phase="loss", module="<loss>", micro_batch=0, op="aten.log", made="-inf",
          samples=[2])
    check_source(rep["origin"]["source"], source_of(R.NaiveNLL, "torch.log"))
    assert ops(rep["origin"]["chain"]) == [("aten.log", "-inf")]
    assert "log_softmax" in rep["hint"], rep["hint"]
    assert exit_code(err.bundle_path) == 0


# ---------------------------------------------------------------------------------------------
# (c) backward only: sqrt at 0


def test_backward_only_sqrt_at_zero(tmp_path):
    def make(s):
        x, y = R.batch(s)
        if s == K:
            x[6] = 0.0  # an all-zero row: its hidden features are 0, their length sqrt(0)
        return x, y

    err, _, _ = record("make_length_net", single(make), tmp_path)
    assert err.event["phase"] == "backward"
    rep = replay(err.bundle_path)
    check_step(rep, K, err.event)
    assert rep["reproduced"] is True
    check(rep, phase="backward", module="feat", op="SqrtBackward0", made="+inf")
    check_source(rep["origin"]["source"], source_of(R.WithLength, "torch.sqrt"))
    assert "lin.weight" in rep["origin"]["params"]
    # anomaly mode only sees the NaN one node later (0 * inf in the square's backward)
    assert rep["origin"]["anomaly_node"] != "SqrtBackward0"
    assert rep["cause"] == "invalid"
    assert exit_code(err.bundle_path) == 0


# ---------------------------------------------------------------------------------------------
# (d) the optimizer turning finite gradients into NaN weights


def nan_lr_at(k: int):
    """A broken schedule: the learning rate becomes NaN at step ``k``."""

    def at(step, opt):
        if step == k:
            for g in opt.param_groups:
                g["lr"] = float("nan")

    return at


MLP_PARAMS = ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_optimizer_nan_lr_default_mode(tmp_path):
    err, _, _ = record("make_mlp", single(R.batch), tmp_path, at=nan_lr_at(K))
    assert err.event["phase"] == "optimizer" and err.event["step"] == K
    rep = replay(err.bundle_path)
    check_step(rep, K, err.event)
    # the bundle holds the weights after the bad update: named, but the update is not re-run
    assert rep["cause"] == "optimizer" and rep["reproduced"] is False
    check(rep, phase="optimizer", params=MLP_PARAMS, param="0.weight")
    assert any("guard_optimizer" in p for p in rep["problems"])
    assert exit_code(err.bundle_path) == 1


def test_optimizer_nan_lr_guarded(tmp_path):
    err, _, _ = record("make_mlp", single(R.batch), tmp_path, at=nan_lr_at(K),
                       guard_optimizer=True)
    assert err.event["phase"] == "optimizer" and err.event["step"] == K
    rep = replay(err.bundle_path)
    check_step(rep, K, err.event)
    assert rep["cause"] == "optimizer" and rep["reproduced"] is True
    check(rep, phase="optimizer", params=MLP_PARAMS, param="0.weight")
    assert rep["origin"]["op"] == "aten.add_", rep["origin"]  # SGD's per-tensor loop on CPU
    # torch.optim.SGD's own code made it: no line of the user's (nor the replay's caller's)
    assert rep["origin"]["source"] is None, rep["origin"]
    assert exit_code(err.bundle_path) == 0


def gate_off_at(k: int):
    """The side branch is gated off (gate 0) at step ``k``: its gradient is exactly zero."""

    def batches(step):
        x, y = R.batch(step)
        gate = torch.tensor(0.0 if step == k else 1.0)
        return [((x, gate), {}, y)]

    return batches


def test_custom_optimizer_default_mode(tmp_path):
    err, _, _ = record("make_dead_unit_net", gate_off_at(K), tmp_path)
    assert err.event["phase"] == "optimizer"
    rep = replay(err.bundle_path)
    check_step(rep, K, err.event)
    assert rep["cause"] == "optimizer" and rep["reproduced"] is False
    check(rep, phase="optimizer", params=["side.weight", "side.bias"], param="side.weight")


def test_custom_optimizer_guarded(tmp_path):
    err, _, _ = record("make_dead_unit_net", gate_off_at(K), tmp_path, guard_optimizer=True)
    assert err.event["phase"] == "optimizer" and err.event["step"] == K
    rep = replay(err.bundle_path)
    check_step(rep, K, err.event)
    assert rep["cause"] == "optimizer" and rep["reproduced"] is True
    check(rep, phase="optimizer", params=["side.weight", "side.bias"], param="side.weight",
          op="aten.div")
    check_source(rep["origin"]["source"], source_of(R.NormalizedSGD, "p.grad.norm()"))


# ---------------------------------------------------------------------------------------------
# (e) float16 overflow in one layer


def big_row(row: int, value: float, step: int = K):
    def make(s):
        x, y = R.batch(s)
        if s == step:
            x[row] = value  # finite in float16 (max 65504); the layer's output is not
        return x, y

    return make


def test_float16_layer_overflow(tmp_path):
    err, _, _ = record("make_fp16_net", single(big_row(4, 6e4)), tmp_path)
    assert err.event["phase"] == "forward"
    rep = replay(err.bundle_path)
    check_step(rep, K, err.event)
    assert rep["reproduced"] is True and rep["cause"] == "overflow"
    check(rep, phase="forward", module="half_lin", call=0, op="aten.addmm", made="+inf",
          samples=[4])
    check_source(rep["origin"]["source"], source_of(R.Fp16Net.forward, "self.half_lin("))
    assert rep["origin"]["input_range"][1] == 6e4
    check_bisection(rep)


def test_autocast_float16_overflow(tmp_path):
    err, _, _ = record("make_amp_net", single(big_row(5, 6e4)), tmp_path,
                       autocast=torch.float16)
    assert err.event["phase"] == "forward" and err.event["module"] == "lin"
    rep = replay(err.bundle_path)
    check_step(rep, K, err.event)
    assert rep["reproduced"] is True and rep["cause"] == "overflow"
    check(rep, phase="forward", module="lin", call=0, op="aten.addmm", samples=[5])
    check_source(rep["origin"]["source"], source_of(R.AmpNet.forward, "self.lin(x)"))
    check_bisection(rep)


# ---------------------------------------------------------------------------------------------
# (f) a NaN that depends on the dropout draw


def test_dropout_dependent_nan_is_reproduced(tmp_path):
    err, _, _ = record("make_dropout_net", single(R.batch), tmp_path, steps=30)
    fired = bare_first_nan_step("make_dropout_net", single(R.batch), 30)
    assert err.event["phase"] == "forward" and err.event["module"] == "ent"
    rep = replay(err.bundle_path)
    check_step(rep, fired, err.event)
    assert rep["reproduced"] is True  # the RNG state was restored: same dropout mask
    check(rep, phase="forward", module="ent", call=0, op="aten.log", made="-inf")
    # the same rows as in training: the ones where dropout zeroed an element
    assert rep["origin"]["samples"] == err.event["samples"] != []
    assert len(rep["origin"]["samples"]) < R.BATCH
    assert ops(rep["origin"]["chain"]) == [("aten.log", "-inf"), ("aten.mul", "nan")]
    check_source(rep["origin"]["source"], source_of(R.XLogX, "torch.log"))
    assert rep["cause"] == "invalid"
    check_bisection(rep)


# ---------------------------------------------------------------------------------------------
# (g) a module called three times per forward, NaN on the third call


def test_shared_module_nan_on_call_2(tmp_path):
    err, _, _ = record("make_shared_net", single(scaled_row(1, 100.0)), tmp_path)
    assert err.event["call"] == 2
    rep = replay(err.bundle_path)
    check_step(rep, K, err.event)
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    check(rep, phase="forward", module="act", call=2, op="aten.log", samples=[1])
    check_source(rep["origin"]["source"], source_of(R.ShiftedLog, "torch.log"))
    check_bisection(rep)


# ---------------------------------------------------------------------------------------------
# (h) functional code in a parent's own forward


def test_nan_in_parents_own_code(tmp_path):
    err, _, _ = record("make_parent_net", single(scaled_row(1, 100.0)), tmp_path)
    rep = replay(err.bundle_path)
    check_step(rep, K, err.event)
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    # the block made it (its child "inner" returned finite values, "out" only passed it on)
    check(rep, phase="forward", module="block", call=0, op="aten.log", samples=[1])
    check_source(rep["origin"]["source"], source_of(R.Block, "torch.log"))
    check_bisection(rep)


def test_nan_in_roots_own_code(tmp_path):
    err, _, _ = record("make_root_net", single(scaled_row(1, 100.0)), tmp_path)
    rep = replay(err.bundle_path)
    check_step(rep, K, err.event)
    assert rep["reproduced"] is True
    check(rep, phase="forward", module="", call=0, op="aten.log", samples=[1])
    check_source(rep["origin"]["source"], source_of(R.RootNet, "torch.log"))
    check_bisection(rep)


@pytest.mark.parametrize("factory, module", [("make_root_log_features", ""),
                                             ("make_log_features_net", "feat")])
def test_an_infinity_of_a_modules_own_code_turned_into_nan_by_its_child(tmp_path, factory,
                                                                          module):
    """log(0) = -inf in a module's own forward, between its children's calls (the root's, or
    a submodule's), spread as +-inf by ``lin`` and summed to NaN by ``head``: no child made the
    infinity, so the chain starts in that module's code. It is the origin with its aten.log
    (head's addmm, which only met the infinities, is second)."""

    def make(s):
        x, y = R.batch(s)
        if s == K:
            x[5, 1] = 0.0
        return x, y

    err, _, _ = record(factory, single(make), tmp_path)
    check_event(err.event, step=K, phase="forward", module=module, call=0, inputs_finite=True,
                kind="nan", samples=[5])
    rep = replay(err.bundle_path)
    check_step(rep, K, err.event)
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    check(rep, phase="forward", module=module, call=0, op="aten.log", made="-inf",
          inputs_finite=True, samples=[5])
    check_source(rep["origin"]["source"], source_of(R.RootLogFeatures, "torch.log"))
    assert ops(rep["origin"]["chain"]) == [("aten.log", "-inf"), ("aten.addmm", "nan")]
    assert "aten.log of 0" in rep["hint"], rep["hint"]
    check_bisection(rep)
    assert exit_code(err.bundle_path) == 0


def test_an_infinity_of_roots_own_code_before_multihead_attention(tmp_path):
    """A stuck sensor scaled by its range in the root's forward, ``x / 0 = +inf``, then a
    sequence-first nn.MultiheadAttention with a key padding mask (its masked_fill makes an
    intended -inf) turns it into NaN. The recorder names the root, whose inputs were finite,
    not attn, whose inputs held the infinity; the replay names the division, sample 5."""

    def batches(step):
        x, pad, y = R.sensor_batch(step, stuck=5)
        return [((x, pad), {}, y)]

    err, _, _ = record("make_range_scaled_attention", batches, tmp_path, lr=0.01)
    check_event(err.event, step=K, phase="forward", module="", call=0, inputs_finite=True,
                kind="nan", samples=[5])
    meta, t = read_bundle(err.bundle_path)
    names = [m["name"] for m in meta["modules"]]
    row = t["ring/steps"].tolist().index(K)
    at = t["ring/call_module"][row].tolist().index(names.index("attn"))
    fields = meta["ring"]["call_fields"]
    # attn's inputs held +-inf (inp's output): not finite, though +-Inf there is no event
    assert t["ring/calls"][row, at, fields.index("inputs_finite")] == 0.0
    rep = replay(err.bundle_path)
    check_step(rep, K, err.event)
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    check(rep, phase="forward", module="", call=0, op="aten.div", made="+inf",
          inputs_finite=True, samples=[5])
    check_source(rep["origin"]["source"], source_of(R.RangeScaledAttention, "x.amax"))
    chain = rep["origin"]["chain"]
    assert chain[0]["op"] == "aten.div" and chain[-1]["made"] == "nan", chain
    assert not any(c["intentional"] for c in chain), chain  # not the padding's masked_fill
    assert "aten.div by 0" in rep["hint"], rep["hint"]
    check_bisection(rep)
    assert exit_code(err.bundle_path) == 0


def test_samples_of_an_origin_in_roots_own_code_that_returns_the_loss(tmp_path):
    """A model that returns its own loss (0-d): the relative error divides by a target of 0 in
    sample 5. The model output names no sample, so the origin's samples are those of the
    division's output, the op the root's own code ran."""
    torch.manual_seed(0)
    model = R.make_relative_error_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=tmp_path,
                            factory="replay_models:make_relative_error_net"):
            for step in range(6):
                x, _ = R.batch(step)
                target = x.sum(1) + 3.0
                if step == K:
                    target[5] = 0.0
                opt.zero_grad()
                model(x, target).backward()
                opt.step()
    err = info.value
    check_event(err.event, step=K, phase="forward", module="", call=0, inputs_finite=True)
    rep = replay(err.bundle_path)
    check_step(rep, K, err.event)
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    check(rep, phase="forward", module="", call=0, op="aten.div", samples=[5])
    check_source(rep["origin"]["source"], source_of(R.RelativeErrorNet, "target.abs()"))
    assert rep["origin"]["batch_size"] == 8
    check_bisection(rep)


# ---------------------------------------------------------------------------------------------
# (i) dict, tuple and keyword batches


def test_dict_batch_input_path(tmp_path):
    def batches(step):
        x, y = R.batch(step)
        extra = torch.ones_like(x)
        if step == K:
            x[3, 0] = float("inf")
        return [(({"image": x, "extra": extra},), {}, y)]

    err, _, _ = record("make_dict_net", batches, tmp_path)
    rep = replay(err.bundle_path)
    check_step(rep, K, err.event)
    assert rep["cause"] == "input" and rep["reproduced"] is True
    check(rep, phase="input", tensor='batch["image"]', samples=[3], made="+inf")


def test_tuple_batch_input_path(tmp_path):
    def batches(step):
        x, y = R.batch(step)
        extra = torch.ones_like(x)
        if step == K:
            extra[0, 2] = float("nan")
            extra[6, 1] = float("-inf")
        return [(((x, extra),), {}, y)]

    err, _, _ = record("make_tuple_net", batches, tmp_path)
    rep = replay(err.bundle_path)
    check_step(rep, K, err.event)
    assert rep["cause"] == "input"
    assert rep["reproduced"] is True
    check(rep, phase="input", tensor="batch[1]", samples=[0, 6], made="nan")


def test_keyword_input_path(tmp_path):
    def batches(step):
        x, y = R.batch(step)
        scale = torch.ones(R.BATCH, 1)
        if step == K:
            scale[4] = float("nan")
        return [((x,), {"scale": scale}, y)]

    err, _, _ = record("make_kwarg_net", batches, tmp_path)
    rep = replay(err.bundle_path)
    check_step(rep, K, err.event)
    assert rep["cause"] == "input"
    assert rep["reproduced"] is True
    check(rep, phase="input", tensor='kwargs["scale"]', samples=[4], made="nan")


def test_keyword_batch_forward_origin(tmp_path):
    """A finite keyword argument that makes the forward NaN: the replay must pass it again."""

    def batches(step):
        x, y = R.batch(step)
        scale = torch.ones(R.BATCH, 1)
        if step == K:
            scale[7] = 100.0
        return [((x,), {"scale": scale}, y)]

    err, _, _ = record("make_kwarg_net", batches, tmp_path)
    rep = replay(err.bundle_path)
    check_step(rep, K, err.event)
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    check(rep, phase="forward", module="act", call=0, op="aten.log", samples=[7])
    check_bisection(rep)


# ---------------------------------------------------------------------------------------------
# (j) gradient accumulation, NaN in micro-batch 2


def test_grad_accumulation_micro_batch_2(tmp_path):
    def batches(step):
        mbs = []
        for i in range(3):
            x, y = R.batch(10 * step + i)
            if step == K and i == 2:
                x[3] *= 100.0
            mbs.append(((x,), {}, y))
        return mbs

    err, _, _ = record("make_log_net", batches, tmp_path)
    assert err.event["micro_batch"] == 2
    rep = replay(err.bundle_path)
    check_step(rep, K, err.event)
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    check(rep, phase="forward", module="act", call=0, micro_batch=2, op="aten.log",
          samples=[3])
    check_source(rep["origin"]["source"], source_of(R.ShiftedLog, "torch.log"))
    check_bisection(rep)


# ---------------------------------------------------------------------------------------------
# (k) the -inf mask of a causal transformer leaves a fully masked row: softmax makes NaN


def test_fully_masked_row_softmax(tmp_path):
    def batches(step):
        idx, pad, y = R.token_batch(step)
        if step == K:
            pad[2, :2] = True  # left padding: query 0 of row 2 sees only a padding key
        return [((idx, pad), {}, y)]

    err, _, _ = record("make_tiny_gpt", batches, tmp_path, lr=0.01)
    rep = replay(err.bundle_path)
    check_step(rep, K, err.event)
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    check(rep, phase="forward", module="blocks.0.attn", call=0, samples=[2])
    assert rep["origin"]["op"] == "aten._softmax"  # what torch.softmax runs on CPU (pinned)
    check_source(rep["origin"]["source"], source_of(R.Attention, "torch.softmax"))
    chain = rep["origin"]["chain"]
    assert [c["op"] for c in chain] == ["aten.masked_fill", rep["origin"]["op"]], chain
    assert chain[0]["made"] == "-inf" and chain[0]["intentional"] is True
    check_source(chain[0]["source"], source_of(R.Attention, "masked_fill"))
    assert chain[1]["made"] == "nan" and chain[1]["intentional"] is False
    check_bisection(rep)


def test_allowed_inf_module_does_not_hide_softmax(tmp_path):
    """The mask comes from a module allowed to hold -inf, and an ``nn.Softmax`` module takes
    it: the -inf it receives is intentional, so the softmax module made the NaN, and the op
    that turned the infinities into NaN is still named."""

    def batches(step):
        idx, pad, y = R.token_batch(step)
        if step == K:
            pad[1, :3] = True
        return [((idx, pad), {}, y)]

    err, _, _ = record("make_tiny_gpt_modules", batches, tmp_path, lr=0.01,
                       allow_inf=["*.mask"])
    assert err.event["step"] == K and err.event["module"] == "blocks.0.attn.softmax"
    rep = replay(err.bundle_path)
    check_step(rep, K, err.event)
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    check(rep, phase="forward", module="blocks.0.attn.softmax", call=0, samples=[1])
    assert rep["origin"]["op"] == "aten._softmax"  # what torch.softmax runs on CPU (pinned)
    check_source(rep["origin"]["source"], source_of(R.Attention, "self.softmax(self.mask"))
    chain = rep["origin"]["chain"]
    assert (chain[-1]["op"], chain[-1]["made"]) == (rep["origin"]["op"], "nan"), chain
    assert all(c["intentional"] for c in chain[:-1]), chain
    check_bisection(rep)


# ---------------------------------------------------------------------------------------------
# (l) an LR spike three steps before an overflow


def test_lr_spike_precursor(tmp_path):
    def at(step, opt):
        for g in opt.param_groups:
            g["lr"] = 5.0 if step == K else 0.05  # a one-step spike (a schedule bug)

    err, _, _ = record("make_fp16_net", single(big_row(4, 6e4, step=K + 3)), tmp_path,
                       steps=K + 6, at=at)
    assert err.event["step"] == K + 3
    rep = replay(err.bundle_path)
    check_step(rep, K + 3, err.event)
    assert rep["cause"] == "overflow" and rep["reproduced"] is True
    check(rep, phase="forward", module="half_lin", call=0, op="aten.addmm", samples=[4])
    lr_jumps = [p for p in rep["precursors"] if p["kind"] == "lr_jump"]
    assert [p["step"] for p in lr_jumps] == [K], rep["precursors"]
    assert all(set(p) == {"step", "kind", "detail"} for p in rep["precursors"])
    assert all(p["step"] <= K + 3 for p in rep["precursors"])


# ---------------------------------------------------------------------------------------------
# (m) exp overflows to +inf, then inf - inf makes NaN


def test_exp_overflow_then_inf_minus_inf(tmp_path):
    err, _, _ = record("make_exp_net", single(scaled_row(1, 100.0)), tmp_path)
    rep = replay(err.bundle_path)
    check_step(rep, K, err.event)
    assert rep["reproduced"] is True and rep["cause"] == "overflow"
    check(rep, phase="forward", module="expc", call=0, op="aten.exp", samples=[1])
    chain = rep["origin"]["chain"]
    assert ops(chain) == [("aten.exp", "+inf"), ("aten.sub", "nan")], chain
    check_source(chain[0]["source"], source_of(R.ExpCentered, "torch.exp"))
    check_source(chain[1]["source"], source_of(R.ExpCentered, "e - e.mean"))
    check_bisection(rep)


# ---------------------------------------------------------------------------------------------
# (o) activation checkpointing: the forward's calls run again inside backward


CHECKPOINTED = ["make_checkpointed_net", "make_reentrant_checkpointed_net"]


@pytest.mark.parametrize("factory", CHECKPOINTED)
def test_checkpointed_blocks_forward_nan(tmp_path, factory):
    """A NaN in a checkpointed block's forward is the forward call's (call 0), not one of the
    calls that recompute it in backward; the replay, whose backward recomputes too, names the
    same call and op, with the forward's dropout draw."""
    err, _, _ = record(factory, single(scaled_row(5, 100.0)), tmp_path, steps=8)
    check_event(err.event, step=K, phase="forward", module="mix.2", call=0, samples=[5])
    rep = replay(err.bundle_path)
    check_step(rep, K, err.event)
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    check(rep, phase="forward", module="mix.2", call=0, op="aten.log", samples=[5])
    check_bisection(rep)


@pytest.mark.parametrize("factory", CHECKPOINTED)
def test_checkpointed_blocks_backward_nan(tmp_path, factory):
    """sqrt at 0 inside a checkpointed block: forward finite, backward (through the
    recomputed activations) NaN. A backward event naming the block's parameters; the replay
    finds SqrtBackward0 in ``feat.1``."""
    def make(s):
        x, y = R.batch(s)
        if s == K:
            x[6] = 0.0
        return x, y

    err, _, _ = record(factory, single(make), tmp_path, steps=8)
    check_event(err.event, step=K, phase="backward")
    assert {"inp.weight", "feat.0.weight"} <= set(err.event["params"])
    rep = replay(err.bundle_path)
    check_step(rep, K, err.event)
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    check(rep, phase="backward", module="feat.1", op="SqrtBackward0")
    assert rep["origin"]["made"] in ("+inf", "-inf")  # 1 / (2 sqrt(0)) times the incoming sign
    check_source(rep["origin"]["source"], source_of(R.WithLength, "torch.sqrt"))


# ---------------------------------------------------------------------------------------------
# (p) the model's own code raises on the NaN


def test_a_model_raising_on_its_own_nan(tmp_path):
    """``SamplingNet``'s ``multinomial`` raises on the NaN that ``act`` made at step K: the loop
    gets that RuntimeError (with the recorder's summary as a note, and the bundle written when
    the ``with`` block saw it go); the replay's re-runs end at the same raise and still name
    the op, module and sample, saying the model raised."""
    model, crit = R.make_sampling_net(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(RuntimeError, match="probability tensor contains") as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="replay_models:make_sampling_net"):
            for step in range(6):
                x, y = scaled_row(5, 100.0)(step)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    [bundle] = tmp_path.glob("*.nan")
    assert bundle.name == f"step{K:08d}-rank0.nan"
    if hasattr(info.value, "add_note"):  # Python 3.11+ (3.10: the summary is logged)
        [note] = info.value.__notes__
        assert f"at step {K}, phase forward" in note and "'act'" in note and str(bundle) in note
    rep = replay(bundle)
    check_step(rep, K)
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    check(rep, phase="forward", module="act", call=0, op="aten.log", samples=[5])
    assert any("raised RuntimeError: probability tensor" in p for p in rep["problems"]), \
        rep["problems"]
    check_bisection(rep)
    assert exit_code(bundle) == 0


# ---------------------------------------------------------------------------------------------
# (n) not reproducible


def test_not_reproduced_when_the_nan_does_not_come_back(tmp_path):
    R.CALLS.update(n=0, fire_at=K + 1, every=0)  # the 4th forward of the process: step 3
    err, _, _ = record("make_counted_net", single(R.batch), tmp_path)
    assert err.event["step"] == K and err.event["module"] == "flaky"
    rep = replay(err.bundle_path)
    check_step(rep, K, err.event)
    assert rep["reproduced"] is False and rep["cause"] == "not_reproduced"
    assert rep["hint"] and rep["problems"]
    assert exit_code(err.bundle_path) == 1


def test_not_reproduced_when_reruns_disagree(tmp_path):
    R.CALLS.update(n=0, fire_at=K + 1, every=2)  # from step 3 on, every other forward
    err, _, _ = record("make_counted_net", single(R.batch), tmp_path)
    assert err.event["step"] == K
    rep = replay(err.bundle_path)
    check_step(rep, K, err.event)
    assert rep["reproduced"] is False and rep["cause"] == "not_reproduced"
    assert any("disagree" in p for p in rep["problems"]), rep["problems"]


# ---------------------------------------------------------------------------------------------
# (q) a convolutional net in channels-last memory format


def test_a_channels_last_conv_net_names_the_division_and_the_blank_image(tmp_path):
    """Channels-last activations are not contiguous: the recorder takes their min and max with
    two reductions on CPU (``recorder.slots.split_extrema``), and the NaN a blank image makes
    is still the first event, in the module that made it, on that image."""
    net = R.make_channels_last_conv_net()
    x, _ = R.image_batch(0)
    feature_map = net.conv(x)
    assert not feature_map.is_contiguous() and feature_map.numel() >= 4096
    err, model, _ = record("make_channels_last_conv_net",
                           single(lambda s: R.image_batch(s, blank=5, at=K)), tmp_path)
    assert model.conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert (err.event["step"], err.event["phase"], err.event["module"], err.event["kind"]) == \
        (K, "forward", "norm", "nan")
    assert err.event["inputs_finite"] is True and err.event["samples"] == [5]
    rep = replay(err.bundle_path)
    check_step(rep, K, err.event)
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    check(rep, phase="forward", module="norm", call=0, op="aten.div", made="nan",
          inputs_finite=True, samples=[5])
    check_source(rep["origin"]["source"], source_of(R.ImageStandardize, "BUG"))
    check_bisection(rep)


# ---------------------------------------------------------------------------------------------
# (r) a batch-first model passed a square mask: the batch size is not the sequence length


def test_a_square_mask_passed_to_forward_does_not_make_the_sequence_length_the_batch(tmp_path):
    """Eight series of 12 steps and a (12, 12) causal mask: the batch is 8, and the series with
    a missing reading is sample 3 (the mask once made 12 the batch size and named none)."""
    torch.manual_seed(0)
    model = R.make_forecaster()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = nn.MSELoss()
    mask = nn.Transformer.generate_square_subsequent_mask(12)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="replay_models:make_forecaster"):
            for step in range(6):
                past, fut_in, fut = R.series_batch(step, bad=3, at=K)
                opt.zero_grad()
                crit(model(past, fut_in, mask), fut).backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"], err.event["samples"]) == (K, "input", [3])
    assert err.event["tensor"] == "args[0]"
    rep = replay(err.bundle_path)
    check_step(rep, K, err.event)
    assert rep["cause"] == "input"
    assert rep["origin"]["samples"] == [3] and rep["origin"]["batch_size"] == 8


def test_dropping_a_sample_when_the_loss_takes_a_reshape_of_the_output(tmp_path):
    """The loop's loss takes ``out.reshape(-1, C)``, a view of the model output: ``--try
    drop=5`` re-runs with 7 rows and gives the loss the same reshape of them (it overran the
    recorded 8-row view and raised)."""

    def make(s):
        x, y = R.batch(s)
        if s == K:
            x[5] = math.nan
        return x, y

    err, _, _ = record("make_mlp", single(make), tmp_path)
    rep = replay(err.bundle_path, tries=["drop=5", "drop=2"])
    assert rep["cause"] == "input" and rep["origin"]["samples"] == [5]
    tries = {t["try"]: t for t in rep["what_if"]}
    assert (tries["drop=5"]["finite"], tries["drop=5"]["event_step"]) == (True, None)
    assert (tries["drop=2"]["finite"], tries["drop=2"]["event_step"]) == (False, K)

"""The rest of ``torch.optim`` as training scripts use it: Adamax, NAdam and RAdam (also with
``decoupled_weight_decay=True``), Adadelta, Adagrad with ``lr_decay``, Rprop, ASGD, Nesterov
SGD, under ChainedScheduler, CosineAnnealingWarmRestarts, SequentialLR, CyclicLR (cycling
SGD's momentum and Adam's beta1) and OneCycleLR. Each trains a bag-of-tokens classifier over a
DataLoader: healthy, recorded without changing a loss; with eps=0 over the embedding rows of
tokens the data never holds; with a rate beyond float32; and in a rewind window whose re-run
takes the scheduler's rates and momenta step by step."""

from __future__ import annotations

import contextlib
import inspect
import math
import re

import optimizer_breadth_models as OB
import pytest
import torch
import zf_models as ZF
from bundles import invoke_cli, nanreplay_json, one_error_line
from torch import nn

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

S = torch.optim.lr_scheduler
OPT = torch.optim
FACTORY = "optimizer_breadth_models:make_model"
# the rows of the embedding no batch looks up: their gradient is exactly 0 at every step
ABSENT = list(range(OB.SEEN, OB.VOCAB))


def _loop(make_opt, make_sched=None, *, record: dict | None = None, epochs: int = 2,
          corrupt: int | None = None):
    """Epochs over the DataLoader, the scheduler stepped per batch; with ``record`` the loop
    runs under ``FlightRecorder(**record)``. ``corrupt``: the step whose batch is given the
    id of a token the vocabulary lacks after the embedding, as a NaN feature (see below).
    Returns (losses, rates, momenta, error)."""
    model = OB.make_model()
    opt = make_opt(model)
    sched = make_sched(opt) if make_sched is not None else None
    crit = nn.CrossEntropyLoss()
    losses, lrs, moms = [], [], []
    ctx = (FlightRecorder(model, opt, loss_fn=crit, factory=FACTORY, lr_scheduler=sched,
                          **record) if record is not None else contextlib.nullcontext())
    try:
        with ctx:
            for _ in range(epochs):
                for ids, y in OB.loader():
                    g = opt.param_groups[0]
                    lrs.append(g["lr"])
                    moms.append(g.get("momentum", g.get("betas")))
                    opt.zero_grad()
                    loss = crit(model(ids), y)
                    loss.backward()
                    opt.step()
                    if sched is not None:
                        sched.step()
                    losses.append(loss.item())
    except NonFiniteError as e:
        return losses, lrs, moms, e
    return losses, lrs, moms, None


HEALTHY = {
    "adamax-chained": (lambda m: OPT.Adamax(m.parameters(), lr=2e-3),
                       lambda o: S.ChainedScheduler([S.ConstantLR(o, factor=0.5, total_iters=4),
                                                     S.ExponentialLR(o, gamma=0.95)])),
    "nadam-decoupled-sequential": (
        lambda m: OPT.NAdam(m.parameters(), lr=1e-2, weight_decay=1e-2,
                          decoupled_weight_decay=True),
        lambda o: S.SequentialLR(o, [S.LinearLR(o, start_factor=0.1, total_iters=4),
                                     S.CosineAnnealingLR(o, T_max=12)], milestones=[4])),
    "radam-decoupled-warm-restarts": (
        lambda m: OPT.RAdam(m.parameters(), lr=1e-2, weight_decay=1e-2,
                          decoupled_weight_decay=True),
        lambda o: S.CosineAnnealingWarmRestarts(o, T_0=3, T_mult=2, eta_min=1e-4)),
    "adadelta": (lambda m: OPT.Adadelta(m.parameters(), lr=1.0), None),
    "adagrad-lr-decay": (lambda m: OPT.Adagrad(m.parameters(), lr=5e-2, lr_decay=1e-2), None),
    "rprop": (lambda m: OPT.Rprop(m.parameters(), lr=1e-2), None),
    "asgd": (lambda m: OPT.ASGD(m.parameters(), lr=5e-2, t0=4), None),
    "nesterov-cyclic-momentum": (
        lambda m: OPT.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True),
        lambda o: S.CyclicLR(o, base_lr=0.01, max_lr=0.5, step_size_up=3, base_momentum=0.5,
                             max_momentum=0.95)),
    "adam-cyclic-beta1": (
        lambda m: OPT.Adam(m.parameters(), lr=1e-2),
        lambda o: S.CyclicLR(o, base_lr=1e-3, max_lr=5e-2, step_size_up=3, base_momentum=0.5,
                             max_momentum=0.95)),
    "adam-one-cycle": (lambda m: OPT.Adam(m.parameters(), lr=1e-2),
                       lambda o: S.OneCycleLR(o, max_lr=5e-2, total_steps=16)),
}


@pytest.mark.parametrize("name", list(HEALTHY))
def test_a_healthy_run_is_recorded_without_changing_a_loss(out_dir, name):
    """No event, and every loss bit-identical to the same loop without the recorder (the
    recorder reads the step, it never changes it: not the scheduler's rate, not the cycled
    momentum or beta1, not Rprop's or ASGD's own per-parameter state)."""
    plain, lrs, moms, err = _loop(*HEALTHY[name])
    assert err is None
    got, got_lrs, got_moms, err = _loop(*HEALTHY[name], record={"out_dir": out_dir})
    assert err is None and not list(out_dir.glob("*.nan"))
    assert got == plain and all(map(math.isfinite, plain))
    assert (got_lrs, got_moms) == (lrs, moms)


def _radam_first_rectified_step(beta2: float = 0.999) -> int:
    """RAdam's first update that divides by sqrt(v): the first step t (from 1) whose rho_t is
    above 5; before it the update is the bias-corrected momentum alone (finite at m = 0)."""
    rho_inf = 2 / (1 - beta2) - 1
    t = 1
    while rho_inf - 2 * t * beta2 ** t / (1 - beta2 ** t) <= 5:
        t += 1
    return t - 1  # (the recorder counts steps from 0)


EPS0 = {
    "adamax": (lambda m: OPT.Adamax(m.parameters(), lr=1e-2, eps=0.0), 0),
    "nadam": (lambda m: OPT.NAdam(m.parameters(), lr=1e-2, eps=0.0), 0),
    "nadam-decoupled": (lambda m: OPT.NAdam(m.parameters(), lr=1e-2, eps=0.0, weight_decay=1e-2,
                                          decoupled_weight_decay=True), 0),
    "radam": (lambda m: OPT.RAdam(m.parameters(), lr=1e-2, eps=0.0),
              _radam_first_rectified_step()),
    "radam-decoupled": (lambda m: OPT.RAdam(m.parameters(), lr=1e-2, eps=0.0, weight_decay=1e-2,
                                          decoupled_weight_decay=True),
                        _radam_first_rectified_step()),
    "adadelta": (lambda m: OPT.Adadelta(m.parameters(), lr=1.0, eps=0.0), 0),
    "adagrad-lr-decay": (lambda m: OPT.Adagrad(m.parameters(), lr=1e-2, eps=0.0, lr_decay=1e-3),
                         0),
}


# the division each optimizer makes 0/0, in its own terms: Adamax divides by an infinity norm
# (its hint said m / (sqrt(v) + eps), a v and a sqrt it does not have)
FORMULA = {"adamax": "exp_avg / max(beta2 * exp_inf, |grad| + eps) is 0/0",
           "adadelta": "sqrt(acc_delta + eps) / sqrt(square_avg + eps) * grad is 0/0",
           "adagrad": "grad / (sqrt(sum) + eps) is 0/0"}


@pytest.mark.parametrize("name", list(EPS0))
def test_eps_0_over_the_rows_of_absent_tokens(out_dir, name):
    """eps=0 and embedding rows of tokens no batch holds: their gradient is exactly 0, the
    optimizer's accumulators stay 0 there, and its division by them is 0/0 at the first update
    that divides (RAdam's first rectified step). Recorded with guard_optimizer: the update is
    re-run, eps=1e-8 makes it finite, a tenth of the rate does not."""
    make_opt, step = EPS0[name]
    *_, err = _loop(make_opt, record={"out_dir": out_dir, "guard_optimizer": True})
    assert (err.event["step"], err.event["phase"], err.event["params"]) == \
        (step, "optimizer", ["embed.weight"]), err.event
    rep = nanreplay_json(err.bundle_path, "--try", "eps=1e-8", "--try", "lr=0.1x")
    assert rep["reproduced"] and rep["cause"] == "optimizer", rep["cause"]
    assert rep["origin"]["param"] == "embed.weight"
    assert "with eps=0" in rep["hint"] and "set eps > 0" in rep["hint"], rep["hint"]
    assert f"row(s) {', '.join(map(str, ABSENT))} of {OB.VOCAB}" in rep["hint"], rep["hint"]
    formula = FORMULA.get(name.partition("-")[0], "m / (sqrt(v) + eps) is 0/0")
    assert formula in rep["hint"], rep["hint"]
    tries = {t["try"]: t for t in rep["what_if"]}
    assert (tries["eps=1e-8"]["finite"], tries["eps=1e-8"]["inconclusive"]) == (True, False)
    assert tries["lr=0.1x"]["finite"] is False
    assert tries["lr=0.1x"]["origin"]["params"] == ["embed.weight"], tries["lr=0.1x"]


@pytest.mark.parametrize("name", ["nadam-decoupled", "adagrad-lr-decay"])
def test_eps_0_after_the_update_names_eps_without_a_re_run(out_dir, name):
    """The same, recorded without guard_optimizer: the bundle holds the weights after the
    update; the hint still names eps=0 and the absent rows, and a try says it cannot re-run."""
    make_opt, step = EPS0[name]
    *_, err = _loop(make_opt, record={"out_dir": out_dir})
    assert (err.event["step"], err.event["phase"], err.event["params"]) == \
        (step, "optimizer", ["embed.weight"])
    rep = nanreplay_json(err.bundle_path, "--try", "eps=1e-8", code=1)
    assert rep["cause"] == "optimizer" and "with eps=0" in rep["hint"], rep["hint"]
    assert f"row(s) {', '.join(map(str, ABSENT))} of {OB.VOCAB}" in rep["hint"]
    assert rep["what_if"][0]["finite"] is None and "guard_optimizer=True" in \
        rep["what_if"][0]["note"]


def test_asgd_at_a_rate_beyond_float32_overflows_every_parameter(out_dir):
    """ASGD given lr=1e39 (its eta, a float32 tensor, is then inf): every element's update is
    -inf * g, or inf * 0 = NaN where the gradient is 0, so every parameter goes non-finite at
    the first update. The re-run's lr=0.01 is finite; clipping, which leaves the rate, is not."""
    *_, err = _loop(lambda m: OPT.ASGD(m.parameters(), lr=1e39),
                    record={"out_dir": out_dir, "guard_optimizer": True})
    names = [n for n, _ in OB.make_model().named_parameters()]
    assert (err.event["step"], err.event["phase"], err.event["params"]) == \
        (0, "optimizer", names)
    rep = nanreplay_json(err.bundle_path, "--try", "lr=0.01", "--try", "clip=1.0")
    assert rep["reproduced"] and rep["cause"] == "optimizer"
    assert rep["origin"]["param"] == names[0] and "ASGD's update at step 0" in rep["hint"]
    tries = {t["try"]: t for t in rep["what_if"]}
    assert (tries["lr=0.01"]["finite"], tries["lr=0.01"]["inconclusive"]) == (True, False)
    assert tries["clip=1.0"]["finite"] is False


def test_rprop_with_an_unbounded_step_size_re_runs_its_window(out_dir):
    """Rprop with step_sizes=(1e-6, inf) and etas=(0.5, 1e20): a step size that keeps its sign
    grows 1e20-fold per step until the forward overflows. The bundle's JSON spells the inf
    as 'inf'; the window's re-run gave it to Rprop's clamp_ as that string (TypeError: the
    replay failed with exit 2). The window now re-runs to the recorded event."""
    plain, *_ = _loop(lambda m: OPT.Rprop(m.parameters(), lr=1e-2, etas=(0.5, 1e20),
                                        step_sizes=(1e-6, math.inf)))
    step = next(i for i, v in enumerate(plain) if not math.isfinite(v))
    losses, *_, err = _loop(lambda m: OPT.Rprop(m.parameters(), lr=1e-2, etas=(0.5, 1e20),
                                              step_sizes=(1e-6, math.inf)),
                            record={"out_dir": out_dir, "rewind": 4})
    assert (err.event["step"], err.event["phase"]) == (step, "forward")
    rep = nanreplay_json(err.bundle_path, "--try", "dtype=float64")
    w = rep["window"]
    assert w["reproduced"] and w["event_step"] == err.event["step"], w
    assert [s["loss"] for s in w["per_step"][:-1]] == losses[w["steps"][0]:err.event["step"]]
    assert rep["what_if"][0].get("error") is None, rep["what_if"]


SCHEDULED = {
    "nesterov-chained": (lambda m: OPT.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True),
                         lambda o: S.ChainedScheduler([S.ConstantLR(o, factor=0.5, total_iters=4),
                                                       S.ExponentialLR(o, gamma=0.9)])),
    "adamw-warm-restarts": (lambda m: OPT.AdamW(m.parameters(), lr=1e-2),
                            lambda o: S.CosineAnnealingWarmRestarts(o, T_0=3, T_mult=2,
                                                                    eta_min=1e-4)),
    "nadam-sequential": (lambda m: OPT.NAdam(m.parameters(), lr=1e-2),
                         lambda o: S.SequentialLR(o, [S.LinearLR(o, start_factor=0.1,
                                                                 total_iters=4),
                                                      S.CosineAnnealingLR(o, T_max=20)],
                                                  milestones=[4])),
    "sgd-cyclic-momentum": (lambda m: OPT.SGD(m.parameters(), lr=0.1, momentum=0.9),
                            lambda o: S.CyclicLR(o, base_lr=0.01, max_lr=0.5, step_size_up=3,
                                                 base_momentum=0.5, max_momentum=0.95)),
    "adam-cyclic-beta1": (lambda m: OPT.Adam(m.parameters(), lr=1e-2),
                          lambda o: S.CyclicLR(o, base_lr=1e-3, max_lr=5e-2, step_size_up=3,
                                               base_momentum=0.5, max_momentum=0.95)),
    "adam-one-cycle": (lambda m: OPT.Adam(m.parameters(), lr=1e-2),
                       lambda o: S.OneCycleLR(o, max_lr=5e-2, total_steps=40,
                                              base_momentum=0.5, max_momentum=0.95)),
}
CORRUPT, REWIND = 10, 4


def _scheduled(make_opt, make_sched, record: dict | None = None):
    """zf_models' classifier over its DataLoader, the scheduler stepped per batch; the batch
    of step CORRUPT holds a record whose first feature is NaN (a corrupt row of the file).
    Returns (losses, rates, error)."""
    model = ZF.make_model()
    opt = make_opt(model)
    sched = make_sched(opt)
    crit = nn.CrossEntropyLoss()
    losses, lrs, step = [], [], 0
    ctx = (FlightRecorder(model, opt, loss_fn=crit, factory="zf_models:make_model",
                          lr_scheduler=sched, **record)
           if record is not None else contextlib.nullcontext())
    try:
        with ctx:
            for _ in range(2):
                for x, y in ZF.loader(batch_size=16):
                    if step == CORRUPT:
                        x = x.clone()
                        x[3, 0] = math.nan
                    lrs.append(opt.param_groups[0]["lr"])
                    opt.zero_grad()
                    loss = crit(model(x), y)
                    loss.backward()
                    opt.step()
                    sched.step()
                    losses.append(loss.item())
                    step += 1
    except NonFiniteError as e:
        return losses, lrs, e
    return losses, lrs, None


@pytest.mark.parametrize("name", list(SCHEDULED))
def test_a_rewind_window_re_runs_the_scheduler_s_rates_and_momenta(out_dir, name):
    """A corrupt record at step 10 under each scheduler, recorded with rewind=4: the window
    re-runs its steps from the copy to the event with the rate the scheduler set at each
    (and CyclicLR's / OneCycleLR's momentum or beta1: a re-run at the groups' last momentum
    would train other weights, and its losses would differ from the run's)."""
    plain, lrs, _ = _scheduled(*SCHEDULED[name])  # (the NaN only reaches step 10's loss)
    assert all(map(math.isfinite, plain[:CORRUPT])) and not math.isfinite(plain[CORRUPT])
    _, _, err = _scheduled(*SCHEDULED[name], record={"out_dir": out_dir, "rewind": REWIND})
    assert (err.event["step"], err.event["phase"]) == (CORRUPT, "input")
    rep = nanreplay_json(err.bundle_path)
    w = rep["window"]
    assert w["reproduced"] and w["event_step"] == CORRUPT
    first = w["steps"][0]
    assert w["steps"] == [first, CORRUPT] and CORRUPT - 2 * REWIND <= first <= CORRUPT - REWIND
    assert [s["step"] for s in w["per_step"]] == list(range(first, CORRUPT + 1))
    assert [s["lr"] for s in w["per_step"]] == lrs[first:CORRUPT + 1]
    assert [s["loss"] for s in w["per_step"][:-1]] == plain[first:CORRUPT]


F32_MAX = torch.finfo(torch.float32).max


def _line_loop(make_opt, steps: int, record: dict):
    """optimizer_breadth_models' line under L1 onto its far target, recorded; the error."""
    model = OB.make_line()
    opt = make_opt(model)
    crit = nn.L1Loss()
    x, y = OB.line_batch()
    try:
        with FlightRecorder(model, opt, loss_fn=crit, factory="optimizer_breadth_models:make_line",
                            **record):
            for _ in range(steps):
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    except NonFiniteError as e:
        return e
    return None


def _no_rate_or_clip_advice(hint: str) -> None:
    """Rprop's remedy names its own bounds (step_sizes, etas), not the rate nor clipping."""
    assert "step_sizes[1]" in hint and "etas[1]" in hint, hint
    assert "neither a lower lr nor clipping bounds the update" in hint, hint
    assert "lower the learning rate" not in hint and "clip gradients" not in hint, hint
    assert "lr=0.1x" not in hint and "clip=1.0" not in hint, hint


def test_rprop_s_growing_step_size_overflows_the_weights_in_its_update(out_dir):
    """Rprop's step size starts at lr and grows etas[1]-fold per update while the gradient
    keeps its sign (always, here), with no upper bound: the first update whose step size
    lr * etas[1] ** k is beyond float32 makes every weight +inf. The hint names step_sizes and
    etas (Rprop's lr is only the first step size; it takes the gradient's sign alone, so
    clipping changes nothing); --try auto proposes Rprop's default bounds, which make the
    update finite, and neither a rate nor clipping."""
    lr, eta = 1.0, 1e20
    at = next(k for k in range(10) if lr * eta ** k > F32_MAX)
    err = _line_loop(lambda m: OPT.Rprop(m.parameters(), lr=lr, etas=(0.5, eta),
                                         step_sizes=(1e-6, math.inf)),
                     at + 2, {"out_dir": out_dir, "guard_optimizer": True})
    names = [n for n, _ in OB.make_line().named_parameters()]
    assert (err.event["step"], err.event["phase"], err.event["params"]) == \
        (at, "optimizer", names), err.event
    rep = nanreplay_json(err.bundle_path, "--try", "auto")
    assert rep["reproduced"] and rep["cause"] == "optimizer"
    assert rep["origin"]["param"] == names[0]
    assert f"Rprop's update at step {at}" in rep["hint"], rep["hint"]
    _no_rate_or_clip_advice(rep["hint"])
    assert f"grows each element's step size {eta:g}x per update" in rep["hint"], rep["hint"]
    assert not re.search(r"\beps\b", rep["hint"]), rep["hint"]  # (Rprop has none)
    default = inspect.signature(OPT.Rprop).parameters
    lo_hi, etas = default["step_sizes"].default, default["etas"].default
    tries = {t["try"]: t for t in rep["what_if"]}
    bound = f"step_sizes={1e-6:g},{lo_hi[1]:g}"
    assert list(tries) == [bound, f"etas={0.5:g},{etas[1]:g}"], list(tries)
    assert f"--try {bound} and --try etas={0.5:g},{etas[1]:g} re-run the update" in rep["hint"]
    assert (tries[bound]["finite"], tries[bound]["inconclusive"]) == (True, False)


def test_rprop_s_growth_in_a_rewind_window_names_its_bounds(out_dir):
    """The forward overflow of Rprop's unbounded step size (etas=(0.5, 1e20),
    step_sizes=(1e-6, inf)), recorded with rewind=4: the growth hint's remedy is Rprop's
    maximum step size and growth factor, and auto's step_sizes try re-runs the window finite;
    no lr or clip try is proposed."""
    *_, err = _loop(lambda m: OPT.Rprop(m.parameters(), lr=1e-2, etas=(0.5, 1e20),
                                        step_sizes=(1e-6, math.inf)),
                    record={"out_dir": out_dir, "rewind": 4})
    assert err.event["phase"] == "forward"
    rep = nanreplay_json(err.bundle_path, "--try", "auto")
    assert rep["cause"] == "overflow"
    _no_rate_or_clip_advice(rep["hint"])
    tries = {t["try"]: t for t in rep["what_if"]}
    bound = f"step_sizes={1e-6:g},{inspect.signature(OPT.Rprop).parameters['step_sizes'].default[1]:g}"
    assert bound in tries and not any(t.startswith(("lr=", "clip=")) for t in tries), list(tries)
    assert (tries[bound]["finite"], tries[bound]["inconclusive"]) == (True, False)


def test_a_step_sizes_try_is_refused_for_an_optimizer_without_it(out_dir):
    """step_sizes is Rprop's: ASGD's bundle refuses it, naming the keys ASGD takes."""
    *_, err = _loop(lambda m: OPT.ASGD(m.parameters(), lr=1e39),
                    record={"out_dir": out_dir, "guard_optimizer": True})
    line = one_error_line(invoke_cli(err.bundle_path, "--json", "--try", "step_sizes=1e-6,5"))
    assert "ASGD has no 'step_sizes' setting; try another key (lr, wd, clip)" in line, line


def test_asgd_s_rate_beyond_float32_is_said_and_auto_proposes_a_finite_one(out_dir):
    """ASGD(lr=1e39): the rate is above float32's largest value, an inf once cast to the
    weights' dtype. The hint says so (and no eps: ASGD has none); --try auto proposes ASGD's
    own default rate, which makes the update finite, not a fraction of 1e39 nor clipping."""
    lr = 1e39
    assert lr > F32_MAX
    *_, err = _loop(lambda m: OPT.ASGD(m.parameters(), lr=lr),
                    record={"out_dir": out_dir, "guard_optimizer": True})
    names = [n for n, _ in OB.make_model().named_parameters()]
    assert (err.event["step"], err.event["phase"], err.event["params"]) == \
        (0, "optimizer", names)
    rep = nanreplay_json(err.bundle_path, "--try", "auto")
    assert rep["cause"] == "optimizer"
    assert f"its lr={lr:g} is beyond float32's largest finite value {F32_MAX:.3g}" \
        in rep["hint"], rep["hint"]
    assert not re.search(r"\beps\b", rep["hint"]), rep["hint"]
    assert "clip gradients" not in rep["hint"], rep["hint"]
    default = inspect.signature(OPT.ASGD).parameters["lr"].default
    assert [t["try"] for t in rep["what_if"]] == [f"lr={default:g}"], rep["what_if"]
    assert (rep["what_if"][0]["finite"], rep["what_if"][0]["inconclusive"]) == (True, False)


def test_lion_s_sign_update_is_not_told_to_clip(out_dir):
    """pytorch_optimizer's Lion updates by lr * sign(...): at lr=1e37 its second update's
    weights overflow the loss. The gradients' magnitude never reaches the weights, so the
    remedy is the rate alone: no clipping advice, and auto's lr=0.1x re-runs the window finite
    (no clip=1.0 proposed)."""
    lion = pytest.importorskip("pytorch_optimizer").Lion
    plain, *_ = _loop(lambda m: lion(m.parameters(), lr=1e37))
    step = next(i for i, v in enumerate(plain) if not math.isfinite(v))
    *_, err = _loop(lambda m: lion(m.parameters(), lr=1e37),
                    record={"out_dir": out_dir, "rewind": 4})
    assert err.event["step"] == step and err.event["phase"] in ("forward", "loss"), err.event
    rep = nanreplay_json(err.bundle_path, "--try", "auto")
    assert rep["cause"] == "overflow"
    assert "clipping them changes nothing: lower the learning rate" in rep["hint"], rep["hint"]
    assert "clip the gradients" not in rep["hint"], rep["hint"]
    tries = {t["try"]: t for t in rep["what_if"]}
    assert "lr=0.1x" in tries and not any(t.startswith("clip=") for t in tries), list(tries)
    assert (tries["lr=0.1x"]["finite"], tries["lr=0.1x"]["inconclusive"]) == (True, False)

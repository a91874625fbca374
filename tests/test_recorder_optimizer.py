"""Updates that turn finite gradients into non-finite weights (phase "optimizer").

By default the recorder notices at the next step's check and blames the step whose update did
it, with ``after_update`` True and the post-update state in the bundle. ``guard_optimizer=True``
checks right after ``optimizer.step()`` and the bundle holds the pre-update weights.
"""

from __future__ import annotations

import models as M
import pytest
import torch
from models import bundles, check_event, identical
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle

K = 3
PARAMS = ["0.weight", "0.bias", "2.weight", "2.bias"]


class AddConstant(torch.optim.Optimizer):
    """SGD that also adds ``push`` to every weight when ``push`` is set (a broken update)."""

    def __init__(self, params, lr=0.05):
        super().__init__(params, {"lr": lr, "push": 0.0})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                st["count"] = st.get("count", torch.zeros(())) + 1
                p.add_(p.grad, alpha=-group["lr"])
                if group["push"]:
                    p.add_(group["push"])


def _train(model, opt, out_dir, steps=6, at=None, snapshot=None, **kw):
    """Run the loop; ``snapshot[step]`` gets the weights just before that step's update."""
    crit = nn.CrossEntropyLoss()
    steps_run = []
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, **kw) as rec:
            for step in range(steps):
                if at is not None:
                    at(step)
                x, y = M.batch(step)
                opt.zero_grad()
                crit(model(x), y).backward()
                if snapshot is not None:
                    snapshot[step] = {n: p.detach().clone() for n, p in model.named_parameters()}
                steps_run.append(step)
                opt.step()
    return info.value, rec, steps_run


def _nan_lr_at(opt, k):
    def at(step):
        if step == k:
            opt.param_groups[0]["lr"] = float("nan")

    return at


def test_nan_lr_default_mode_blames_the_update_at_the_next_check(out_dir):
    model = M.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    err, rec, steps_run = _train(model, opt, out_dir, at=_nan_lr_at(opt, K))
    check_event(err.event, step=K, phase="optimizer", params=PARAMS, kind="nan",
                after_update=True, module=None)
    assert steps_run[-1] == K + 1  # noticed at the next step's check
    assert "phase optimizer" in str(err) and f"step {K}" in str(err)
    meta, t = read_bundle(err.bundle_path)
    assert meta["state"] == "after_update"
    assert meta["event"] == err.event
    for name in PARAMS:
        assert torch.isnan(t[f"weights/{name}"]).all()
    assert meta["optimizer"]["param_groups"][0]["lr"] == "nan"  # JSON spelling of NaN


def test_nan_lr_guard_mode_catches_it_right_after_the_update(out_dir):
    model = M.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    before: dict = {}
    err, rec, steps_run = _train(model, opt, out_dir, at=_nan_lr_at(opt, K), snapshot=before,
                                 guard_optimizer=True)
    check_event(err.event, step=K, phase="optimizer", params=PARAMS, kind="nan",
                after_update=False)
    assert steps_run[-1] == K  # raised by optimizer.step() of step K itself
    assert rec.memory_bytes["optimizer_guard"] == 0  # released at detach
    meta, t = read_bundle(err.bundle_path)
    assert meta["state"] == "before_update"
    for name in PARAMS:
        w = t[f"weights/{name}"]
        assert torch.isfinite(w).all()
        assert identical(w, before[K][name])  # the pre-update weights, not the live NaN ones
        assert torch.isfinite(t[f"grads/{name}"]).all()
        assert torch.isfinite(t[f"optim/{name}/momentum_buffer"]).all()
    for p in model.parameters():
        assert torch.isnan(p).all()  # the update itself did happen
    assert meta["micro_batches"] and torch.equal(t["batch/0/0"], M.batch(K)[0])


@pytest.mark.parametrize("guard", [False, True])
def test_inf_update_kind(out_dir, guard):
    model = M.mlp()
    opt = AddConstant(model.parameters())

    def at(step):
        if step == K:
            opt.param_groups[0]["push"] = float("inf")

    err, _, steps_run = _train(model, opt, out_dir, at=at, guard_optimizer=guard)
    check_event(err.event, step=K, phase="optimizer", params=PARAMS, kind="+inf",
                after_update=not guard)
    assert steps_run[-1] == (K if guard else K + 1)


def test_guard_mode_trains_cleanly_without_event(out_dir):
    model = M.mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    crit = nn.CrossEntropyLoss()
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, guard_optimizer=True) as rec:
        M.train(model, opt, crit, 4)
        assert rec.memory_bytes["optimizer_guard"] > 0
    assert rec.event is None and rec.step == 4


def test_weights_already_non_finite_at_attach(out_dir):
    """Not made by a recorded update: phase "weights"."""
    model = M.mlp()
    with torch.no_grad():
        model[2].bias[1] = float("nan")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    err, _, steps_run = _train(model, opt, out_dir)
    check_event(err.event, step=0, phase="weights", params=["2.bias"], kind="nan")
    assert steps_run == [0]


# ---------------------------------------------------------------------------------------------
# huge but finite: float32 squared norms overflow above ~1.8e19, the values do not


def _huge_but_finite_model():
    model = M.mlp()
    with torch.no_grad():
        model[2].bias[0] = 2e19  # finite; its square (4e38) is not
    return model


@pytest.mark.parametrize("guard", [False, True])
def test_huge_finite_weight_is_no_event(out_dir, guard):
    model = _huge_but_finite_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    crit = nn.CrossEntropyLoss()
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, guard_optimizer=guard) as rec:
        M.train(model, opt, crit, 3)
        for p in model.parameters():
            assert torch.isfinite(p).all() and torch.isfinite(p.grad).all()
    assert rec.event is None and rec.step == 3 and bundles(out_dir) == []


def test_huge_finite_gradient_is_no_event(out_dir):
    model = M.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def huge_loss(out, y):
        return out[:, 0].sum() * 1e19  # gradients of 1e19 * 8 rows: finite, square is not

    with FlightRecorder(model, opt, loss_fn=huge_loss, out_dir=out_dir) as rec:
        M.train(model, opt, huge_loss, 3, rec=rec)
        assert torch.isfinite(model[2].weight.grad).all()
        assert model[2].bias.grad.abs().max() > 2e19
    assert rec.event is None and rec.step == 3 and bundles(out_dir) == []


def test_huge_finite_weight_does_not_hide_a_real_nan(out_dir):
    model = _huge_but_finite_model()
    model = nn.Sequential(*model[:2], M.LogOf(), model[2])
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir):
            M.train(model, opt, crit, 6, at=M.arm_at(K, model[2]))
    check_event(info.value.event, step=K, phase="forward", module="2", kind="nan")


# ---------------------------------------------------------------------------------------------
# optimizer.step(closure): the step's forward and backward run inside step()


def _closure_loop(model, opt, out_dir, steps, *, bad_step=None, accumulate=1, **kw):
    """``opt.step(closure)`` as Lightning's automatic optimization calls it: the first
    ``accumulate - 1`` micro-batches run before step(), the last inside the closure. Returns
    (error or None, recorder, weights before each step's update)."""
    crit = nn.CrossEntropyLoss()
    before = {}
    err = None
    try:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, **kw) as rec:
            for step in range(steps):
                def micro(i, step=step):
                    x, y = M.batch(10 * step + i)
                    if step == bad_step and i == accumulate - 1:
                        x[2, 1] = float("nan")
                    (crit(model(x), y) / accumulate).backward()

                opt.zero_grad()
                for i in range(accumulate - 1):
                    micro(i)
                before[step] = {n: p.detach().clone() for n, p in model.named_parameters()}

                def closure(step=step):
                    micro(accumulate - 1)
                    return torch.zeros(())

                opt.step(closure)
    except NonFiniteError as e:
        err = e
    return err, rec, before


def test_closure_steps_are_checked_before_their_update(out_dir):
    model = M.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    err, rec, before = _closure_loop(model, opt, out_dir, 6, bad_step=K)
    check_event(err.event, step=K, phase="input", micro_batch=0, samples=[2])
    # raised in step K's closure, before SGD touched the weights
    assert all(identical(p.detach(), before[K][n]) for n, p in model.named_parameters())
    meta, _ = read_bundle(err.bundle_path)
    assert meta["state"] == "before_update" and len(meta["micro_batches"]) == 1


def test_closure_step_with_accumulation_is_one_step(out_dir):
    """Two micro-batches before step() and one inside its closure: one step of three."""
    model = M.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    err, rec, _ = _closure_loop(model, opt, out_dir, 4, accumulate=3)
    assert err is None and rec.step == 4
    model = M.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    err, rec, _ = _closure_loop(model, opt, out_dir, 4, bad_step=2, accumulate=3)
    check_event(err.event, step=2, phase="input", micro_batch=2, samples=[2])
    meta, _ = read_bundle(err.bundle_path)
    assert len(meta["micro_batches"]) == 3


def test_lbfgs_first_evaluation_is_checked_before_the_update(out_dir):
    """LBFGS evaluates its closure several times per step(), updating in between: each
    evaluation is a step of its own, closed before the next update, so the first evaluation
    of a step() is checked before any update (its step counts the evaluations before it)."""
    model = M.mlp()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    err, rec, before = _closure_loop(model, opt, out_dir, 5, bad_step=K)
    evaluations = opt.state[next(iter(opt.state))]["func_evals"]  # in the K step() calls
    assert evaluations > K
    check_event(err.event, step=evaluations, phase="input", samples=[2])
    assert all(identical(p.detach(), before[K][n]) for n, p in model.named_parameters())

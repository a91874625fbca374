"""Planted bugs at a known step: the event names the exact step, phase, module, call and kind.

Each test trains a tiny model for a few real steps, turns a bug on at step 3, and checks what
``NonFiniteError.event`` and the bundle say about it.
"""

from __future__ import annotations

import gc
import logging
import math
import weakref

import models as M
import pytest
import torch
import torch.utils.checkpoint
from models import bundles, check_event, identical
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle

K = 3  # the step at which every planted bug first fires


def run_until_event(model, *, steps=6, at=None, make_batch=M.batch, loss_fn=None,
                    optimizer=None, out_dir, **rec_kwargs) -> NonFiniteError:
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.05)
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, optimizer, loss_fn=loss_fn, out_dir=out_dir,
                            **rec_kwargs) as rec:
            M.train(model, optimizer, loss_fn, steps, at=at, make_batch=make_batch,
                    rec=rec if not isinstance(loss_fn, nn.Module) else None)
    err = info.value
    assert err.bundle_path is not None and err.bundle_path.exists()
    assert bundles(out_dir) == [err.bundle_path]
    assert rec.event == err.event and rec.bundle_path == err.bundle_path
    return err


def nan_row_batch(row: int, col: int = 1, value: float = float("nan")):
    def make(step):
        x, y = M.batch(step)
        if step == K:
            x[row, col] = value
        return x, y

    return make


# ---------------------------------------------------------------------------------------------
# 1. forward: a custom op


def test_custom_op_nan_mid_network(out_dir):
    model = nn.Sequential(nn.Linear(M.D_IN, M.HIDDEN), nn.ReLU(), M.LogOf(),
                          nn.Linear(M.HIDDEN, M.N_CLASSES))
    err = run_until_event(model, at=M.arm_at(K, model[2]), out_dir=out_dir)
    check_event(err.event, step=K, reason="non_finite", phase="forward", module="2",
                module_type="models.LogOf", call=0, micro_batch=0, inputs_finite=True,
                kind="nan", params=[], tensor=None)
    assert err.event["samples"] == list(range(M.BATCH))  # every row went NaN
    msg = str(err)
    assert "\n" not in msg
    for phrase in (f"step {K}", "phase forward", "module '2'", str(err.bundle_path)):
        assert phrase in msg


def test_bundle_of_forward_event_holds_the_step(out_dir):
    model = nn.Sequential(nn.Linear(M.D_IN, M.HIDDEN), nn.ReLU(), M.LogOf(),
                          nn.Linear(M.HIDDEN, M.N_CLASSES))
    err = run_until_event(model, at=M.arm_at(K, model[2]), out_dir=out_dir,
                          factory="models:mlp")
    meta, t = read_bundle(err.bundle_path)
    assert meta["event"] == err.event
    assert meta["factory"] == "models:mlp"
    assert meta["state"] == "before_update"
    assert meta["params"] == ["0.weight", "0.bias", "3.weight", "3.bias"]
    assert [m["name"] for m in meta["modules"]] == ["", "0", "1", "2", "3"]
    # the step's own batch, and the weights it ran with (the failed step never updated them)
    x, y = M.batch(K)
    assert torch.equal(t["batch/0/0"], x)
    assert torch.equal(t["loss_in/0/0"], y)
    for name, p in model.named_parameters():
        assert torch.equal(t[f"weights/{name}"], p.detach())
        assert identical(t[f"grads/{name}"], p.grad)
    # call order: children then the root, all in micro-batch 0
    assert meta["call_order"] == [[1, 0], [2, 0], [3, 0], [4, 0], [0, 0]]
    assert meta["optimizer"]["class"] == "torch.optim.sgd.SGD"
    assert meta["optimizer"]["param_groups"][0]["params"] == meta["params"]
    assert meta["optimizer"]["param_groups"][0]["lr"] == 0.05
    # ring: the steps before the event and the event step
    assert t["ring/steps"].tolist() == list(range(K + 1))
    calls = t["ring/calls"]
    assert calls.shape == (K + 1, 5, 9)
    assert t["ring/call_module"][K].tolist() == [1, 2, 3, 4, 0]
    # fields: min, max, absmax, mean, rms, nan, posinf, neginf, inputs_finite; the calls of
    # step K: modules "0", "1" (ReLU) finite, "2" (LogOf) NaN from finite inputs, then "3", root
    assert calls[K, :, 5].tolist() == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert calls[K, :, 8].tolist() == [1.0, 1.0, 1.0, 0.0, 1.0]
    assert calls[K - 1, 1, 0] >= 0.0  # the ReLU's min
    assert not calls[:K, :, 5].any()  # no NaN before it
    assert torch.isfinite(t["ring/loss"][:K]).all()
    assert torch.isfinite(t["ring/grad_norm"][:K]).all()
    assert t["ring/lr"][:, 0].tolist() == [0.05] * (K + 1)
    assert t["ring/grad_norms"].shape == (K + 1, 4)
    env = meta["env"]
    for key in ("python", "torch", "rank", "world_size", "argv", "git_commit"):
        assert key in env
    assert (env["rank"], env["world_size"]) == (0, 1)


# ---------------------------------------------------------------------------------------------
# 2. bad data


def test_nan_in_one_input_sample(out_dir):
    err = run_until_event(M.mlp(), make_batch=nan_row_batch(5), out_dir=out_dir)
    check_event(err.event, step=K, phase="input", module="", call=0, micro_batch=0,
                inputs_finite=False, kind="nan", tensor="batch", samples=[5])
    assert "Tensor batch," in str(err) and "samples [5]" in str(err)


def nan_rows_batch(rows, n: int = M.BATCH) -> callable:
    def make(step):
        x, y = M.batch(step, n=n)
        if step == K:
            x[rows, 1] = float("nan")
        return x, y

    return make


def test_message_says_all_samples_when_the_whole_batch_is_bad(out_dir):
    """A column NaN in every record (a standardisation by a constant feature's zero std) is
    told as "all N samples", not as the first 8 rows, which read like 8 bad records."""
    n = M.BATCH
    err = run_until_event(M.mlp(), make_batch=nan_rows_batch(slice(None)), out_dir=out_dir)
    check_event(err.event, step=K, phase="input", samples=list(range(n)), batch_size=n)
    assert f"Tensor batch, all {n} samples." in str(err), err


def test_message_counts_the_samples_past_the_first_eight(out_dir):
    err = run_until_event(M.mlp(), make_batch=nan_rows_batch(list(range(10)), n=16),
                          out_dir=out_dir)
    check_event(err.event, step=K, phase="input", samples=list(range(10)))
    assert "Tensor batch, samples [0, 1, 2, 3, 4, 5, 6, 7] (+2 more)." in str(err), err


@pytest.mark.parametrize("value, kind", [(float("inf"), "+inf"), (-float("inf"), "-inf")])
def test_inf_in_input_sample_kind(out_dir, value, kind):
    err = run_until_event(M.mlp(), make_batch=nan_row_batch(2, value=value), out_dir=out_dir)
    check_event(err.event, step=K, phase="input", kind=kind, samples=[2], tensor="batch")


def test_nan_in_loss_target_is_an_input_event(out_dir):
    def make(step):
        x, _ = M.batch(step)
        y = torch.ones(M.BATCH, M.N_CLASSES)
        if step == K:
            y[4, 0] = float("nan")
        return x, y

    err = run_until_event(M.mlp(), make_batch=make, loss_fn=nn.MSELoss(), out_dir=out_dir)
    check_event(err.event, step=K, phase="input", module="<loss>", micro_batch=0, kind="nan",
                samples=[4])


def test_nan_made_by_the_loss_function(out_dir):
    """A plain-function loss called through ``rec.loss_fn``: sqrt of a negative number."""
    shift = {"value": 0.0}

    def sqrt_ce(out, y):
        return torch.sqrt(nn.functional.cross_entropy(out, y) - shift["value"])

    def at(step):
        shift["value"] = 100.0 if step == K else 0.0

    err = run_until_event(M.mlp(), at=at, loss_fn=sqrt_ce, out_dir=out_dir)
    check_event(err.event, step=K, phase="loss", module="<loss>", micro_batch=0, kind="nan")
    meta, _ = read_bundle(err.bundle_path)
    assert meta["loss"]["kind"] == "function"
    assert meta["loss"]["name"].endswith("sqrt_ce")


def test_an_inline_loss_given_to_record_loss(out_dir):
    """``F.cross_entropy`` computed inline (no ``loss_fn``) and handed to ``record_loss``: at step
    K every target is ignored, the mean over none is 0/0 = NaN and every gradient is 0, so only
    the loss shows it: a loss event at K, before the update; the bundle says the loss was
    recorded but cannot be re-run. Outside a step ``record_loss`` is a no-op."""
    model = M.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = FlightRecorder(model, opt, out_dir=out_dir)
    rec.record_loss(torch.tensor(math.nan))  # not attached: ignored
    with pytest.raises(NonFiniteError) as info, rec:
        rec.record_loss(torch.tensor(math.nan))  # attached, no step open: ignored
        for step in range(K + 2):
            x, y = M.batch(step)
            if step == K:
                y = torch.full_like(y, -100)
                before = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            rec.record_loss(loss)
            loss.backward()
            opt.step()
    check_event(info.value.event, step=K, phase="loss", module="<loss>", micro_batch=0,
                kind="nan")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    meta, tensors = read_bundle(info.value.bundle_path)
    assert meta["loss"] == {"kind": "recorded"}
    assert not any(name.startswith("loss_in/") for name in tensors)


# ---------------------------------------------------------------------------------------------
# 3. backward only


def test_backward_only_nan_names_the_params(out_dir):
    model = nn.Sequential(nn.Linear(M.D_IN, M.HIDDEN), M.SqrtOf(),
                          nn.Linear(M.HIDDEN, M.N_CLASSES))
    err = run_until_event(model, at=M.arm_at(K, model[1]), out_dir=out_dir)
    check_event(err.event, step=K, phase="backward", kind="nan",
                params=["0.weight", "0.bias"], module=None)
    _, t = read_bundle(err.bundle_path)
    assert not torch.isfinite(t["grads/0.weight"]).all()
    assert torch.isfinite(t["grads/2.weight"]).all()
    assert torch.isfinite(t["ring/calls"][-1, :, :5].nan_to_num(0.0, 0.0, 0.0)).all()
    assert not t["ring/calls"][-1, :, 5].any()  # the forward of step K was NaN-free


# ---------------------------------------------------------------------------------------------
# 5. float16 overflow


def test_float16_overflow_is_plus_inf_in_that_module(out_dir):
    model = nn.Sequential(nn.Linear(M.D_IN, M.HIDDEN), M.HalfAmplify(),
                          nn.Linear(M.HIDDEN, M.N_CLASSES))
    err = run_until_event(model, at=M.arm_at(K, model[1]), out_dir=out_dir)
    check_event(err.event, step=K, phase="forward", module="1", module_type="models.HalfAmplify",
                call=0, inputs_finite=True, kind="+inf")


# ---------------------------------------------------------------------------------------------
# 6. a NaN that depends on the dropout draw


def test_dropout_dependent_nan_and_rng_state(out_dir):
    model = M.DropoutNet()
    rng_at_start: dict[int, torch.Tensor] = {}
    masks: dict[int, torch.Tensor] = {}
    arm = M.arm_at(K, model.logd)

    def at(step):
        arm(step)
        rng_at_start[step] = torch.get_rng_state()

    model.logd.register_forward_hook(lambda m, a, out: masks.__setitem__(0, out.isnan()))
    err = run_until_event(model, at=at, out_dir=out_dir)
    check_event(err.event, step=K, phase="forward", module="logd",
                module_type="models.LogOfDropped", call=0, inputs_finite=True, kind="nan")
    nan_mask = masks[0]
    assert 0 < int(nan_mask.sum()) < nan_mask.numel()  # some elements, where dropout hit

    meta, t = read_bundle(err.bundle_path)
    assert torch.equal(t["rng/torch_cpu"], rng_at_start[K])

    # re-run the step's forward from the bundle: same weights, same batch, same RNG -> same NaN
    replay = M.DropoutNet()
    replay.load_state_dict({k.removeprefix("weights/"): v for k, v in t.items()
                            if k.startswith("weights/")})
    replay.train()
    replay.logd.armed = True
    torch.set_rng_state(t["rng/torch_cpu"])
    h = replay.logd(replay.drop(replay.pos(replay.lin(t["batch/0/0"]))))
    assert torch.equal(h.isnan(), nan_mask)
    # and the NaN really depends on the draw: another RNG state puts it elsewhere
    torch.manual_seed(12345)
    h2 = replay.logd(replay.drop(replay.pos(replay.lin(t["batch/0/0"]))))
    assert not torch.equal(h2.isnan(), nan_mask)


# ---------------------------------------------------------------------------------------------
# 7. a module called several times per forward


def test_third_call_of_a_shared_module(out_dir):
    model = M.SharedNet()
    err = run_until_event(model, at=M.arm_at(K, model), out_dir=out_dir)
    check_event(err.event, step=K, phase="forward", module="shared",
                module_type="models.SharedLog", call=2, micro_batch=0, inputs_finite=True,
                kind="nan")
    assert "call 2" in str(err)


# ---------------------------------------------------------------------------------------------
# 8. functional code in a parent's own forward


def test_parent_own_code_is_blamed_not_the_child(out_dir):
    model = M.ParentNet()
    err = run_until_event(model, at=M.arm_at(K, model.parent), out_dir=out_dir)
    check_event(err.event, step=K, phase="forward", module="parent",
                module_type="models.ParentOwnCode", call=0, inputs_finite=True, kind="nan")


# ---------------------------------------------------------------------------------------------
# 9. dict / tuple / keyword batches


def _run_batches(model, make_args, out_dir):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir):
            for step in range(6):
                args, kwargs, y = make_args(step)
                opt.zero_grad()
                crit(model(*args, **kwargs), y).backward()
                opt.step()
    return info.value


def test_dict_batch_path_names_the_key(out_dir):
    def make(step):
        x, y = M.batch(step)
        extra = M.batch(step + 100)[0]
        if step == K:
            extra[6, 1] = float("nan")
        return ({"image": x, "extra": extra},), {}, y

    err = _run_batches(M.DictNet(), make, out_dir)
    check_event(err.event, step=K, phase="input", module="", tensor='batch["extra"]',
                samples=[6], kind="nan")
    meta, t = read_bundle(err.bundle_path)
    mb = meta["micro_batches"][0]
    assert sorted(mb["paths"].values()) == ['[0][0]["extra"]', '[0][0]["image"]']
    key = next(k for k, p in mb["paths"].items() if p.endswith('["extra"]'))
    assert torch.isnan(t[key][6, 1]) and torch.isfinite(t[key][:6]).all()


def test_tuple_batch_path_names_the_element(out_dir):
    class PairNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(M.D_IN, M.N_CLASSES)

        def forward(self, pair):
            x, scale = pair
            return self.a(x) * scale

    def make(step):
        x, y = M.batch(step)
        scale = torch.ones(M.BATCH, 1)
        if step == K:
            scale[3] = float("nan")
        return ((x, scale),), {}, y

    err = _run_batches(PairNet(), make, out_dir)
    check_event(err.event, step=K, phase="input", tensor="batch[1]", samples=[3])


def test_positional_args_are_numbered(out_dir):
    class TwoArgs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(M.D_IN, M.N_CLASSES)

        def forward(self, x, scale):
            return self.a(x) * scale

    def make(step):
        x, y = M.batch(step)
        scale = torch.ones(M.BATCH, 1)
        if step == K:
            scale[7] = -float("inf")
        return (x, scale), {}, y

    err = _run_batches(TwoArgs(), make, out_dir)
    check_event(err.event, step=K, phase="input", tensor="args[1]", samples=[7], kind="-inf")


def test_keyword_batch_path_names_the_key(out_dir):
    def make(step):
        x, y = M.batch(step)
        mask = torch.ones(M.BATCH, M.HIDDEN)
        if step == K:
            mask[1, 0] = float("nan")
        return (x,), {"mask": mask}, y

    err = _run_batches(M.KwargNet(), make, out_dir)
    check_event(err.event, step=K, phase="input", module="", tensor='kwargs["mask"]',
                samples=[1], kind="nan")


# ---------------------------------------------------------------------------------------------
# 12. gradient accumulation


def test_gradient_accumulation_micro_batch(out_dir):
    model = M.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.CrossEntropyLoss()
    n_micro = 4
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir) as rec:
            for step in range(6):
                opt.zero_grad()
                for mb in range(n_micro):
                    x, y = M.batch(10 * step + mb)
                    if step == K and mb == 2:
                        x[5, 0] = float("nan")
                    (crit(model(x), y) / n_micro).backward()
                opt.step()
    err = info.value
    check_event(err.event, step=K, phase="input", module="", micro_batch=2, tensor="batch",
                samples=[5])
    assert rec.step == K + 1
    meta, t = read_bundle(err.bundle_path)
    assert len(meta["micro_batches"]) == n_micro
    for mb in range(n_micro):
        x, y = M.batch(10 * K + mb)
        got = t[f"batch/{mb}/0"]
        if mb == 2:
            assert torch.isnan(got[5, 0])
            got = got.clone()
            got[5, 0] = x[5, 0]
        assert torch.equal(got, x)
        assert torch.equal(t[f"loss_in/{mb}/0"], y)
        assert f"outgrad/{mb}/0" in t
    assert {mb for _, mb in meta["call_order"]} == set(range(n_micro))


def test_gradient_accumulation_forward_nan_in_third_micro_batch(out_dir):
    model = nn.Sequential(nn.Linear(M.D_IN, M.HIDDEN), M.LogOf(),
                          nn.Linear(M.HIDDEN, M.N_CLASSES))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir):
            for step in range(6):
                opt.zero_grad()
                for mb in range(4):
                    model[1].armed = step == K and mb == 2
                    x, y = M.batch(10 * step + mb)
                    (crit(model(x), y) / 4).backward()
                opt.step()
    check_event(info.value.event, step=K, phase="forward", module="1", micro_batch=2, call=0,
                inputs_finite=True)


# ---------------------------------------------------------------------------------------------
# allow_inf, on_event="warn"


def test_allow_inf_lets_masks_hold_inf_but_not_nan(out_dir):
    class Mask(nn.Module):
        """-inf on the upper triangle of an 8 x 8 score matrix; armed: NaN instead."""

        def __init__(self):
            super().__init__()
            self.armed = False

        def forward(self, h):
            fill = float("nan") if self.armed else -float("inf")
            return h + torch.full((M.HIDDEN,), 0.0).masked_fill(
                torch.arange(M.HIDDEN) >= M.HIDDEN - 2, fill)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(M.D_IN, M.HIDDEN)
            self.mask = Mask()
            self.head = nn.Linear(M.HIDDEN, M.N_CLASSES)

        def forward(self, x):
            return self.head(torch.softmax(self.mask(self.lin(x)), dim=-1))

    # -inf allowed: trains without an event
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.CrossEntropyLoss()
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, allow_inf=["mask"]) as rec:
        M.train(model, opt, crit, 5)
    assert rec.event is None and bundles(out_dir) == []
    # the same model without allow_inf, strict_inf: the mask's -inf is an event, blamed on it
    model = Net()
    err = run_until_event(model, out_dir=out_dir / "strict", strict_inf=True)
    check_event(err.event, step=0, phase="forward", module="mask", kind="-inf",
                inputs_finite=True)
    # allowed, but a NaN: always an event
    model = Net()
    err = run_until_event(model, at=M.arm_at(K, model.mask), out_dir=out_dir / "nan",
                          allow_inf=["mask"])
    check_event(err.event, step=K, phase="forward", module="mask", kind="nan",
                inputs_finite=True)


def test_warn_mode_writes_once_and_keeps_training(out_dir, caplog):
    model = nn.Sequential(nn.Linear(M.D_IN, M.HIDDEN), M.LogOf(),
                          nn.Linear(M.HIDDEN, M.N_CLASSES))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.CrossEntropyLoss()
    steps_done = []
    with caplog.at_level(logging.WARNING, logger="nanreplay"):
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, on_event="warn") as rec:
            for step in range(7):
                model[1].armed = step in (K, K + 2)  # two bad steps: one bundle
                x, y = M.batch(step)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
                steps_done.append(step)
    assert steps_done == list(range(7))
    assert rec.step == 7
    assert len(bundles(out_dir)) == 1 and rec.bundle_path == bundles(out_dir)[0]
    check_event(rec.event, step=K, phase="forward", module="1")
    records = [r for r in caplog.records if r.name == "nanreplay"]
    assert len(records) == 1
    assert records[0].levelno == logging.WARNING
    assert f"step {K}" in records[0].getMessage()
    assert str(rec.bundle_path) in records[0].getMessage()


def test_no_optimizer_steps_are_root_forwards(out_dir):
    """Without an optimizer a step is one root forward, closed when the next one starts."""
    model = nn.Sequential(nn.Linear(M.D_IN, M.HIDDEN), M.LogOf())
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, out_dir=out_dir) as rec:
            for step in range(6):
                model[1].armed = step == K
                with torch.no_grad():
                    model(M.batch(step)[0])
    check_event(info.value.event, step=K, phase="forward", module="1")
    assert rec.step == K + 1


def test_ring_history_values(out_dir):
    """The ring's loss, norms, lr and per-call statistics of the steps before an event are
    the values training actually had."""
    model = M.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    crit = nn.CrossEntropyLoss()
    seen = {"loss": [], "grad": [], "param": [], "lr": [], "out": []}
    model[2].register_forward_hook(lambda m, a, out: seen["out"].append(out.detach().clone()))
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, stats="full",
                            lr_scheduler=sched):
            for step in range(6):
                x, y = nan_row_batch(0)(step)
                opt.zero_grad()
                loss = crit(model(x), y)
                loss.backward()
                seen["loss"].append(loss.item())
                seen["grad"].append([p.grad.norm().item() for p in model.parameters()])
                seen["param"].append([p.norm().item() for p in model.parameters()])
                seen["lr"].append(opt.param_groups[0]["lr"])
                opt.step()
                sched.step()
    meta, t = read_bundle(info.value.bundle_path)
    assert t["ring/loss"][:K].tolist() == pytest.approx(seen["loss"][:K], rel=1e-6)
    assert t["ring/grad_norms"][:K].tolist() == [pytest.approx(g, rel=1e-5)
                                                 for g in seen["grad"][:K]]
    assert t["ring/param_norms"][:K].tolist() == [pytest.approx(p, rel=1e-5)
                                                  for p in seen["param"][:K]]
    total = [sum(g * g for g in row) ** 0.5 for row in seen["grad"][:K]]
    assert t["ring/grad_norm"][:K].tolist() == pytest.approx(total, rel=1e-5)
    assert t["ring/lr"][:, 0].tolist() == seen["lr"][: K + 1]
    assert not t["ring/skipped"].any()
    # per-call statistics of the head (module "2", the third call): min, max, mean, rms
    head = t["ring/call_module"][0].tolist().index(3)
    for step in range(K):
        out = seen["out"][step]
        stats = t["ring/calls"][step, head]
        assert stats[0].item() == out.min().item() and stats[1].item() == out.max().item()
        assert stats[2].item() == out.abs().max().item()
        assert stats[3].item() == pytest.approx(out.mean().item(), rel=1e-5, abs=1e-6)
        assert stats[4].item() == pytest.approx(out.pow(2).mean().sqrt().item(), rel=1e-5)
        assert stats[5:].tolist() == [0.0, 0.0, 0.0, 1.0]
    assert meta["lr_scheduler"]["class"].endswith("StepLR")


# ---------------------------------------------------------------------------------------------
# the per-step check itself


class _Extreme(nn.Module):
    """Fills its output with +-3.4e38, the float32 limit HF-style attention masks use."""

    def forward(self, x):
        return torch.where(x > 0, 3.4e38, -3.4e38) + 0 * x


def test_values_at_the_float32_limit_are_not_events(out_dir):
    model = nn.Sequential(nn.Linear(8, 64), _Extreme(), nn.Flatten())
    with FlightRecorder(model, out_dir=out_dir) as rec:
        for _ in range(4):
            model(torch.randn(16, 8))
    assert rec.event is None and bundles(out_dir) == []
    layout = rec.cycle.ring.layouts[-1].materialize()
    row = rec.cycle.ring.ordered_rows()[-1]
    extreme = [c for c in layout.calls if c[0] == 2][0]
    (lo, hi), = extreme[3]
    assert (row[lo], row[hi]) == (pytest.approx(-3.4e38), pytest.approx(3.4e38))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_ring_probe_sees_any_non_finite_entry(value):
    from recorder.ring import RingBuffer

    ring = RingBuffer(4)
    n = 37  # not a multiple of any vector width
    for pos in range(n):
        row = ring.reserve(n, torch.device("cpu"))
        row.copy_(torch.full((n,), 3.0e38))
        assert ring.probe_finite(n).item() == 0.0
        row[pos] = value
        assert math.isnan(ring.probe_finite(n).item())
        if pos:  # the entries before it are still all finite
            assert ring.probe_finite(pos).item() == 0.0


def test_evaluation_between_steps_is_checked_apart_and_let_go(out_dir):
    """A validation loop between steps (eval mode, gradients off) is not part of the next step:
    each forward is checked when it returns, its batch and output are let go, and the steps
    are the training loop's alone (count, micro-batches, bundle)."""
    model, crit = M.mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    refs = []
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir) as rec:
            M.train(model, opt, crit, 2)
            model.eval()
            with torch.no_grad():
                for i in range(30):
                    x, y = M.batch(100 + i)
                    out = model(x)
                    crit(out, y)
                    refs += [weakref.ref(x), weakref.ref(out)]
            del x, y, out
            gc.collect()
            assert all(r() is None for r in refs)  # nothing of the validation is held
            assert rec.step == 2
            model.train()

            def nan_at_second(s):
                x, y = M.batch(10 + s)
                if s == 1:
                    x[0, 0] = float("nan")
                return x, y

            M.train(model, opt, crit, 2, make_batch=nan_at_second)
    check_event(info.value.event, step=3, phase="input", micro_batch=0)
    assert "evaluation" not in info.value.event
    meta, _ = read_bundle(info.value.bundle_path)
    assert len(meta["micro_batches"]) == 1 and meta["micro_batches"][0]["grad_enabled"] is True


def test_nan_in_an_evaluation_forward_is_named_at_its_end(out_dir):
    """A NaN made during validation raises when that forward returns (before the metric code
    after it runs), naming the module; the bundle holds that one batch, gradients off."""
    model = nn.Sequential(nn.Linear(M.D_IN, M.HIDDEN), M.LogOf(), nn.Linear(M.HIDDEN, M.N_CLASSES))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.CrossEntropyLoss()
    after = []
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir) as rec:
            M.train(model, opt, crit, 2)
            model.eval()
            with torch.no_grad():
                for i in range(5):
                    model[1].armed = i == 3
                    model(M.batch(100 + i)[0])
                    after.append(i)
    assert after == [0, 1, 2]
    ev = info.value.event
    check_event(ev, step=2, phase="forward", module="1", evaluation=True, inputs_finite=True)
    assert "in an evaluation forward (gradients off) before step 2" in str(info.value)
    assert rec.step == 2
    meta, tensors = read_bundle(info.value.bundle_path)
    (mb,) = meta["micro_batches"]
    assert mb["grad_enabled"] is False
    (key,) = mb["paths"]  # the one input tensor: the fourth validation batch
    assert identical(tensors[key], M.batch(103)[0])


def test_no_grad_forwards_in_train_mode_between_steps_are_evaluations(out_dir):
    """A no-grad forward in train mode between steps (a validation loop without
    model.eval(), RL rollouts, swa_utils.update_bn) is an evaluation: checked on its own and
    let go, where it used to join the next step and stay referenced, batch and output, until
    the update (300 validation batches: 300 micro-batches held). Once a step has opened, a
    no-grad forward (a target from the model itself) stays a micro-batch of it; the RNG state
    the step's replay starts from is taken when the step opens, after such forwards drew."""
    model, crit = M.mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir) as rec:
        x, y = M.batch(0)
        with torch.no_grad():
            for _ in range(5):
                model(x)
        assert rec.cycle.tape is None and rec.step == 0  # checked, let go, no step
        opt.zero_grad()
        out = model(x)
        with torch.no_grad():
            target = model(x).argmax(1)
        crit(out, target).backward()
        assert len(rec.cycle.tape.micro_batches) == 2
        opt.step()
        assert rec.step == 1


def test_a_root_run_under_a_reentrant_checkpoint_is_no_evaluation(out_dir):
    """``checkpoint(model, x, use_reentrant=True)`` runs the root forward with gradients off
    (its backward runs it again): its input requires grad, so it is the step's forward, not an
    evaluation, and a loss event there is the step's."""
    model, crit = M.mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir):
            for step in range(5):
                x, y = M.batch(step)
                if step == K:
                    y[:] = -100  # every target ignored: the mean loss is 0/0
                opt.zero_grad()
                out = torch.utils.checkpoint.checkpoint(model, x.requires_grad_(),
                                                        use_reentrant=True)
                crit(out, y).backward()
                opt.step()
    check_event(info.value.event, step=K, phase="loss")
    assert "evaluation" not in info.value.event


def test_inference_mode_forwards_are_recorded(out_dir):
    """``torch.inference_mode()`` tensors keep no version counter: the recorder measures them
    again instead of failing (it used to log an internal error and stop recording)."""
    model = nn.Sequential(nn.Linear(M.D_IN, M.HIDDEN), M.LogOf(), nn.Linear(M.HIDDEN, 3))
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, out_dir=out_dir) as rec:
            with torch.inference_mode():
                for step in range(6):
                    model[1].armed = step == K
                    model(M.batch(step)[0])
    check_event(info.value.event, step=K, phase="forward", module="1", inputs_finite=True)
    assert rec.health.internal_errors == 0
    meta, tensors = read_bundle(info.value.bundle_path)
    (key,) = meta["micro_batches"][0]["paths"]
    assert identical(tensors[key], M.batch(K)[0])


def test_inference_mode_validation_between_steps(out_dir):
    model, crit = M.mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir) as rec:
            for step in range(3):
                M.train(model, opt, crit, 1, make_batch=lambda s, step=step: M.batch(step))
                model.eval()
                with torch.inference_mode():
                    for i in range(3):
                        x = M.batch(100 + i)[0]
                        if (step, i) == (2, 2):
                            x[4, 2] = -float("inf")
                        model(x)
                model.train()
    check_event(info.value.event, step=3, phase="input", evaluation=True, samples=[4],
                kind="-inf")
    assert rec.health.internal_errors == 0


def test_an_internal_error_is_logged_on_one_line(caplog):
    """A recorder bug is logged once, in one line, however long the exception's message (a
    dispatcher error lists every backend it knows, 50 lines), and turns the recorder off."""
    from recorder.hooks import Health

    health = Health()
    health.active = True
    message = "Could not run 'aten::sum.IntList_out' with arguments from the 'NestedTensorCPU'" \
              " backend.\n\nCPU: registered at RegisterCPU.cpp\nMeta: registered at ..."
    with caplog.at_level("WARNING", logger="nanreplay"):
        health.internal_error(NotImplementedError(message))
        health.internal_error(NotImplementedError(message))
    [record] = caplog.records
    assert record.getMessage() == (
        "nanreplay: recorder disabled after an internal error (NotImplementedError: Could not "
        "run 'aten::sum.IntList_out' with arguments from the 'NestedTensorCPU' backend.); "
        "training continues unrecorded")
    assert not health.active and health.internal_errors == 2


def test_a_failing_event_search_still_stops_with_the_bundle(out_dir, monkeypatch, caplog):
    """A bug of the recorder's in the slow path (finding the step's first offender) went up
    through ``optimizer.step()`` as a raw exception: training died and no bundle was written.
    The step the probe found non-finite still ends in NonFiniteError with its bundle, and the
    replay re-runs it and finds the origin."""
    from bundles import invoke_cli

    import recorder.events as events

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the event search")

    monkeypatch.setattr(events, "find_event", broken)
    model = M.mlp()
    with caplog.at_level("WARNING", logger="nanreplay"):
        err = run_until_event(model, make_batch=nan_row_batch(3), out_dir=out_dir,
                              factory="models:mlp")
    assert (err.event["step"], err.event["phase"]) == (K, None)
    assert "phase unknown. The recorder's search failed (RuntimeError: a bug in the event " \
           "search); nanreplay re-runs the step." in str(err)
    assert "finding the first non-finite value of step" in caplog.text
    monkeypatch.undo()
    res = invoke_cli(err.bundle_path)
    assert res.stdout.startswith(f"nanreplay: step {K}, unlocated event — reproduced"), res.output
    assert "  origin     input: nan made by the input batch" in res.stdout, res.stdout

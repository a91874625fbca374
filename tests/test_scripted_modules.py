"""Models holding TorchScript modules (``torch.jit.script`` / ``torch.jit.trace`` of a
submodule), on which PyTorch registers no hooks: the recorder hooks every other module and
records the step; the replay finds an op inside a scripted module through the dispatcher and
names it at the hooked call that ran it, with a note; a scripted root is refused in one line."""

from __future__ import annotations

import pytest
import scripted_models as M
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def _train(model, out_dir, steps: int = 4, big_at: int | None = None, scale_at=None,
           make: str = "make_model", record: bool = True):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    crit = torch.nn.MSELoss()
    losses = []

    def loop():
        for step in range(steps):
            x, y = M.batch(step, big_at=big_at)
            scale = torch.tensor(0.0 if step == scale_at else 2.0)
            opt.zero_grad()
            loss = crit(model(x, scale), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())

    if not record:
        loop()
        return losses
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                        factory=f"scripted_models:{make}") as rec:
        loop()
    return losses, rec


def test_healthy_run_records_around_scripted_modules_and_trains_identically(tmp_path):
    bare = _train(M.make_model(), tmp_path, steps=6, record=False)
    model = M.make_model()
    recorded, rec = _train(model, tmp_path, steps=6)
    assert recorded == bare  # bit for bit: nothing the step computes changed
    assert not list(tmp_path.glob("*.nan"))
    eager = [n for n, m in model.named_modules() if not isinstance(m, torch.jit.ScriptModule)]
    assert "mid.fc" in eager and "head" in eager
    # every hook the recorder registered is gone after the with block
    for _, m in model.named_modules():
        if not isinstance(m, torch.jit.ScriptModule):
            assert not m._forward_hooks and not m._forward_pre_hooks, m


def test_overflow_inside_a_scripted_block_is_found_and_named_at_its_caller(tmp_path):
    """Row 5 in the hundreds makes the scripted block's written-out log-softmax overflow in
    exp (the NaN comes later, in gelu of -inf): the op finder sees the scripted module's ops,
    blames aten.exp, names the root's call (the hooked caller), the line that called the
    block, and the block as the scripted module that ran the op."""
    with pytest.raises(NonFiniteError) as info:
        _train(M.make_overflow_model(), tmp_path, big_at=2, make="make_overflow_model")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["event"]["step"], o["module"], o["op"], o["made"]) == (2, "", "aten.exp", "+inf"), o
    assert o["samples"] == [5], o
    assert o["source"] == source_line("scripted_models.py", "h = self.block(h)"), o
    assert rep["cause"] == "overflow", (rep["cause"], rep["hint"])
    # the scripted module that ran the op, found by the global module hooks
    assert (o["scripted"], o["scripted_call"]) == ("block", 0), o
    assert any("aten.exp ran inside 'block' (call 0), a TorchScript module" in p
               for p in rep["problems"]), rep["problems"]


def test_eager_module_after_scripted_ones_is_named_exactly(tmp_path):
    """A zero scale makes the eager head divide by 0: the hooked modules keep their names and
    call numbers with scripted ones beside them, and no TorchScript note is given for a call
    that holds none."""
    with pytest.raises(NonFiniteError) as info:
        _train(M.make_model(), tmp_path, scale_at=1)
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["event"]["step"], o["module"], o["call"], o["op"]) == (1, "head", 0, "aten.div"), o
    assert o["source"] == source_line("scripted_models.py", "return self.fc(x) / scale"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert not any("TorchScript" in p for p in rep["problems"]), rep["problems"]


def test_scripted_root_is_refused_in_one_line():
    model = torch.jit.script(M.Block())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError) as info:
        FlightRecorder(model, opt)
    msg = str(info.value)
    assert "\n" not in msg and "TorchScript" in msg and "record the eager nn.Module" in msg, msg


def test_scripted_loss_module_is_checked_through_rec_loss_fn(tmp_path):
    """A scripted loss (no hooks) is taken as a function: called through ``rec.loss_fn`` it
    is checked, its +inf target an event at the loss's inputs."""
    model = M.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = torch.jit.script(torch.nn.MSELoss())
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path) as rec:
            x, y = M.batch(0)
            y[3] = float("inf")
            rec.loss_fn(model(x, torch.tensor(2.0)), y).backward()
            opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "input", "<loss>"), ev
    # the replay cannot rebuild a scripted module: it says so, by the class it scripted
    rep = nanreplay_json(info.value.bundle_path, code=None)
    assert any("torch.jit.script(MSELoss()) is a TorchScript module" in p
               and "return it from the factory" in p for p in rep["problems"]), rep["problems"]


def test_scripted_loss_function_is_replayed_and_its_op_named(tmp_path):
    """A ``@torch.jit.script`` loss function, whose ``__module__`` and ``__qualname__`` are
    ``torch.jit.ScriptFunction``'s: the bundle names it by where it was defined, so the replay
    imports it, re-runs the loss and names the op on the planted target's row (before, the
    note said it could not be imported and the loss was not re-run)."""
    bad_step, bad_row = 2, 3
    model = M.make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.log_target_mse, out_dir=tmp_path,
                            factory="scripted_models:make_model") as rec:
            for step in range(4):
                x, y = M.batch(step)
                y = y.abs() + 0.5
                if step == bad_step:
                    y[bad_row] = -1.0  # the plant: a negative target, log of it NaN
                opt.zero_grad()
                rec.loss_fn(model(x, torch.tensor(2.0)), y).backward()
                opt.step()
    assert (info.value.event["step"], info.value.event["phase"]) == (bad_step, "loss")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert rep["reproduced"] is True, rep
    assert (o["module"], o["op"], o["samples"]) == ("<loss>", "aten.log", [bad_row]), o
    assert rep["cause"] == "invalid", (rep["cause"], rep["hint"])
    assert not any("cannot be imported" in p for p in rep["problems"]), rep["problems"]


def _train_pool(model, steps: int, empty, out_dir=None) -> list[float]:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    crit, losses = torch.nn.MSELoss(), []

    def loop():
        for step in range(steps):
            x, mask, y = M.token_batch(step, empty=empty)
            opt.zero_grad()
            loss = crit(model(x, mask), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())

    if out_dir is None:
        loop()
        return losses
    try:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="scripted_models:make_pool_model"):
            loop()
    except NonFiniteError as e:
        e.losses = losses
        raise
    return losses


def test_empty_mask_in_a_scripted_pooling_is_named_at_that_module(tmp_path):
    """A scripted masked mean inside an eager encoder divides by a count of 0 for the sample
    whose mask the plant empties: the event's step, the encoder's call (the hooked caller),
    the scripted module by its name in the model ('enc.pool'), aten.div on that sample; the
    steps before it trained bit for bit as without the recorder."""
    bad_step, bad_row = 3, 2
    bare = _train_pool(M.make_pool_model(), bad_step, (bad_step, bad_row))
    with pytest.raises(NonFiniteError) as info:
        _train_pool(M.make_pool_model(), bad_step + 2, (bad_step, bad_row), tmp_path)
    assert info.value.losses == bare  # (the event's step raised before its loss was read)
    assert (info.value.event["step"], info.value.event["phase"]) == (bad_step, "forward")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert rep["reproduced"] is True, rep
    assert (o["module"], o["scripted"], o["scripted_call"]) == ("enc", "enc.pool", 0), o
    assert (o["op"], o["samples"]) == ("aten.div", [bad_row]), o
    assert o["source"] == source_line("scripted_models.py",
                                      "return self.pool(torch.relu(self.proj(x)), mask)"), o
    assert rep["cause"] == "invalid", (rep["cause"], rep["hint"])


def test_backward_pole_inside_a_scripted_module_is_replayed_and_named(tmp_path):
    """sqrt's gradient at a zero row, inside a scripted module: the backward replay labels
    autograd nodes by the module whose call made them, and hooked every module, a scripted
    one too, which PyTorch refuses (before: 'replay failed (RuntimeError:
    register_forward_pre_hook is not supported on ScriptModules)'); now it labels the scripted
    call's nodes through the global module hooks and names it, on the planted row."""
    bad_step, bad_row = 2, 1
    model = M.make_norm_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.log_target_mse, out_dir=tmp_path,
                            factory="scripted_models:make_norm_model") as rec:
            for step in range(4):
                x, y = M.batch(step, n=6)
                x = x[:, :4].clone()
                if step == bad_step:
                    x[bad_row] = 0.0  # the plant: an all-zero record
                opt.zero_grad()
                rec.loss_fn(model(x), y.abs() + 0.5).backward()
                opt.step()
    assert (info.value.event["step"], info.value.event["phase"]) == (bad_step, "backward")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert rep["reproduced"] is True, rep
    assert (o["module"], o["op"], o["samples"]) == ("norm", "SqrtBackward0", [bad_row]), o
    assert rep["cause"] == "invalid", (rep["cause"], rep["hint"])

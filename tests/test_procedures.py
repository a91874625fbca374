"""End to end: optimizers and training procedures that are not a plain ``loss.backward();
opt.step()`` (hand-written LAMB, SAM), recorded and replayed as a user runs them."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import procedure_models as M
import pytest
import torch
import torch.nn.functional as F
from bundles import invoke_cli

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle
from replay.load import read_step
from replay.rebuild import build
from replay.window import Change, run_window, window_of

HERE = Path(__file__).parent
AUX_FROM = 6  # the step from which the loop adds the auxiliary head's loss


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def _train_lamb(out_dir, **kw) -> NonFiniteError:
    """zero_grad(set_to_none=False) and an auxiliary loss from step 6: the zero-initialised
    aux head's gradient is exactly 0 there (its output is 0), and so are its weights."""
    model = M.TwoHead()
    opt = M.LAMB(model.parameters())
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=out_dir, factory="procedure_models:"
                            "make_lamb_two_head", **kw):
            for step in range(AUX_FROM + 2):
                x, y = M.batch(step)
                opt.zero_grad(set_to_none=False)
                out, aux = model(x)
                loss = F.cross_entropy(out, y)
                if step >= AUX_FROM:
                    loss = loss + aux.pow(2).mean()
                loss.backward()
                opt.step()
    return info.value


@pytest.mark.parametrize("kw", [{"guard_optimizer": True}, {"rewind": 4}])
def test_a_trust_ratio_of_0_by_0_names_the_division_and_tries_no_rate(out_dir, kw):
    """LAMB's ||w|| / ||update|| of a zero-initialised head with no gradient is 0/0. The hint
    said to check the learning rate, eps and clipping, and --try auto tried lr=0.1x and
    clip=1.0, which scale the same 0/0. It now names the division's values and says that no
    rate changes them, and auto tries neither."""
    err = _train_lamb(out_dir, **kw)
    assert (err.event["step"], err.event["phase"]) == (AUX_FROM, "optimizer"), err.event
    res = invoke_cli(err.bundle_path, "--json", "--try", "auto")
    rep = json.loads(res.stdout)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["param"]) == \
        (True, "optimizer", "aten.div", "aux.weight"), json.dumps(rep, indent=1)
    assert set(o["params"]) == {"aux.weight", "aux.bias"}, o
    assert o["domain"].startswith("aten.div of 0 by 0 (0/0)"), o
    path, _, line = o["source"].rpartition(":")
    assert path.endswith("procedure_models.py") and "trust = p.norm() / update.norm()" in \
        (HERE / "procedure_models.py").read_text().splitlines()[int(line) - 1], o
    hint = rep["hint"]
    assert "0 by 0" in hint and "whatever the learning rate" in hint, hint
    assert "check the learning rate" not in hint, hint
    assert not [t for t in rep["what_if"] if t["try"] in ("lr=0.1x", "clip=1.0")], rep["what_if"]


UNLABELLED = 5  # the step whose batch holds no labelled row


def _train_sam(out_dir, eps: float, steps: int = 8, record: bool = True):
    """SAM over SGD, a semi-supervised loss: at step UNLABELLED no row is labelled, the loss is
    0 and so is every gradient, and without eps the ascent's rho / ||g|| is inf (0 * inf)."""
    model = M.MLP()
    sam = M.SAM(model.parameters(), torch.optim.SGD, eps=eps, lr=0.1, momentum=0.9)
    rec = FlightRecorder(model, sam.base_optimizer, loss_fn=M.labelled_ce, out_dir=out_dir,
                         factory="procedure_models:make_mlp")
    loss_fn = rec.loss_fn if record else M.labelled_ce
    with rec if record else contextlib.nullcontext():
        for step in range(steps):
            x, y = M.batch(step)
            labelled = torch.full((len(y),), float(step != UNLABELLED))
            loss_fn(model(x), y, labelled).backward()
            sam.first_step()
            loss_fn(model(x), y, labelled).backward()  # at w + e
            sam.second_step()
    return model


def test_sam_ascent_of_a_zero_gradient_names_the_move(out_dir):
    """The ascent divides by the norm of a gradient that is exactly 0: the second forward ran on
    NaN weights, restored before the base optimizer's step(). The replay re-ran that forward
    on the restored weights and said NOT reproduced, blaming "state outside the model". The
    recorder now marks a micro-batch that ran on weights the loop moved, and the replay says
    the move made them non-finite from gradients that were all 0."""
    with pytest.raises(NonFiniteError) as info:
        _train_sam(out_dir, eps=0.0)
    ev = info.value.event
    # (+1: the first iteration's move, before any step() of the base optimizer, split it in two
    # steps; see the guide)
    assert (ev["step"], ev["phase"], ev["module"], ev["micro_batch"]) == \
        (UNLABELLED + 1, "forward", "fc1", 1), ev
    res = invoke_cli(info.value.bundle_path, "--json")
    rep = json.loads(res.stdout)
    assert res.exit_code == 1 and rep["reproduced"] is False, rep
    o = rep["origin"]
    assert (o["phase"], o["module"], o["micro_batch"], rep["cause"]) == \
        ("forward", "fc1", 1, "weights"), json.dumps(rep, indent=1)
    assert "were all exactly 0" in rep["hint"] and "rho / (||g|| + 1e-12)" in rep["hint"], rep
    assert any("moved in place" in p for p in rep["problems"]), rep["problems"]


def test_sam_with_eps_trains_as_without_the_recorder(out_dir):
    """With eps, the same loop trains on through the unlabelled batch: no event, and the
    weights are those of the loop without the recorder."""
    torch.manual_seed(0)
    bare = _train_sam(out_dir, eps=1e-12, record=False)
    torch.manual_seed(0)
    recorded = _train_sam(out_dir, eps=1e-12)
    for a, b in zip(bare.parameters(), recorded.parameters()):
        assert torch.equal(a, b)


BAD_RECORD = 11  # the step whose batch holds a NaN (sample 2)


def test_lookahead_window_invents_no_gradient_clipping(out_dir):
    """Lookahead around Adam, recorded with rewind=4; the loop clips nothing. The bundle holds
    the wrapper's state (the slow weights) and not its inner Adam's moments, so the window's
    re-run leaves training's path after the copy, and a gradient norm larger than the recorded
    one was read as the loop's clip_grad_norm_: the window said "the loop's gradient clipping
    to norm 0.71 re-applied", scaled its gradients to the recorded norms, and every what-if
    clipped to 0.71. A norm is now read as a clip only where the re-run's loss is the
    recorded one, as a clip (after the loss) leaves it."""
    model = M.MLP()
    opt = M.Lookahead(torch.optim.Adam(model.parameters(), lr=1e-3))
    crit = torch.nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, rewind=4,
                            factory="procedure_models:make_lookahead_mlp"):
            for step in range(BAD_RECORD + 1):
                x, y = M.batch(step)
                if step == BAD_RECORD:
                    x[2] = float("nan")
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    assert (info.value.event["step"], info.value.event["phase"]) == (BAD_RECORD, "input")
    res = invoke_cli(info.value.bundle_path, "--json")
    rep = json.loads(res.stdout)
    assert (rep["cause"], rep["origin"]["samples"]) == ("input", [2]), rep["origin"]
    assert rep["window"]["reproduced"] and rep["window"]["loop_clip"] is None, rep["window"]


def test_lookahead_inner_adam_state_is_bundled_and_the_window_follows_training(out_dir):
    """The bundle and the rewind copy held the wrapper's state (the slow weights) and not its
    inner Adam's moments, so the window's Adam restarted from zero moments and its losses
    left training's after the copy. The inner optimizer's state is now kept beside the
    wrapper's (``base::exp_avg``) and put back into the factory's wrapper's base optimizer:
    the window's losses are the recorded ones."""
    model = M.MLP()
    opt = M.Lookahead(torch.optim.Adam(model.parameters(), lr=1e-3))
    crit = torch.nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, rewind=4,
                            factory="procedure_models:make_lookahead_mlp"):
            for step in range(BAD_RECORD + 1):
                x, y = M.batch(step)
                if step == BAD_RECORD:
                    x[2] = float("nan")
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    meta, tensors = read_bundle(info.value.bundle_path)
    assert "optim/fc1.weight/base::exp_avg" in tensors, sorted(tensors)
    rep = json.loads(invoke_cli(info.value.bundle_path, "--json").stdout)
    ring = dict(zip(tensors["ring/steps"].tolist(), tensors["ring/loss"].tolist()))
    got = [(s["step"], s["loss"]) for s in rep["window"]["per_step"] if s["step"] < BAD_RECORD]
    assert len(got) >= 4 and all(v == pytest.approx(ring[k], rel=1e-6) for k, v in got), \
        (got, ring)


def _train_no_decay_groups(out_dir, wd_from: tuple[int, float] | None = None):
    """AdamW over the usual recipe's groups: weights decayed, biases not; a NaN record at
    BAD_RECORD. ``wd_from=(k, wd)``: the decayed group's weight decay is ``wd`` from step k (a
    run without the recorder, whose weight norms after each update it returns)."""
    model = M.MLP()
    opt = torch.optim.AdamW([{"params": [model.fc1.weight, model.fc2.weight],
                              "weight_decay": 0.05},
                             {"params": [model.fc1.bias, model.fc2.bias], "weight_decay": 0.0}],
                            lr=0.05)
    crit = torch.nn.CrossEntropyLoss()
    norms = {}
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, rewind=4,
                         factory="procedure_models:make_mlp")
    with rec if wd_from is None else contextlib.nullcontext():
        for step in range(BAD_RECORD + 1 if wd_from is None else BAD_RECORD):
            if wd_from is not None and step == wd_from[0]:
                opt.param_groups[0]["weight_decay"] = wd_from[1]
            x, y = M.batch(step)
            if step == BAD_RECORD:
                x[2] = float("nan")
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()
            norms[step] = float(torch.stack([p.detach().double().norm()
                                             for p in model.parameters()]).norm())
    return norms


def test_try_wd_leaves_the_no_decay_groups_undecayed(out_dir):
    """--try wd=0.3 set every group's weight decay, the biases' no-decay group's too: the try
    re-ran another recipe than the run's with wd=0.3. It now changes the decayed groups only,
    and its steps train as the run does with that weight decay."""
    with pytest.raises(NonFiniteError) as info:
        _train_no_decay_groups(out_dir)
    step = read_step(info.value.bundle_path)
    build(step, None, None, None)
    win = window_of(step)
    res = run_window(step, win, Change(weight_decay=0.3))  # what --try wd=0.3 re-runs
    torch.manual_seed(0)
    want = _train_no_decay_groups(out_dir, wd_from=(win.copy_step, 0.3))
    got = {s["step"]: s["param_norm"] for s in res.per_step if s["param_norm"] is not None}
    assert got and set(got) <= set(want), (got, want)
    for k, v in got.items():
        assert v == pytest.approx(want[k], rel=1e-5), (k, got, want)


def test_a_sam_window_says_its_re_run_trains_the_base_optimizer_alone(out_dir):
    """A window over SAM's steps re-runs each step's two forwards on the weights as they were
    (the bundle holds no ascent) and updates with the gradients there: the window and its
    what-ifs train plain SGD, not SAM, which the report did not say."""
    model = M.MLP()
    sam = M.SAM(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    crit = torch.nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, sam.base_optimizer, loss_fn=crit, out_dir=out_dir,
                            rewind=4, factory="procedure_models:make_mlp"):
            for step in range(BAD_RECORD):
                x, y = M.batch(step)
                if step == BAD_RECORD - 1:
                    x[2] = float("nan")
                crit(model(x), y).backward()
                sam.first_step()
                crit(model(x), y).backward()
                sam.second_step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["samples"]) == (BAD_RECORD, "input", [2]), ev
    rep = json.loads(invoke_cli(info.value.bundle_path, "--json", "--try", "lr=0.1x").stdout)
    assert rep["cause"] == "input" and rep["window"]["reproduced"], rep["window"]
    notes = [p for p in rep["problems"] if "moved the weights in place" in p]
    assert len(notes) == 1 and "base optimizer alone" in notes[0], rep["problems"]
    assert "note" not in rep["what_if"][0], rep["what_if"]  # (said once, in the report)

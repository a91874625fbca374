"""Current optimizers as their repositories write them (``modern_optimizers_models``:
schedule-free AdamW with its ``optimizer.train()`` / ``optimizer.eval()`` swaps, Lion, Muon beside
AdamW), trained under the recorder with their schedulers and validation loops until a planted
bug fires, then replayed with the CLI."""

from __future__ import annotations

import logging
from pathlib import Path

import modern_optimizers_models as M
import pytest
import torch
from bundles import line_number, nanreplay_json
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from replay.report import to_text

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> int:
    return line_number("modern_optimizers_models.py", text)


def _epochs(model, opt, factory: str, epochs: int, n: int = 256, sched=None,
            validate: bool = False, **kw) -> NonFiniteError | None:
    """schedule_free's examples' loop: ``model.train(); optimizer.train()`` before each epoch,
    the scheduler stepped per batch, and (``validate``) ``model.eval(); optimizer.eval()``
    and a no-grad pass over the held-out batches after it. None when no event fired."""
    crit = nn.CrossEntropyLoss()
    swaps = hasattr(opt, "eval")
    try:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=kw.pop("out_dir"),
                            factory=f"modern_optimizers_models:{factory}", **kw):
            for _ in range(epochs):
                model.train()
                if swaps:
                    opt.train()
                for x, y in M.loader(n=n):
                    opt.zero_grad()
                    crit(model(x), y).backward()
                    opt.step()
                    if sched is not None:
                        sched.step()
                if validate:
                    model.eval()
                    if swaps:
                        opt.eval()
                    with torch.no_grad():
                        for x, y in M.loader(n=64, batch_size=64):
                            crit(model(x), y)
    except NonFiniteError as e:
        return e
    return None


def _warm_then_cosine(opt):
    """A linear warm-up from 0 (LambdaLR s / 4: lr 0 at step 0) chained to a cosine decay."""
    sched = torch.optim.lr_scheduler
    return sched.SequentialLR(opt, [sched.LambdaLR(opt, lambda s: s / 4),
                                    sched.CosineAnnealingLR(opt, T_max=20)], milestones=[4])


HEALTHY = {
    # optimizer.eval() / optimizer.train() rewrite every weight outside step(), around each
    # epoch's validation, with rewind copies taken across them
    "schedule-free": (lambda m: M.AdamWScheduleFree(m.parameters(), lr=0.01), None),
    "lion-one-cycle": (lambda m: M.Lion(m.parameters(), lr=1e-4, weight_decay=0.1,
                                        decoupled_weight_decay=True),
                       lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=3e-4,
                                                                     total_steps=24)),
    # lr 0 at step 0: Prodigy's d_denom is 0 and it returns without an update
    "prodigy-warmup": (lambda m: M.Prodigy(m.parameters(), weight_decay=0.01),
                       _warm_then_cosine),
    "muon-aux-adam": (lambda m: M.MuonWithAuxAdam(M.muon_groups(m)), None),
    "adopt": (lambda m: M.ADOPT(m.parameters(), lr=1e-3), None),
}


@pytest.mark.parametrize("name", list(HEALTHY))
def test_healthy_runs_with_their_schedulers_and_validation_are_no_event(out_dir, caplog, name):
    """Each optimizer as its repository's examples train it (validation after each epoch,
    the scheduler stepped per batch), under a rewind window: no event, no warning."""
    make_opt, make_sched = HEALTHY[name]
    model = M.make_model()
    opt = make_opt(model)
    sched = make_sched(opt) if make_sched is not None else None
    with caplog.at_level(logging.WARNING):
        err = _epochs(model, opt, "make_model", 3, n=256, sched=sched, validate=True,
                      out_dir=out_dir, rewind=3)
    assert err is None, err.event
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert not list(Path(out_dir).glob("*.nan"))
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("per_epoch", [2, 1], ids=["in-epoch", "before-validation"])
def test_schedule_free_eps_0_update_is_re_run_from_the_window(out_dir, per_epoch):
    """Schedule-free AdamW with eps=0 and modded-nanogpt's zero-initialised c_proj: c_fc's
    gradient is exactly 0 at step 0, and grad.div_(denom) is 0/0. The window's re-run kept a
    reference to p.grad, which that in-place div_ had turned NaN, so the update re-run under
    the op finder started from NaN gradients and named no op. With one batch per epoch, the
    validation after the update (optimizer.eval(), a no-grad pass) found the NaN weights: the
    report said 'evaluation forward before step 0', the update came before it, and skipped
    the window ('NOT reproduced ... record with guard_optimizer=True')."""
    model = M.make_model()
    opt = M.AdamWScheduleFree(model.parameters(), lr=0.01, eps=0.0)
    err = _epochs(model, opt, "make_schedule_free", 2, n=32 * per_epoch, validate=True,
                  out_dir=out_dir, rewind=4)
    ev = err.event
    assert (ev["step"], ev["phase"], ev["params"]) == \
        (0, "optimizer", ["blocks.0.c_fc.weight", "blocks.1.c_fc.weight"]), ev
    assert bool(ev.get("evaluation")) == (per_epoch == 1), ev
    rep = nanreplay_json(err.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["param"], o["op"], o["made"]) == \
        (True, "optimizer", "blocks.0.c_fc.weight", "aten.div_", "nan"), o
    assert o["source"] == f"modern_optimizers_models.py:{line_of('grad.div_(denom)')}"
    assert "AdamWScheduleFree's update at step 0" in rep["hint"], rep["hint"]
    assert "set eps > 0" in rep["hint"], rep["hint"]
    tries = {t["try"]: t["finite"] for t in rep["what_if"]}
    assert tries == {"lr=0.1x": False, "clip=1.0": False, "eps=1e-8": True}, tries
    want = ("step 0 (found by the evaluation forward after its update), optimizer event"
            if per_epoch == 1 else "step 0, optimizer event")
    assert to_text(rep).splitlines()[0] == f"nanreplay: {want} — reproduced", to_text(rep)


@pytest.mark.parametrize("rewind", [6, None], ids=["window", "no-window"])
def test_lion_decoupled_decay_past_one_cycle_s_peak_names_the_decay_not_clipping(out_dir,
                                                                                  rewind):
    """lion-pytorch's decoupled_weight_decay=True divides weight_decay by the constructor's
    lr (1e-4); OneCycleLR then raises the rate to 1e-2, so p.mul_(1 - lr * wd) multiplies
    the weights by about -9 each step and the forward overflows. The hint said 'lower the
    learning rate or clip the gradients' though Lion's sign update ignores the gradients'
    scale (the clip what-if stays NaN); it names the factor, its line and weight_decay, seen
    in the window's updates, or without a window in one update re-run from the bundle."""
    model = M.make_model()
    opt = M.Lion(model.parameters(), lr=1e-4, weight_decay=0.1, decoupled_weight_decay=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=80)
    err = _epochs(model, opt, "make_lion", 10, sched=sched, out_dir=out_dir,
                  **({"rewind": rewind} if rewind else {}))
    assert err is not None and err.event["phase"] == "forward", err
    at = err.event["step"]
    rep = nanreplay_json(err.bundle_path, *(["--try", "auto"] if rewind else []))
    assert (rep["reproduced"], rep["cause"]) == (True, "overflow"), rep["origin"]
    hint = rep["hint"]
    lead = ("each update multiplied" if rewind else
            "the update, re-run once from the bundle with gradients of 0, multiplies")
    assert f"{lead} embed.weight by -" in hint, hint
    assert f"modern_optimizers_models.py:{line_of('p.data.mul_(1. - lr * wd)')}" in hint, hint
    assert "clipping them does not stop it" in hint and "lower weight_decay" in hint, hint
    assert "or clip the gradients" not in hint, hint
    if rewind:
        assert rep["window"]["reproduced"] and rep["window"]["event_step"] == at
        tries = {t["try"]: t["finite"] for t in rep["what_if"]}
        # (auto proposes no clip for a sign update: replay.update_bound)
        assert "clip=1.0" not in tries and tries["wd=0"] is True, tries
    else:
        assert "rewind=N) so that --try wd=0" in hint, hint


def test_prodigy_in_float16_weights_is_not_told_an_eps_that_d_scales_away(out_dir):
    """Prodigy over weights kept in float16 (a LoRA trained in pure half precision): its
    denominator is sqrt(v) + d * eps with d = d0 = 1e-6 at first, and v = d**2 * g**2, both 0
    in float16, so every update is 0/0. The hint proposed 'or set eps=1e-4' (float16's
    smallest normal), which d scales to 1e-10, 0 in float16 again (that what-if stays NaN);
    it now re-runs the update with that eps first and keeps only the float32 advice."""
    model = M.make_model().half()
    opt = M.Prodigy(model.parameters(), lr=1.0)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, guard_optimizer=True,
                            factory="modern_optimizers_models:make_prodigy_half"):
            for x, y in M.loader():
                opt.zero_grad()
                crit(model(x.half()).float(), y).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["params"][0]) == (0, "optimizer", "embed.weight"), ev
    rep = nanreplay_json(info.value.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["made"]) == \
        (True, "optimizer", "aten.addcdiv_", "nan"), o
    assert o["source"] == f"modern_optimizers_models.py:{line_of('addcdiv_(state[')}"
    hint = rep["hint"]
    assert "keep the weights and optimizer state in float32" in hint, hint
    assert "or set eps=1e-4" not in hint and "eps=1e-4 does not help" in hint, hint
    assert "d * eps" in hint, hint
    tries = {t["try"]: t["finite"] for t in rep["what_if"]}
    assert tries["eps=1e-4"] is False and tries["dtype=float32"] is True, tries


def test_adopt_state_overflowing_float16_is_not_called_a_pole(out_dir):
    """ADOPT (first version) over float16 weights behind modded-nanogpt's zero-initialised
    c_proj: c_fc's gradient is 0 at step 0, where ADOPT only sets v = g**2 = 0, so its later
    g / max(sqrt(v), eps=1e-6) is g * 1e6, past float16's 65504. The hint read addcdiv_'s
    accumulator's zeros as its divisor ('aten.addcdiv_ of 0 (at a pole ...): clamp the op's
    input away from the pole or add an eps'): the divisor was the eps itself."""
    model = M.make_model().half()
    opt = M.ADOPT(model.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, guard_optimizer=True,
                            factory="modern_optimizers_models:make_adopt_half"):
            for x, y in M.loader():
                opt.zero_grad()
                crit(model(x.half()).float(), y).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["params"]) == \
        (2, "optimizer", ["blocks.0.c_fc.weight"]), ev
    rep = nanreplay_json(info.value.bundle_path, "--try", "lr=0.1x", "--try", "dtype=float32")
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["made"]) == \
        (True, "optimizer", "aten.addcdiv_", "-inf"), o
    assert o["source"] == \
        f"modern_optimizers_models.py:{line_of('exp_avg.mul_(beta1).addcdiv_(grad')}"
    hint = rep["hint"]
    assert "passed float16's largest value" in hint, hint
    assert "keep the weights and optimizer state in float32" in hint, hint
    assert "at a pole" not in hint and "add an eps" not in hint, hint
    assert "check the learning rate" not in hint, hint
    tries = {t["try"]: t["finite"] for t in rep["what_if"]}
    assert tries == {"lr=0.1x": False, "dtype=float32": True}, tries
    # --try auto proposes the type the hint names, besides the rate and the clip
    auto = nanreplay_json(info.value.bundle_path, "--try", "auto")
    tries = {t["try"]: t["finite"] for t in auto["what_if"]}
    assert tries["dtype=float32"] is True and tries["lr=0.1x"] is False, tries


def test_muon_without_newton_schulz_eps_names_the_zero_gradient_and_zero_init(out_dir):
    """Muon with its Newton-Schulz normalisation's eps dropped (X / X.norm()) over
    modded-nanogpt's MLP, whose c_proj is zero-initialised: c_fc gets a gradient of exactly 0
    at step 0, and 0 / 0 is NaN. The hint gave only the generic trust-ratio words; it now
    says that c_fc's whole gradient was 0 and which weights are all 0 (the zero init)."""
    model = M.make_model()
    opt = M.MuonWithAuxAdam(M.muon_groups(model), ns_eps=0.0)
    err = _epochs(model, opt, "make_muon0", 1, out_dir=out_dir, guard_optimizer=True)
    ev = err.event
    assert (ev["step"], ev["phase"], ev["params"]) == \
        (0, "optimizer", ["blocks.0.c_fc.weight", "blocks.1.c_fc.weight"]), ev
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["made"]) == \
        (True, "optimizer", "aten.div", "nan"), o
    assert o["source"] == f"modern_optimizers_models.py:{line_of('X = X / (X.norm(')}"
    hint = rep["hint"]
    assert "aten.div of 0 by 0" in hint, hint
    assert "blocks.0.c_fc.weight's gradient was exactly 0 in every element at step 0" in hint
    assert "blocks.0.c_proj.weight, blocks.1.c_proj.weight are all 0 in the bundle" in hint


def test_muon_beside_adamw_as_two_optimizers_blames_the_unrecorded_one(out_dir):
    """Muon's README with two optimizers: Muon over the hidden matrices, AdamW over the rest,
    the recorder given AdamW and stepping it first (as the guide says). Muon's 0/0 (its eps
    dropped) writes NaN into c_fc after the recorded step closed: step 1's check finds
    weights AdamW does not hold non-finite, and the report blames another optimizer's
    step(), not the weights' loading or the forward."""
    model = M.make_model()
    groups = M.muon_groups(model)
    muon = M.MuonWithAuxAdam([groups[0]], ns_eps=0.0)
    adamw = torch.optim.AdamW(groups[1]["params"], lr=3e-4, betas=(0.9, 0.95),
                              weight_decay=0.01)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, adamw, loss_fn=crit, out_dir=out_dir,
                            factory="modern_optimizers_models:make_model"):
            for x, y in M.loader():
                for o in (adamw, muon):
                    o.zero_grad()
                crit(model(x), y).backward()
                for o in (adamw, muon):
                    o.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["params"]) == \
        (1, "weights", ["blocks.0.c_fc.weight", "blocks.1.c_fc.weight"]), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["param"], o["module"]) == \
        (True, "weights", "blocks.0.c_fc.weight", "blocks.0.c_fc"), o
    assert "the recorded optimizer (torch.optim.adamw.AdamW) does not hold them" in rep["hint"]
    assert "another optimizer's step() wrote them" in rep["hint"], rep["hint"]


def test_schedule_free_wrapper_is_refused_with_how_to_record_it(out_dir, caplog):
    """schedule_free's ScheduleFreeWrapper (any base optimizer made schedule-free) is no
    torch.optim.Optimizer: it swaps z into the weights around base.step(). The refusal said
    only 'pass None for loops without one'; it now names the optimizer it holds (.base), and
    the route it gives (optimizer=None, rec.end_step() before its step()) trains through its
    train/eval swaps with no event and no warning."""
    model = M.make_model()
    opt = M.ScheduleFreeWrapper(torch.optim.SGD(model.parameters(), lr=0.1),
                                momentum=0.9, weight_decay_at_y=0.1)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(TypeError) as info:
        FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir)
    msg = str(info.value)
    assert "got ScheduleFreeWrapper, which holds one as .base" in msg, msg
    assert "optimizer=None and rec.end_step() after backward, before its step()" in msg, msg
    with caplog.at_level(logging.WARNING):
        with FlightRecorder(model, None, loss_fn=crit, out_dir=out_dir,
                            factory="modern_optimizers_models:make_model") as rec:
            for _ in range(2):
                model.train()
                opt.train()
                for x, y in M.loader(n=128):
                    opt.zero_grad()
                    crit(model(x), y).backward()
                    rec.end_step()
                    opt.step()
                model.eval()
                opt.eval()
                with torch.no_grad():
                    x, y = next(iter(M.loader(n=64, batch_size=64)))
                    crit(model(x), y)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert not list(Path(out_dir).glob("*.nan"))

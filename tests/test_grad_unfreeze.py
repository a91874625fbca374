"""Fine-tuning that changes which parameters train mid-run: ULMFiT's gradual unfreezing under
layer-wise learning-rate decay (a group per layer and per decay/no-decay, rates
``lr * decay**depth``), with every group in the optimizer from the start and a LambdaLR of one
lambda per group, or each block's groups added with ``add_param_group`` as it is unfrozen; the
head re-initialised mid-run with ``reset_parameters()``. Recorded and replayed as a user runs
them."""

from __future__ import annotations

import grad_unfreeze_models as GU
import pytest
import torch
from bundles import nanreplay_json
from torch import nn

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

EVERY, RESET, STEPS = 2, 7, 10  # a block unfrozen every EVERY steps; the head reset at RESET


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _run(out_dir=None, added=False, bad_lr=None, bad_init=None, steps=STEPS, reset=RESET):
    """AdamW; the head trains alone, then one block more every EVERY steps, from the top;
    ``added``: each block's groups given with add_param_group as it is unfrozen, else all
    groups from the start under a warm-up LambdaLR. The second block unfrozen gets ``bad_lr``
    for its weights' group (None: its LLRD rate); at ``reset`` the head is re-initialised, then
    given weights of std ``bad_init`` (None: as reset). Returns (losses, error or None,
    {"group", "block", "at"}: the second unfrozen block's weight group, index, step)."""
    model = GU.make()
    model.requires_grad_(False)
    model.head.requires_grad_(True)
    layers = GU.layers(model)
    depths = range(1) if added else range(len(layers))
    opt = torch.optim.AdamW([g for d in depths for g in GU.llrd_groups(layers[d], d)])
    sched = None if added else torch.optim.lr_scheduler.LambdaLR(
        opt, [lambda s: min(1.0, (s + 1) / 4)] * len(opt.param_groups))
    crit, losses, plant = nn.CrossEntropyLoss(), [], {}
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, rewind=8,
                         factory="grad_unfreeze_models:make") if out_dir else _nothing()
    try:
        with rec:
            for step in range(steps):
                if step and step % EVERY == 0 and step // EVERY <= GU.BLOCKS:
                    depth = step // EVERY
                    layers[depth].requires_grad_(True)
                    if added:
                        for g in GU.llrd_groups(layers[depth], depth):
                            opt.add_param_group(g)
                    if depth == 2:
                        plant = {"group": 2 * depth, "block": GU.BLOCKS - depth, "at": step}
                        if bad_lr is not None:
                            opt.param_groups[2 * depth]["lr"] = bad_lr
                            if sched is not None:
                                sched.base_lrs[2 * depth] = bad_lr
                if step == reset:
                    model.head.reset_parameters()
                    if bad_init is not None:
                        nn.init.normal_(model.head.weight, std=bad_init)
                x, y = GU.batch(step)
                opt.zero_grad()
                loss = crit(model(x), y)
                loss.backward()
                opt.step()
                if sched is not None:
                    sched.step()
                losses.append(loss.item())
    except NonFiniteError as e:
        return losses, e, plant
    return losses, None, plant


@pytest.mark.parametrize("added", [False, True])
def test_gradual_unfreezing_under_llrd_trains_as_without_the_recorder(out_dir, caplog, added):
    """Blocks unfrozen one by one (their groups in the optimizer from the start, or added as
    they unfreeze), a LambdaLR per group, the head reset mid-run: the losses are bit-identical,
    nothing is an event and nothing is warned."""
    plain = _run(added=added)[0]
    caplog.set_level("WARNING")
    losses, err, _ = _run(out_dir, added=added)
    assert err is None and losses == plain
    assert not (out_dir.exists() and list(out_dir.glob("*.nan")))
    assert not [r for r in caplog.records if r.levelno >= 30], caplog.text


def test_group_added_at_unfreezing_with_a_rate_far_too_high_is_tried_back_alone(out_dir):
    """The second unfrozen block's weights group added with a rate of 1e8: its AdamW decay
    flips and grows that block's weights until its LayerNorm overflows. The window's start of
    the trouble was the weight norm, the added group having no rate before; it is now that
    group's rate against the other groups', and auto tries it back for that group alone.
    The block's own LLRD rate for that group alone re-runs what the run trains without the
    plant."""
    _, err, plant = _run(out_dir, added=True, bad_lr=1e8, reset=None)  # (no write to redo)
    g, at = plant["group"], plant["at"]
    ev = err.event
    assert ev["step"] > at and ev["phase"] == "forward"
    right = GU.LR * GU.DECAY ** 2
    rep = nanreplay_json(err.bundle_path, "--try", "auto", "--try", f"lr[{g}]={right}")
    assert rep["cause"] == "overflow" and rep["reproduced"]
    assert rep["origin"]["module"] == f"blocks.{plant['block']}.norm"
    began = rep["window"]["precursors_began"]
    assert (began["step"], began["kind"], began["group"]) == (at, "lr_jump", g)
    assert f"of a group added at step {at}" in began["detail"]
    tries = {t["try"]: t for t in rep["what_if"]}
    others = sorted(GU.LR * GU.DECAY ** d for d in (0, 0, 1, 1, 2))  # the groups beside g
    auto = tries[f"lr[{g}]={others[2]:.3g}"]
    assert auto["finite"] is True and not auto["inconclusive"]
    healthy = _run(added=True, steps=ev["step"] + 1, reset=None)[0]
    fixed = tries[f"lr[{g}]={right}"]
    assert fixed["finite"] is True and fixed["loss"] == healthy[ev["step"]]


def test_head_reinitialised_with_a_bad_init_names_that_write(out_dir):
    """The head reset mid-run, then given weights of std 1e38: its addmm overflows at once.
    The hint said to rescale the op's inputs or compute in float64, and the window, which does
    not redo the reset, only that the event did not come back. Both now name the head's
    weights as the loop wrote them after the last update."""
    _, err, _ = _run(out_dir, bad_init=1e38)
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"]) == (RESET, "forward", "head")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["module"], o["op"], o["samples"]) == \
        ("overflow", "head", "aten.addmm", list(range(8)))
    assert f"head.weight is not what step {RESET - 1}'s update left" in rep["hint"]
    assert "float64" not in rep["hint"]
    assert not rep["window"]["reproduced"]
    note = next(p for p in rep["problems"] if "does not come back" in p)
    assert "the loop wrote head.weight (norm" in note
    assert f"between step {RESET - 1}'s update and step {RESET}'s forward" in note

"""End to end: training code that rewrites gradients with module backward pre-hooks
(``register_full_backward_pre_hook``) and installs torch's global module hooks
(``backward_pre_hooks_models``): DANN's gradient reversal with lambda from the paper's
schedule, a per-module gradient normaliser over a dead ReLU branch, logging through
``register_module_forward_hook`` / ``register_module_full_backward_hook``. Planted bugs are
named with their step, module, op, samples, cause and the hook's line; a healthy run under the
global hooks trains bit-identically with and without the recorder."""

from __future__ import annotations

import pytest
import torch
from backward_pre_hooks_models import (
    DANNLoss,
    GlobalLogger,
    batches,
    dann_lambda,
    data,
    grl_hook,
    make_dann,
    make_grl_dann,
    make_normalised_dann,
    make_std_dann,
)
from bundles import nanreplay_json, source_line
from torch.nn.modules import module as torch_module

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

MODELS = "backward_pre_hooks_models.py"
# (torch's own warning when a global full backward hook meets the first layer, whose input
# needs no gradient: it fires with and without the recorder)
FIRST_LAYER = "ignore:Full backward hook is firing:UserWarning"


def _train(model, out_dir, *, factory, total=4, schedule=None, each_step=None, epochs=2,
           record=True, stuck=None):
    """DANN's loop (SGD): the losses, or the recorder's ``NonFiniteError``. ``schedule``:
    the dict the reversal hook reads lambda from, set each step from ``dann_lambda(step,
    total)``; ``each_step(step, model)`` runs before each step's forward; ``stuck``: a feature
    column that holds 2.0 in every record (a stuck sensor)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = DANNLoss()
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, factory=factory) \
        if record else None
    losses, step, xs = [], 0, data()
    if stuck is not None:
        xs[0][:, stuck] = 2.0
    try:
        if rec is not None:
            rec.attach()
        for _ in range(epochs):
            for x, y, d in batches(xs):
                if schedule is not None:
                    schedule["lambda"] = dann_lambda(step, total)
                if each_step is not None:
                    each_step(step, model)
                opt.zero_grad()
                loss = crit(model(x), y, d)
                loss.backward()
                opt.step()
                losses.append(loss.item())
                step += 1
        if rec is not None:
            rec.detach()
            assert rec.event is None
    except NonFiniteError as e:
        return e
    return losses


def _reversed_dann():
    model, schedule = make_dann(), {"lambda": 0.0}
    model.grl.register_full_backward_pre_hook(grl_hook(schedule))
    return model, schedule


def test_a_reversal_whose_schedule_made_lambda_nan_names_the_hook_and_the_value(tmp_path):
    """The script's gradient reversal (a backward pre-hook on ``grl``) with DANN's schedule
    over ``total = 0`` steps: ``p = 0 / 0`` at step 0, lambda NaN, every gradient into the
    feature extractor NaN. The factory's model has no hook, so the event does not come back;
    the report said a division by a gradient's norm of 0 made it. It names the pre-hook, its
    line and the NaN lambda its closure held."""
    model, schedule = _reversed_dann()
    err = _train(model, tmp_path, factory="backward_pre_hooks_models:make_dann", total=0,
                 schedule=schedule)
    rep = nanreplay_json(err.bundle_path, code=1)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["param"], rep["cause"]) == (
        0, "backward", "features.0.weight", "not_reproduced"), rep
    line = source_line(MODELS, 'return (-schedule["lambda"] * grad_output[0],)')
    hint = rep["hint"]
    assert f"grl's backward pre hook grl_hook.reverse ({line}" in hint, hint
    assert "schedule['lambda'] = nan" in hint and "norm that is 0" not in hint


def test_a_reversal_module_given_a_nan_lambda_is_named_in_the_hook(tmp_path):
    """A ``GradReverse`` module the factory builds, its pre-hook ``-m.lambd * grad``; the loop
    sets ``grl.lambd`` from the schedule over 0 steps at step 3: NaN. The report said aten.mul
    overflowed float32 and float64; it names grl's pre-hook, aten.mul of the NaN number, and
    grl.lambd."""
    def set_lambda(step, model):
        model.grl.lambd = dann_lambda(0, 0) if step == 3 else 0.5

    err = _train(make_grl_dann(), tmp_path, factory="backward_pre_hooks_models:make_grl_dann",
                 each_step=set_lambda)
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    line = source_line(MODELS, "(-m.lambd * grad_output[0],)")
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], o["source"],
            o["samples"], rep["cause"]) == (
        3, "backward", "grl", "aten.mul", line, list(range(16)), "invalid"), rep
    hint = rep["hint"]
    assert "backward pre-hook of module grl (register_full_backward_pre_hook)" in hint, hint
    assert "given NaN as a number" in hint and "grl.lambd is NaN" in hint
    assert "too large" not in hint


def test_a_gradient_normalising_pre_hook_over_a_dead_branch_is_named(tmp_path):
    """The factory registers ``g / g.norm()`` as a backward pre-hook on ``domain.0``; the loop
    sets its bias to -100 at step 2, the ReLU after it is dead, its gradient all 0: 0/0. The
    report named the parent ``domain`` and ``register_full_backward_hook``, and blamed a
    derivative's pole; it names domain.0's pre-hook, its aten.div and the 0 it was given."""
    def kill(step, model):
        if step == 2:
            with torch.no_grad():
                model.domain[0].bias.fill_(-100.0)

    err = _train(make_normalised_dann(), tmp_path,
                 factory="backward_pre_hooks_models:make_normalised_dann", each_step=kill)
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], o["source"],
            o["samples"], rep["cause"]) == (
        2, "backward", "domain.0", "aten.div", source_line(MODELS, "return (g / g.norm(),)"),
        list(range(16)), "invalid"), rep
    hint = rep["hint"]
    assert "backward pre-hook of module domain.0 (register_full_backward_pre_hook)" in hint
    assert "the gradient the hook was given is 0" in hint and "at the pole" not in hint, hint


def test_a_standardising_forward_pre_hook_of_a_layer_is_named_in_that_layer(tmp_path):
    """The factory puts a forward pre-hook on ``features.0`` dividing its input by a running
    std; column 3 is stuck at one value, its std 0: x / 0 there. The replay named the parent
    ``features``, whose call the hook's op ran in before the layer's own began; it names
    ``features.0``, the hook's aten.div and line, and the column. The recorder, which reads a
    call's inputs as its pre-hooks left them, named the root (its own code read as the
    maker); it names ``features.0`` too, so the replay reproduces it."""
    err = _train(make_std_dann(), tmp_path, factory="backward_pre_hooks_models:make_std_dann",
                 stuck=3)
    assert (err.event["phase"], err.event["module"]) == ("forward", "features.0"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], o["source"],
            o["samples"], rep["cause"]) == (
        0, "forward", "features.0", "aten.div", source_line(MODELS, "return (x / self.std,)"),
        list(range(16)), "invalid"), rep
    assert "column(s) [3]" in rep["hint"], rep["hint"]


@pytest.mark.filterwarnings(FIRST_LAYER)
def test_global_logging_hooks_over_a_reversal_train_bit_identically(tmp_path):
    """Global forward and full backward hooks that log every module's output and gradient, over
    the script's gradient reversal: the same losses and the same logged values with and without
    the recorder, no event, and no global hook left once the logger and the recorder are
    gone."""
    before = (len(torch_module._global_forward_hooks), len(torch_module._global_backward_hooks))

    def run(record):
        model, schedule = _reversed_dann()
        logger = GlobalLogger()
        try:
            losses = _train(model, tmp_path, factory="backward_pre_hooks_models:make_dann",
                            total=8, schedule=schedule, record=record)
        finally:
            logger.remove()
        return losses, logger.seen

    plain, recorded = run(False), run(True)
    assert isinstance(recorded[0], list), recorded[0]  # (no NonFiniteError)
    assert plain == recorded and len(plain[1]) > len(plain[0])
    assert (len(torch_module._global_forward_hooks),
            len(torch_module._global_backward_hooks)) == before

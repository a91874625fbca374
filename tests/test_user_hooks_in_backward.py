"""End to end: training code that uses PyTorch's hook machinery itself
(``user_hooks_in_backward_models``): the 'optimizer step in backward' tutorial (one Adam per
parameter stepped from ``register_post_accumulate_grad_hook``), tensor hooks on the parameters
that clamp or normalise gradients, a forward pre-hook standardising the input, forward hooks
adding feature noise or capturing activations for a penalty, ``torch.nn.utils.prune`` and the
old hook-based ``spectral_norm``, hooks removed mid-training. Healthy runs raise no event and
train bit-identically with and without the recorder; planted bugs are named with their step,
module or parameter, op, rows and cause."""

from __future__ import annotations

import pytest
import torch
import user_hooks_in_backward_models as M
from bundles import nanreplay_json, source_line
from torch import nn
from torch.nn.utils import prune

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

MODELS = "user_hooks_in_backward_models.py"
FACTORY = "user_hooks_in_backward_models:make_tabular"


def _adam(params, eps=1e-8):
    return torch.optim.Adam(params, lr=1e-2, eps=eps)


def _run(model, opt, data, out_dir, *, factory=FACTORY, loss_fn=None, epochs=2, amp=False,
         record=True, each_step=None):
    """Train ``model`` over ``data`` (``opt`` None: the model's hooks step it in backward);
    the recorder's ``NonFiniteError``, or the final weights when no event came."""
    crit = loss_fn or nn.CrossEntropyLoss()
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, factory=factory) \
        if record else None
    try:
        if rec is not None:
            rec.attach()
        step = 0
        for _ in range(epochs):
            for x, cat, y in M.loader(data):
                if each_step is not None:
                    each_step(step, model)
                if opt is not None:
                    opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
                    loss = crit(model(x, cat), y)
                loss.backward()
                if opt is not None:
                    opt.step()
                step += 1
        if rec is not None:
            rec.detach()
            assert rec.event is None
    except NonFiniteError as e:
        return e
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _healthy(kind, record, out_dir):
    """A loop of ``kind`` with no bug: ``in_backward`` (the tutorial's optimizer per parameter,
    its gradients clamped by tensor hooks) or ``hooks`` (one Adam; a feature-noise forward hook
    removed at step 10, pruning at step 4 made permanent at step 12, an input-normalising
    pre-hook, gradient clamping)."""
    model = M.make_tabular()
    data = M.tabular_data()
    torch.manual_seed(1)
    M.clamp_grads(model, 1.0)
    if kind == "in_backward":
        M.optim_in_backward(model, _adam)
        return _run(model, None, data, out_dir, record=record)
    M.normalise_inputs(model, data[0])
    noise = model.fc1.register_forward_hook(M.FeatureNoise(0.1))

    def surgery(step, model):
        if step == 4:
            prune.l1_unstructured(model.fc2, "weight", amount=0.3)
        if step == 10:
            noise.remove()
        if step == 12:
            prune.remove(model.fc2, "weight")

    return _run(model, _adam(model.parameters()), data, out_dir, record=record,
                each_step=surgery)


@pytest.mark.parametrize("kind", ["in_backward", "hooks"])
def test_hooked_training_without_a_bug_raises_no_event_and_trains_bit_identically(
        tmp_path, kind):
    """The user's hooks (optimizers stepped in backward, clamps, noise, pruning's pre-hook, a
    normalising pre-hook) compute the same with the recorder attached, and raise no event."""
    plain = _healthy(kind, False, tmp_path)
    recorded = _healthy(kind, True, tmp_path)
    assert isinstance(recorded, dict), recorded  # (no NonFiniteError)
    assert list(plain) == list(recorded)
    assert all(torch.equal(plain[n], recorded[n]) for n in plain)


def test_a_nan_record_under_an_optimizer_stepped_in_backward_is_an_input_event(tmp_path):
    """A missing feature read as NaN (record 70: step 2, row 6) under the tutorial's
    optimizer-in-backward: the event comes at the forward, before the hooks' updates."""
    model = M.make_tabular()
    M.optim_in_backward(model, _adam)
    err = _run(model, None, M.tabular_data(nan_row=70), tmp_path)
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["tensor"], o["samples"], rep["cause"]) == (
        2, "input", "args[0]", [6], "input"), rep
    assert "sample 6 at feature(s) 3" in rep["hint"]


def test_adam_eps0_stepped_in_backward_hooks_is_named_as_the_update(tmp_path):
    """Adam(eps=0) per parameter, stepped from post-accumulate-grad hooks: a dead unit's
    gradient of 0 at step 0 is 0/0 in the update, which ran inside backward. The report said
    the loop's own ``p -= lr * p.grad`` wrote the weights and to give the recorder the
    optimizer (there are 16); it names the hook, its line, Adam's eps=0, cause optimizer."""
    model = M.make_tabular()
    M.optim_in_backward(model, lambda ps: _adam(ps, eps=0.0))
    err = _run(model, None, M.tabular_data(), tmp_path)
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["param"], rep["cause"]) == (
        1, "weights", "fc2.weight", "optimizer"), rep
    hint = rep["hint"]
    assert f"optim_in_backward.step_hook ({source_line(MODELS, 'optimizers[p].step()')}" \
        in hint, hint
    assert "Adam(lr=0.01, eps=0.0, weight_decay=0) with eps=0" in hint
    assert "p -= lr * p.grad" not in hint and "give the recorder the optimizer" not in hint


def test_a_row_normalising_gradient_hook_the_script_registered_is_named(tmp_path):
    """The script registers ``g / g.norm(dim=1, keepdim=True)`` on every weight matrix: the
    embedding's row 9 (a code absent from the split) has a gradient of 0, 0/0. The replay's
    model has no hook, so the event does not come back; the report blamed 'the loop's own
    code between backward and step()' as a diagonal preconditioner (an illumination). It
    names the hook, its line, row 9 and the 0/0."""
    model = M.make_tabular()
    opt = _adam(model.parameters())
    M.normalise_grad_rows(model)
    err = _run(model, opt, M.tabular_data(), tmp_path)
    rep = nanreplay_json(err.bundle_path, code=1)  # (not reproduced: exit 1)
    o = rep["origin"]
    line = source_line(MODELS, "p.register_hook(lambda g: g / g.norm(")
    assert (rep["event"]["step"], o["phase"], o["param"], o["rows"], o["source"],
            rep["cause"], rep["reproduced"]) == (
        0, "backward", "cat_emb.weight", [9], line, "invalid", False), rep
    assert "hook the training code registered on it" in rep["hint"]
    assert "exactly 0" in rep["hint"] and "preconditioner" not in rep["hint"]


def test_a_normalising_pre_hook_over_a_constant_column_is_named_per_feature(tmp_path):
    """The user's forward pre-hook standardises the input with the training set's std, 0 for a
    stuck sensor's column 5: every row's column 5 is 0/0 before the model's first layer."""
    model = M.make_tabular()
    data = M.tabular_data(constant_col=5)
    M.normalise_inputs(model, data[0])
    err = _run(model, _adam(model.parameters()), data, tmp_path)
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["tensor"], len(o["samples"]), rep["cause"]) \
        == (0, "input", "args[0]", 32, "input"), rep
    assert "column(s) 5" in rep["hint"] and "zero std" in rep["hint"]


def test_old_spectral_norm_of_a_zero_initialised_head_is_named(tmp_path):
    """The hook-based ``spectral_norm`` recomputes the head's weight in a forward pre-hook as
    ``weight_orig / sigma``; the head was zero-initialised first, sigma = 0: 0/0."""
    model = M.make_sn_tabular()
    err = _run(model, _adam(model.parameters()), M.tabular_data(), tmp_path,
               factory="user_hooks_in_backward_models:make_sn_tabular")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], rep["cause"]) == (
        0, "forward", "head", "aten.div", "invalid"), rep
    assert "head.weight_orig is 0 everywhere" in rep["hint"]

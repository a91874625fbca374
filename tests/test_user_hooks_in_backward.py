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
    the recorder's ``NonFiniteError``, or the final state (weights and buffers) when no event
    came."""
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
    return {n: t.detach().clone() for n, t in model.state_dict().items()}  # (spectral_norm's u)


def _healthy(kind, record, out_dir):
    """A loop of ``kind`` with no bug: ``in_backward`` (the tutorial's optimizer per parameter,
    its gradients clamped by tensor hooks) or ``hooks`` (one Adam; a feature-noise forward hook
    removed at step 10, pruning at step 4 made permanent at step 12, an input-normalising
    pre-hook, the old hook-based spectral_norm and weight_norm, gradient clamping)."""
    model = M.make_tabular()
    data = M.tabular_data()
    torch.manual_seed(1)
    M.clamp_grads(model, 1.0)
    if kind == "in_backward":
        M.optim_in_backward(model, _adam)
        return _run(model, None, data, out_dir, record=record)
    M.normalise_inputs(model, data[0])
    nn.utils.spectral_norm(model.head)  # (the hook-based one: u, v power-iterated in training)
    nn.utils.weight_norm(model.fc1)  # (hook-based too: weight_g * weight_v / its norm)
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
    line = source_line(MODELS, "return (feats - mean) / std, cat")
    hook = f"forward pre-hook normalise_inputs.pre_hook ({line}"
    note = next(n for n in rep["problems"] if hook in n)
    assert "not as the loop passed them" in note and "a second time" not in note


def test_a_normalising_pre_hook_the_factory_registers_too_is_said_to_apply_twice(tmp_path):
    """The same pre-hook registered by the factory: the bundle's inputs are already its output
    (it runs before the recorder's pre-hook), which a re-run standardises again."""
    model = M.make_standardised_tabular()
    err = _run(model, _adam(model.parameters()), M.tabular_data(constant_col=5), tmp_path,
               factory="user_hooks_in_backward_models:make_standardised_tabular")
    rep = nanreplay_json(err.bundle_path)
    assert (rep["event"]["step"], rep["origin"]["phase"], rep["cause"]) == (0, "input", "input")
    assert any("normalise_inputs.pre_hook" in n and "applies it a second time" in n
               for n in rep["problems"]), rep["problems"]


@pytest.mark.filterwarnings("ignore:std\\(\\)")  # (the replay's re-runs)
def test_feature_noise_hooked_mid_training_over_a_batch_of_one_names_the_hook(tmp_path):
    """A forward hook adding noise scaled by ``out.std(0)`` is registered on ``fc1`` at step 3,
    after the recorder attached; the last batch holds one record, whose std is 0/0 (step 8).
    The replay's model has no such hook: the report said only that what decided the event is
    not in the bundle; it names fc1's hook and its line."""
    model = M.make_tabular()

    def add_noise(step, model):
        if step == 3:
            model.fc1.register_forward_hook(M.FeatureNoise(0.1))

    with pytest.warns(UserWarning, match="degrees of freedom"):
        err = _run(model, _adam(model.parameters()), M.tabular_data(n=257), tmp_path,
                   each_step=add_noise, epochs=1)
    rep = nanreplay_json(err.bundle_path, code=1)
    line = source_line(MODELS, "return out + self.sigma * out.std(0, keepdim=True)")
    assert (rep["event"]["step"], rep["event"]["phase"], rep["cause"]) == (
        8, "forward", "not_reproduced"), rep
    assert f"fc1's forward hook FeatureNoise ({line}" in rep["hint"], rep["hint"]


@pytest.mark.filterwarnings("ignore:std\\(\\)")  # (the replay's re-runs)
def test_feature_noise_the_factory_registers_over_a_batch_of_one_is_named(tmp_path):
    """The same hook registered where the factory builds the model: re-run, named in fc1 as
    aten.std of one sample."""
    model = M.make_noisy_tabular()
    with pytest.warns(UserWarning, match="degrees of freedom"):
        err = _run(model, _adam(model.parameters()), M.tabular_data(n=257), tmp_path,
                   factory="user_hooks_in_backward_models:make_noisy_tabular", epochs=1)
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], o["samples"],
            rep["cause"]) == (8, "forward", "fc1", "aten.std", [0], "invalid"), rep
    assert not any("factory's model lacks" in n for n in rep["problems"])


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
    # (it said 'divides it by its norm (or sum) over each slice (weight normalisation)')
    assert "spectral_norm's forward pre-hook divides it by its largest singular value" \
        in rep["hint"] and "weight normalisation" not in rep["hint"]


def test_an_activation_penalty_a_forward_hook_captured_overflowing_in_float16(tmp_path):
    """A forward hook on ``fc2`` stores ``out.pow(2).sum(1).mean()`` for an activation
    penalty, which the loss module adds; under float16 autocast over raw-unit features the
    sum overflows. The report said 'loss: +inf made by <loss>' with no op (the loss only
    added it); it names the hook's aten.sum in fc2, its line, and the overflow."""
    built = M.make_penalised()
    model = built["model"]
    err = _run(model, _adam(model.parameters()), M.tabular_data(scale=300.0), tmp_path,
               factory="user_hooks_in_backward_models:make_penalised",
               loss_fn=built["loss_fn"], amp=True)
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["event"]["step"], rep["event"]["phase"], o["phase"], o["module"], o["op"],
            o["source"], rep["cause"]) == (
        0, "loss", "forward", "fc2", "aten.sum",
        source_line(MODELS, "self.value = out.pow(2).sum(1).mean()"), "overflow"), rep
    assert "float16's largest value" in rep["hint"]


def test_a_full_backward_hook_the_script_registered_is_named_with_the_sample(tmp_path):
    """``fc2.register_full_backward_hook`` normalising each sample's grad_input: record 100 is
    unlabelled (ignore_index), its gradient 0, 0/0 (step 3, row 4). The replay's model has no
    hook; the report said the loop's own code wrote the gradients (per-sample gradients,
    gradient surgery, Reptile); it names fc2's backward hook, its line and sample 4."""
    model = M.make_tabular()
    model.fc2.register_full_backward_hook(M.unit_grad_input)
    err = _run(model, _adam(model.parameters()), M.tabular_data(unlabelled_row=100), tmp_path,
               loss_fn=nn.CrossEntropyLoss(ignore_index=-1))
    rep = nanreplay_json(err.bundle_path, code=1)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["param"], o["samples"], rep["cause"]) == (
        3, "backward", "cat_emb.weight", [4], "not_reproduced"), rep
    line = source_line(MODELS, "return (g / g.norm(dim=1, keepdim=True),)")
    assert f"fc2's backward hook unit_grad_input ({line}" in rep["hint"], rep["hint"]
    assert "Reptile" not in rep["hint"] and "sample(s) [4]" in rep["hint"]


def test_a_backward_nan_under_an_optimizer_stepped_in_backward_says_how_to_replay(tmp_path):
    """The tutorial's optimizer-in-backward with a logit-norm penalty ``sqrt(sum(out²))``; the
    loop re-initialises the head to zeros at step 3, so the logits are 0 and the sqrt's
    derivative is infinite: NaN into the model's output. The hooks' updates ran inside that
    backward, so the bundle holds weights written after the forward and the step is not
    re-run; the report said to call rec.end_step() before the loop's own update, which cannot
    come between a gradient and its hook. It names the hook and says to step after backward."""
    model = M.make_tabular()
    M.optim_in_backward(model, _adam)

    def reset_head(step, model):
        if step == 3:
            with torch.no_grad():
                model.head.weight.zero_()
                model.head.bias.zero_()

    err = _run(model, None, M.tabular_data(), tmp_path, loss_fn=M.NormPenalisedLoss(),
               each_step=reset_head)
    rep = nanreplay_json(err.bundle_path, code=None)
    assert (rep["event"]["step"], rep["event"]["phase"], rep["origin"]["tensor"],
            len(rep["origin"]["samples"]), rep["not_rerun"]) == (
        3, "backward", "grad of the model output", 32, "weights written after its forward"), rep
    step_line = source_line(MODELS, "optimizers[p].step()")
    assert f"optim_in_backward.step_hook ({step_line}" in rep["hint"], rep["hint"]
    assert "step the optimizers after backward" in rep["hint"]
    assert "rec.end_step()" not in rep["hint"]
    assert any("inside backward, from a post-accumulate-grad hook" in n
               for n in rep["problems"]), rep["problems"]


def test_a_nan_gradient_hook_under_an_optimizer_stepped_in_backward_names_both_hooks(tmp_path):
    """The script's row-normalising tensor hooks (0/0 on the embedding's row 9, a code absent
    from the split) under the tutorial's per-parameter Adam (eps=1e-8) stepped in backward:
    the NaN gradient is applied inside backward and freed. The recorder sees the weights at
    step 2, when a forward first reads one (cat_emb's row 9 is never looked up; fc2.weight,
    written NaN by step 1's backward, is): a weights event. No optimizer setting is to blame,
    so the cause stays weights (not optimizer); the hint names the stepping hook and the
    tensor hook with their lines."""
    model = M.make_tabular()
    M.normalise_grad_rows(model)
    M.optim_in_backward(model, _adam)
    err = _run(model, None, M.tabular_data(), tmp_path)
    rep = nanreplay_json(err.bundle_path)
    assert (rep["event"]["step"], rep["origin"]["phase"], rep["origin"]["param"],
            rep["cause"]) == (2, "weights", "cat_emb.weight", "weights"), rep
    hint = rep["hint"]
    assert f"optim_in_backward.step_hook ({source_line(MODELS, 'optimizers[p].step()')}" in hint
    assert source_line(MODELS, "p.register_hook(lambda g: g / g.norm(") in hint, hint
    assert "eps=0" not in hint and "p -= lr * p.grad" not in hint

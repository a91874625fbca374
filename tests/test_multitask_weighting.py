"""End to end on multi-task loss balancing (``multitask_weighting_models``): a shared-bottom
MLP with two ReLU regression heads and a classifier, each task's loss over the records labelled
for it (a task mask passed into forward and loss), weighted by DWA's epoch-loss ratios, by
Kendall's learned log-variances (``exp(-s) L + s``) or merged by PCGrad written by hand. Each
planted failure of the domain fires under the recorder and is replayed with the CLI; the
healthy versions raise no event and train bit-identically with and without the recorder."""

from __future__ import annotations

import multitask_weighting_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

TRUNK = ["trunk.0.weight", "trunk.0.bias", "trunk.2.weight", "trunk.2.bias"]


def line_of(text: str) -> str:
    return source_line("multitask_weighting_models.py", text)


def fire(train, tmp_path, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(tmp_path, **kw)
    return info.value.event, info.value.bundle_path


def no_b_in_third_batch(x, ya, yb, ycls, mask):
    mask[16:24, 1] = False


def no_b_at_all(x, ya, yb, ycls, mask):
    mask[:, 1] = False


def test_a_task_without_a_labelled_record_is_a_0_over_0_mean_in_the_loss(tmp_path):
    """Batch 2 has no record labelled for task b: its masked mean is 0 / mask.sum() = 0/0."""
    ev, bundle = fire(M.train_dwa, tmp_path, plant=no_b_in_third_batch)
    assert (ev["step"], ev["phase"], ev["module"]) == (2, "loss", "<loss>")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == ("<loss>", "aten.div", [],
                                                                   "invalid"), rep
    assert o["source"] == line_of("return (per_record * m).sum() / m.sum()")
    assert "clamp_min(1)" in rep["hint"] and "every element masked" in rep["hint"], rep["hint"]


def test_missing_targets_stored_as_nan_and_masked_by_multiplication_name_their_rows(tmp_path):
    """A missing target exported as NaN: the mask multiplies it (NaN * 0 = NaN); the rows
    without a label for task a or b in the first batch are named."""
    ev, bundle = fire(M.train_dwa, tmp_path, mean=M.masked_mean_guarded, nan_missing=True)
    assert (ev["step"], ev["phase"]) == (0, "input")
    _, ya, yb, _, mask = M.dataset(nan_missing=True)
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["tensor"], rep["cause"]) == ("input", "loss_args[1]", "input"), rep
    assert o["samples"] == (~mask[:8, 0]).nonzero().flatten().tolist() == [1, 5]
    assert "NaN * 0 is NaN" in rep["hint"], rep["hint"]


def test_a_log_variance_driven_down_overflows_exp_in_uncertainty_weighting(tmp_path):
    """Task b is never labelled: its loss is 0, d(exp(-s) L + s)/ds = 1, and SGD with momentum
    drives s_b down until exp(-s_b) overflows float32 (inf * 0 = NaN in the total)."""
    ev, bundle = fire(M.train_kendall, tmp_path, plant=no_b_at_all, lr_s=2.0, epochs=4)
    assert (ev["step"], ev["phase"], ev["module"]) == (11, "loss", "<loss>")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], rep["cause"]) == ("<loss>", "aten.exp", "+inf",
                                                                "overflow"), rep
    assert o["source"] == line_of("return (torch.exp(-self.log_vars) * losses")
    hint = rep["hint"]  # (before: only the generic 'subtract the row max, bound the exponent')
    assert "input is -<loss>.log_vars, the trained parameter <loss>.log_vars negated" in hint
    assert "96.49 at flat index 1" in hint and "drifted down" in hint, hint


def test_dwa_weights_from_a_zero_epoch_loss_are_nan_and_named_as_such(tmp_path):
    """Task b is never labelled: its guarded epoch losses are 0, DWA's ratio 0/0 and the
    softmax makes every weight NaN at the first step of epoch 2, passed to the loss."""
    ev, bundle = fire(M.train_dwa, tmp_path, plant=no_b_at_all, mean=M.masked_mean_guarded)
    assert (ev["step"], ev["phase"]) == (16, "input")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["tensor"], o["samples"], rep["cause"]) == ("loss_args[5]", [], "input"), rep
    hint = rep["hint"]
    assert "Every one of its values is NaN" in hint, hint
    assert "DWA's softmax of L_t(e-1) / L_t(e-2)" in hint, hint


def test_pcgrad_onto_a_dead_heads_zero_gradient_names_that_output(tmp_path):
    """Head b ends in a ReLU whose inputs are all below 0: its loss and output gradient are not
    0, but its gradient at the trunk is, and PCGrad's dot / ||g_b||^2 is 0/0 in every trunk
    gradient the loop writes. Before, the hint said only 'a division by a norm that is 0'."""
    ev, bundle = fire(M.train_pcgrad, tmp_path, dead_b=True)
    assert (ev["step"], ev["phase"], ev["params"]) == (0, "backward", TRUNK)
    rep = nanreplay_json(bundle, code=1)
    o = rep["origin"]
    assert (o["phase"], o["param"], rep["cause"]) == ("backward", "trunk.0.weight",
                                                     "not_reproduced"), rep
    hint = rep["hint"]
    assert "output out[\"b\"] was exactly 0 in every element (a dead head" in hint, hint
    assert "‖g_j‖² + 1e-12" in hint and "out[\"a\"]" not in hint, hint


@pytest.mark.parametrize("train,kw", [
    (M.train_dwa, {"mean": M.masked_mean_guarded}),
    (M.train_kendall, {"lr_s": 0.1}),
    (M.train_pcgrad, {"eps": 1e-12, "dead_b": True}),
], ids=["dwa", "kendall", "pcgrad"])
def test_healthy_runs_raise_nothing_and_train_bit_identically(tmp_path, train, kw):
    with_rec = train(tmp_path / "a", **kw)
    without = train(tmp_path / "b", record=False, **kw)
    assert not list(tmp_path.rglob("*.nan"))
    for (n, a), (_, b) in zip(with_rec.state_dict().items(), without.state_dict().items()):
        assert torch.equal(a, b), n

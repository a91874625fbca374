"""Differentially private training with the real Opacus library: ``PrivacyEngine.make_private``
wraps the model in a GradSampleModule (its own hooks computing per-sample gradients), the
optimizer in a DPOptimizer (per-sample clipping, Gaussian noise, then the optimizer it holds)
and the loader in a DPDataLoader (Poisson sampling, possibly empty batches). The recorder is
given the model and the optimizer ``make_private`` returned, as a user would; each planted
failure is trained until it raises, then replayed with the CLI."""

from __future__ import annotations

import warnings

import opacus_dp_models as M
import pytest
import torch
from bundles import invoke_cli, nanreplay_json, one_error_line, replay_report, source_line
from opacus import PrivacyEngine
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch import nn
from torch.utils.data import DataLoader

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle

# (Opacus's full backward hooks on the first layer, whose input needs no gradient: torch warns
# in every step, as it does for any Opacus user)
pytestmark = [pytest.mark.usefixtures("in_tests_dir"),
              pytest.mark.filterwarnings("ignore:Full backward hook is firing")]


def _private(ds, model, *, batch_size=32, noise_multiplier=1.0, lr=0.1):
    """make_private over ``ds`` with a seeded noise generator (and Poisson sampler)."""
    torch.manual_seed(3)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    with warnings.catch_warnings():  # (secure_mode off, an empty first batch)
        warnings.simplefilter("ignore")
        return PrivacyEngine().make_private(
            module=model, optimizer=opt, data_loader=DataLoader(ds, batch_size=batch_size),
            noise_multiplier=noise_multiplier, max_grad_norm=1.0,
            noise_generator=torch.Generator().manual_seed(5))


def _epochs(dp_model, dp_opt, loader, crit, epochs=2):
    for _ in range(epochs):
        for x, y in loader:
            dp_opt.zero_grad()
            crit(dp_model(x), y).backward()
            dp_opt.step()


def _event(out_dir, ds, *, crit=None, factory="make_classifier", wrapped=False, **kw):
    """Train a private model over ``ds`` under the recorder until it raises."""
    crit = crit or nn.CrossEntropyLoss()
    dp_model, dp_opt, loader = _private(ds, getattr(M, factory)(), **kw)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(dp_model if wrapped else dp_model._module, dp_opt, loss_fn=crit,
                            out_dir=out_dir, factory=f"opacus_dp_models:{factory}"):
            _epochs(dp_model, dp_opt, loader, crit)
    return info.value


def _weights(model):
    return [p.detach().clone() for p in model.parameters()]


def _hooks(model):
    return [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
            for m in model.modules()]


def test_healthy_private_training_raises_nothing_and_trains_bit_identically(out_dir):
    """The DPOptimizer make_private returns crashed the recorder at attach ('DPOptimizer'
    object has no attribute '_optimizer_step_pre_hooks': it never calls Optimizer.__init__);
    the recorder now hooks the optimizer it holds (``original_optimizer``), whose step sees the
    clipped, noised gradients. A healthy run raises nothing, trains bit-identically with and
    without the recorder, and leaves Opacus's hooks as they were."""
    bare = M.make_classifier()
    _epochs(*_private(M.dataset(), bare), nn.CrossEntropyLoss())
    model = M.make_classifier()
    dp_model, dp_opt, loader = _private(M.dataset(), model)
    before = _hooks(dp_model)
    with FlightRecorder(dp_model._module, dp_opt, loss_fn=nn.CrossEntropyLoss(),
                        out_dir=out_dir) as rec:
        assert _hooks(dp_model) != before  # (the recorder's beside Opacus's)
        _epochs(dp_model, dp_opt, loader, nn.CrossEntropyLoss())
    assert rec.health.internal_errors == 0 and not list(out_dir.glob("*.nan"))
    assert all(torch.equal(a, b) for a, b in zip(_weights(bare), _weights(model)))
    assert _hooks(dp_model) == before


def test_make_private_with_epsilon_trains_under_the_recorder_without_an_event(out_dir):
    """make_private_with_epsilon's noise multiplier (from the accountant) and its optimizer."""
    torch.manual_seed(3)
    model = M.make_classifier()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dp_model, dp_opt, loader = PrivacyEngine().make_private_with_epsilon(
            module=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
            data_loader=DataLoader(M.dataset(), batch_size=32), target_epsilon=3.0,
            target_delta=1e-5, epochs=2, max_grad_norm=1.0)
    with FlightRecorder(model, dp_opt, loss_fn=nn.CrossEntropyLoss(), out_dir=out_dir) as rec:
        _epochs(dp_model, dp_opt, loader, nn.CrossEntropyLoss())
    assert rec.health.internal_errors == 0 and not list(out_dir.glob("*.nan"))
    assert dp_opt.original_optimizer.state  # (Adam stepped: the recorder hooked it)


def test_a_nan_record_of_the_private_dataset_is_named(out_dir):
    """A record of the private dataset holds NaN; the Poisson batch that draws it raises an
    input event, and the replay names that record's row of the batch."""
    ds = M.dataset()
    ds.tensors[0][70, 3] = float("nan")
    err = _event(out_dir, ds)
    assert (err.event["step"], err.event["phase"], err.event["samples"]) == (3, "input", [10])
    rep = nanreplay_json(err.bundle_path)
    assert (rep["cause"], rep["origin"]["phase"], rep["origin"]["samples"]) == \
        ("input", "input", [10])
    assert "sample 10 at feature(s) 3" in rep["hint"], rep["hint"]
    # each module's call counted once per step beside Opacus's own hooks (4 modules)
    calls = read_bundle(err.bundle_path)[1]["ring/call_module"]
    assert [sorted(row.tolist()) for row in calls] == [[0, 1, 2, 3]] * 4


def test_a_nan_record_in_a_physical_batch_of_batch_memory_manager_is_named(out_dir):
    """BatchMemoryManager splits each Poisson batch into physical batches of at most 16; the
    DPOptimizer skips the inner step until the logical batch ends, so the recorder's step is
    the logical batch and each physical batch one of its micro-batches."""
    ds = M.dataset()
    ds.tensors[0][70, 3] = float("nan")
    dp_model, dp_opt, loader = _private(ds, M.make_classifier(), batch_size=64)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(dp_model._module, dp_opt, loss_fn=crit, out_dir=out_dir,
                            factory="opacus_dp_models:make_classifier"):
            with BatchMemoryManager(data_loader=loader, max_physical_batch_size=16,
                                    optimizer=dp_opt) as physical:
                _epochs(dp_model, dp_opt, physical, crit, epochs=1)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["micro_batch"], ev["samples"]) == (3, "input", 1, [3])
    rep = nanreplay_json(info.value.bundle_path)
    assert (rep["cause"], rep["origin"]["micro_batch"], rep["origin"]["samples"]) == \
        ("input", 1, [3])


def test_an_empty_poisson_batch_s_mean_loss_is_named(out_dir):
    """Poisson sampling at q = 1/256 draws no record in the third batch (DPDataLoader yields
    zero-row tensors); CrossEntropyLoss's mean over them is 0/0."""
    err = _event(out_dir, M.dataset(), batch_size=1)
    assert (err.event["step"], err.event["phase"], err.event["samples"]) == (2, "loss", [])
    rep = nanreplay_json(err.bundle_path)
    assert (rep["cause"], rep["origin"]["module"], rep["origin"]["op"]) == \
        ("invalid", "<loss>", "aten.nll_loss_forward")
    assert "a mean over no element is 0/0" in rep["hint"] and "skip such batches" in rep["hint"]


def test_a_focal_loss_s_backward_nan_on_a_sure_record_is_named(out_dir):
    """A record 50x the others' scale, labelled as the model predicts it: its probability
    rounds to 1, and the focal loss's ``(1 - p) ** 0.5`` has an infinite derivative at 0.
    The NaN is made in the backward alone; Opacus's per-sample norms and clip spread it to
    every gradient the DPOptimizer hands its optimizer."""
    ds = M.dataset()
    ds.tensors[0][70] *= 50
    ds.tensors[1][70] = 0
    err = _event(out_dir, ds, crit=M.FocalLoss())
    assert (err.event["step"], err.event["phase"]) == (3, "backward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("backward", "<loss>", "PowBackward0", [10], "precision")
    assert o["source"] == source_line("opacus_dp_models.py", "** self.gamma")
    assert "clamp_min(eps) ** p" in rep["hint"], rep["hint"]


def test_a_layer_opacus_has_no_rule_for_is_recorded_and_its_0_over_0_named(out_dir):
    """A hand-written layer norm without an eps, a layer Opacus's hooks have no per-sample
    rule for (its functorch fallback runs the layer again under vmap in the backward hook):
    a record whose features are one value (a blank form filled with a default) is 0/0."""
    ds = M.dataset()
    ds.tensors[0][70] = 1.0
    err = _event(out_dir, ds, factory="make_record_norm")
    assert (err.event["step"], err.event["phase"], err.event["samples"]) == (3, "forward", [10])
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == ("0", "aten.div", [10], "invalid")
    assert o["source"] == source_line("opacus_dp_models.py", "/ x.std(-1")


def test_a_custom_layer_s_backward_only_nan_under_the_functorch_fallback_is_named(out_dir):
    """A learned square-root activation computes sqrt of the negative entries too and
    discards them with torch.where: finite forward, NaN in the backward at the first step;
    Opacus's functorch fallback for the layer and its clip spread it to every gradient."""
    err = _event(out_dir, M.dataset(), factory="make_sqrt_gate")
    assert (err.event["step"], err.event["phase"]) == (0, "backward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], rep["cause"], o["all_samples"]) == \
        ("backward", "1", "SqrtBackward0", "invalid", True)
    assert o["source"] == source_line("opacus_dp_models.py", ".sqrt(), torch.zeros_like")
    assert "torch.where(mask, x, 1)" in rep["hint"], rep["hint"]


def test_the_grad_sample_module_recorded_is_refused_at_replay_in_one_line(out_dir):
    """Recording the GradSampleModule make_private returned records the same calls (its
    hooks fire beside the recorder's); a factory that builds the inner model is refused in one
    line that says to record ``model._module``, which replays."""
    ds = M.dataset()
    ds.tensors[0][70, 3] = float("nan")
    err = _event(out_dir / "w", ds, wrapped=True)
    assert (err.event["step"], err.event["phase"], err.event["samples"]) == (3, "input", [10])
    line = one_error_line(invoke_cli(err.bundle_path, "--json"))
    assert "FlightRecorder(model._module, ...)" in line, line


def test_a_huge_noise_multiplier_s_update_is_named_as_the_noise(out_dir):
    """noise_multiplier=1e30: the DPOptimizer hands SGD gradients of about 1e28 from a loss of
    0.69, and the update's weights overflow the next forward's second Linear. The report
    named only the addmm overflow ('rescale its inputs'), with no precursor: the ring held the
    gradient and weight norms as inf (their float32 sums of squares overflowed), which the
    precursors skipped as non-finite. They are jumps now, and the hint names the noise added
    after backward instead of a learning rate or clipping."""
    err = _event(out_dir, M.dataset(), noise_multiplier=1e30)
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (1, "forward", "2")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], rep["cause"], o["all_samples"]) == \
        ("2", "aten.addmm", "overflow", True)
    kinds = [(p["step"], p["kind"]) for p in rep["precursors"]]
    assert kinds == [(0, "grad_norm_jump"), (1, "weight_jump")], rep["precursors"]
    assert "overflowed float32 (inf)" in rep["precursors"][0]["detail"]
    assert "DP-SGD's Gaussian noise" in rep["hint"] and "clip the gradients" not in rep["hint"]


def test_noise_beyond_float32_is_named_as_the_loop_s_gradients(out_dir):
    """noise_multiplier=1e39: the noise's std is beyond float32, the DPOptimizer writes +inf
    into every gradient after backward; the replay's backward through the model is finite,
    and the report says the loop's own code (a clip or noise) wrote them."""
    err = _event(out_dir, M.dataset(), noise_multiplier=1e39)
    assert (err.event["step"], err.event["phase"], err.event["kind"]) == (0, "backward", "+inf")
    rep, code = replay_report(err.bundle_path)
    assert code == 1 and not rep["reproduced"] and rep["cause"] == "not_reproduced"
    assert rep["origin"]["params"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert "a hand-written clip or noise" in rep["hint"], rep["hint"]


def test_ghost_clipping_s_double_backward_is_recorded_as_one_step(out_dir):
    """grad_sample_mode="ghost": make_private also wraps the criterion
    (DPLossFastGradientClipping, whose backward runs twice: per-sample norms, then the
    reweighted loss). The recorder is given the loss module make_private was given, which the
    wrapper calls; a NaN record's Poisson batch is an input event named as without ghost
    clipping."""
    ds = M.dataset()
    ds.tensors[0][70, 3] = float("nan")
    model, crit = M.make_classifier(), nn.CrossEntropyLoss()
    torch.manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dp_model, dp_opt, dp_crit, loader = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            criterion=crit, data_loader=DataLoader(ds, batch_size=32), noise_multiplier=1.0,
            max_grad_norm=1.0, noise_generator=torch.Generator().manual_seed(5),
            grad_sample_mode="ghost")
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, dp_opt, loss_fn=crit, out_dir=out_dir,
                            factory="opacus_dp_models:make_classifier"):
            _epochs(dp_model, dp_opt, loader, dp_crit)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["samples"]) == (3, "input", [10])
    rep = nanreplay_json(info.value.bundle_path)
    assert (rep["cause"], rep["origin"]["samples"]) == ("input", [10])

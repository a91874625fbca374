"""End to end: Keras 3 models on the PyTorch backend (``keras.Sequential`` and subclassed
``keras.Model``, compiled with ``optimizer="adam"`` and a built-in or user-defined loss, trained
by ``model.fit`` on numpy arrays: Keras's own ``loss.backward()`` and Keras optimizer), recorded
by ``recorder.keras.FlightRecorderCallback`` until a planted bug fires, then replayed with the
CLI; a plain torch loop beside them."""

from __future__ import annotations  # noqa: I001 (keras_torch_models picks the backend first)

import keras_torch_models as M  # (sets KERAS_BACKEND=torch before keras is imported)
import keras
import numpy as np
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError
from recorder.keras import FlightRecorderCallback

pytestmark = pytest.mark.usefixtures("in_tests_dir")

BATCH = 16


def line_of(text: str) -> str:
    return source_line("keras_torch_models.py", text)


def fit_until_event(tmp_path, factory: str, x, y, epochs=3):
    """``model.fit`` of the factory's compiled model under the callback; the bundle."""
    keras.utils.set_random_seed(0)
    model = getattr(M, factory)()["model"]
    callback = FlightRecorderCallback(out_dir=tmp_path, factory=f"keras_torch_models:{factory}")
    with pytest.raises(NonFiniteError) as e:
        model.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0, shuffle=False,
                  callbacks=[callback])
    assert "train_function" not in vars(model) or vars(model)["train_function"] is not None
    assert "compute_loss" not in vars(model)  # (the callback's wrapper is gone)
    return e.value.bundle_path


def check(rep, step, phase, module, op, cause, samples=None):
    assert rep["reproduced"] is True, rep["cause"]
    assert rep["event"]["step"] == step
    assert rep["event"]["phase"] == phase
    origin = rep["origin"]
    assert origin["module"] == module
    assert origin["op"] == op
    assert rep["cause"] == cause, rep["hint"]
    if samples is not None:
        assert origin["samples"] == samples


def test_nan_feature_in_numpy_data_is_an_input_event_of_its_row(tmp_path):
    x, y = M.data()
    x[37, 3] = np.nan  # batch 2 (rows 32-47): its row 5
    rep = nanreplay_json(fit_until_event(tmp_path, "make_mlp", x, y))
    check(rep, 2, "input", None, None, "input", [5])
    assert "sample 5 at feature(s) 3" in rep["hint"]


def test_log_of_a_negative_prediction_in_a_custom_keras_loss(tmp_path):
    x, y = M.data()
    rep = nanreplay_json(fit_until_event(tmp_path, "make_log_mlp", x, y + 2.0))
    check(rep, 0, "loss", "<loss>", "aten.log", "invalid")
    keras.utils.set_random_seed(0)
    out = M.make_log_mlp()["model"](x[:BATCH]).detach().numpy()[:, 0]
    assert rep["origin"]["samples"] == np.flatnonzero(out <= 0).tolist()
    assert rep["origin"]["called_from"] == line_of("ops.log(y_pred)")


def test_exp_rate_of_a_subclassed_model_overflows_on_unscaled_features(tmp_path):
    x, y = M.data(scale=300.0)
    rep = nanreplay_json(fit_until_event(tmp_path, "make_poisson", x, y))
    check(rep, 0, "forward", "", "aten.exp", "overflow")
    assert rep["origin"]["called_from"] == line_of("return ops.exp(")


def test_length_of_a_blank_records_features_is_a_backward_nan(tmp_path):
    x, y = M.data()
    x[5] = 0.0  # a blank record in the first batch; Keras's biases start at 0
    rep = nanreplay_json(fit_until_event(tmp_path, "make_root", x, y))
    check(rep, 0, "backward", "", "SqrtBackward0", "invalid", [5])
    assert "--try drop=5" in rep["hint"]


def test_float16_layers_cast_out_of_range_inputs(tmp_path):
    x, y = M.data(scale=30000.0)
    rep = nanreplay_json(fit_until_event(tmp_path, "make_fp16_mlp", x, y))
    check(rep, 0, "forward", "", "aten._to_copy", "overflow")
    assert rep["origin"]["samples"] == np.flatnonzero(
        np.abs(x[:BATCH]).max(1) > 65504).tolist()


def test_healthy_fit_raises_nothing_and_trains_bit_identically(tmp_path):
    x, y = M.data()
    weights = []
    for callbacks in ([], [FlightRecorderCallback(out_dir=tmp_path)]):
        keras.utils.set_random_seed(0)
        model = M.make_mlp()["model"]
        model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, shuffle=False,
                  callbacks=callbacks)
        weights.append([v.value.detach().clone() for v in model.weights])
        assert "compute_loss" not in vars(model)
    assert int(model.optimizer.iterations) == 12
    assert callbacks[0].recorder.event is None and callbacks[0].recorder.step == 12
    assert not list(tmp_path.iterdir())
    for a, b in zip(*weights):
        assert torch.equal(a, b)


def test_plain_torch_loop_beside_keras_names_its_layer(tmp_path):
    x, y = M.data()
    x[37, 3] = np.nan
    model = M.make_torch_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = torch.nn.MSELoss()
    xs, ys = torch.from_numpy(x), torch.from_numpy(y)
    with pytest.raises(NonFiniteError) as e, \
            FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                           factory="keras_torch_models:make_torch_mlp"):
        for i in range(0, len(xs), BATCH):
            opt.zero_grad()
            crit(model(xs[i:i + BATCH]), ys[i:i + BATCH]).backward()
            opt.step()
    rep = nanreplay_json(e.value.bundle_path)
    check(rep, 2, "input", None, None, "input", [5])


def test_keras_model_is_not_said_to_bypass_torch_hooks(caplog):
    # (Keras's Layer.__call__ is decorated; the function it wraps ends in super().__call__)
    model = M.make_mlp()["model"]
    with caplog.at_level("WARNING", logger="recorder"):
        FlightRecorder(model, None)
    assert "without torch's module hooks" not in caplog.text


def test_sgd_learning_rate_that_blows_the_weights_up_is_said_diverging(tmp_path):
    x, y = M.data()
    rep = nanreplay_json(fit_until_event(tmp_path, "make_sgd_mlp", x, y))
    check(rep, 1, "forward", "", "aten.mm", "overflow", list(range(BATCH)))
    assert "the weights had jumped in the update before step 1" in rep["hint"]
    jump = next(p for p in rep["precursors"] if p["kind"] == "weight_jump")
    assert jump["step"] == 1


def test_masked_mean_of_an_all_padding_sequence_in_a_custom_train_step(tmp_path):
    # a subclassed model (Embedding, MultiHeadAttention, LayerNormalization) with the Keras
    # guide's PyTorch train_step override and gradient clipping, fit on a torch DataLoader
    keras.utils.set_random_seed(0)
    model = M.make_tokens()["model"]
    callback = FlightRecorderCallback(out_dir=tmp_path, factory="keras_torch_models:make_tokens")
    with pytest.raises(NonFiniteError) as e:
        model.fit(M.token_loader(blank=21), epochs=2, verbose=0, shuffle=False,
                  callbacks=[callback])
    rep = nanreplay_json(e.value.bundle_path)
    check(rep, 1, "forward", "pool", "aten.div", "invalid", [5])
    assert rep["origin"]["source"] == line_of("/ ops.sum(m, axis=1)")
    assert "no valid entry" in rep["hint"]
    keras.utils.set_random_seed(0)
    healthy = M.make_tokens()["model"]
    healthy.fit(M.token_loader(), epochs=2, verbose=0, shuffle=False,
                callbacks=[FlightRecorderCallback(out_dir=tmp_path / "healthy")])
    assert int(healthy.optimizer.iterations) == 8
    assert not list((tmp_path / "healthy").iterdir())


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.mark.usefixtures("mixed_float16")
def test_loss_scale_optimizer_skips_are_no_events(tmp_path):
    # compile() wraps adam in a LossScaleOptimizer, whose scale 2**15 overflows float16
    # gradients at first: it skips those updates and halves the scale, as a GradScaler does
    x, y = M.data(scale=30.0)
    weights, steps = [], []
    for callbacks in ([], [FlightRecorderCallback(out_dir=tmp_path)]):
        keras.utils.set_random_seed(0)
        model = M.mlp(width=64)
        assert type(model.optimizer).__name__ == "LossScaleOptimizer"
        model.fit(x, y * 100.0, batch_size=BATCH, epochs=3, verbose=0, shuffle=False,
                  callbacks=callbacks)
        weights.append([v.value.detach().clone() for v in model.weights])
        steps.append((int(model.optimizer.iterations), float(model.optimizer.dynamic_scale)))
        assert "apply" not in vars(model.optimizer)  # (the callback's wrappers are gone)
    assert steps[0] == steps[1] and steps[0][0] < 12  # (updates skipped, the same ones)
    rec = callbacks[0].recorder
    assert rec.event is None and rec.step == 12 and not list(tmp_path.iterdir())
    for a, b in zip(*weights):
        assert torch.equal(a, b)


@pytest.mark.usefixtures("mixed_float16")
def test_nan_feature_under_mixed_float16_is_still_an_input_event(tmp_path):
    x, y = M.data()
    x[37, 3] = np.nan
    rep = nanreplay_json(fit_until_event(tmp_path, "make_mlp", x, y))
    check(rep, 2, "input", None, None, "input", [5])


def test_validation_batches_leave_step_numbers_on_optimizer_iterations(tmp_path):
    x, y = M.data()
    keras.utils.set_random_seed(0)
    model = M.make_mlp()["model"]
    callback = FlightRecorderCallback(out_dir=tmp_path)
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False,
              validation_split=0.25, callbacks=[callback])
    assert int(model.optimizer.iterations) == 6
    assert callback.recorder.step == 6 and callback.recorder.event is None
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False,  # (numbered on)
              validation_data=(x[:BATCH], y[:BATCH]), callbacks=[callback])
    assert callback.recorder.step == int(model.optimizer.iterations) == 10


def test_a_nan_in_the_validation_data_is_an_evaluation_event(tmp_path):
    """fit's validation forwards, under no_grad between the training steps, are evaluations
    (checked when they return, numbering no step): the callback paused the recorder through
    them, and a NaN record in the validation data showed only as val_loss: nan."""
    x, y = M.data()
    xv = x[:BATCH].copy()
    xv[5, 2] = np.nan
    keras.utils.set_random_seed(0)
    model = M.make_mlp()["model"]
    with pytest.raises(NonFiniteError) as e:
        model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False,
                  validation_data=(xv, y[:BATCH]), callbacks=[FlightRecorderCallback(
                      out_dir=tmp_path, factory="keras_torch_models:make_mlp")])
    ev = e.value.event
    steps = len(x) // BATCH  # (the first epoch's, before its validation)
    assert (ev["step"], ev["phase"], ev["samples"], ev.get("evaluation")) == (
        steps, "input", [5], True), ev
    assert "compute_loss" not in vars(model)  # (the callback's wrapper is gone)


@pytest.mark.usefixtures("mixed_float16")
def test_validation_under_loss_scaling_numbers_no_step(tmp_path):
    """Under mixed_float16 a step closes as the LossScaleOptimizer applies (or skips) its
    update, not at the end of its backward; its validation forwards are evaluations too."""
    x, y = M.data()
    keras.utils.set_random_seed(0)
    model = M.make_mlp()["model"]
    callback = FlightRecorderCallback(out_dir=tmp_path)
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False,
              validation_split=0.25, callbacks=[callback])
    assert callback.recorder.step == 6 and callback.recorder.event is None
    assert not list(tmp_path.iterdir())


def test_written_out_binary_cross_entropy_rounds_one_minus_sigmoid_to_zero(tmp_path):
    x, y = M.data(scale=30.0)
    rep = nanreplay_json(fit_until_event(tmp_path, "make_bernoulli_mlp", x,
                                         (y > 0).astype("float32")))
    check(rep, 0, "loss", "<loss>", "aten.log", "precision")
    keras.utils.set_random_seed(0)
    p = torch.sigmoid(M.make_bernoulli_mlp()["model"](x[:BATCH]).detach())[:, 0]
    assert rep["origin"]["samples"] == torch.nonzero(p == 1).flatten().tolist()
    assert rep["origin"]["called_from"] == line_of("ops.log(1.0 - p)")
    assert "binary_cross_entropy_with_logits" in rep["hint"]


def test_a_recorder_around_fit_survives_kerass_meta_device_trace(tmp_path, caplog):
    """``with FlightRecorder(model)`` around ``fit`` without the callback: Keras first traces
    the model on meta tensors (its symbolic build), which has no data to measure. Before, the
    recorder copied out of a meta tensor, logged an internal error and recorded nothing; now
    that pass is skipped and the NaN row is an input event with its bundle."""
    keras.utils.set_random_seed(0)
    model = M.make_mlp()["model"]
    x, y = M.data()
    x[37, 3] = np.nan  # batch 2 (rows 32-47): its row 5
    with pytest.raises(NonFiniteError) as e:
        with FlightRecorder(model, out_dir=tmp_path):
            model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    assert "internal error" not in caplog.text
    rep = nanreplay_json(e.value.bundle_path)
    assert (rep["event"]["step"], rep["event"]["phase"], rep["cause"]) == (2, "input", "input")
    assert rep["origin"]["samples"] == [5]

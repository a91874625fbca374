"""End to end: tabular networks trained through skorch 1.4 (``NeuralNetClassifier`` /
``NeuralNetRegressor`` fit on numpy arrays, the recorder attached from a skorch ``Callback``;
the forward and backward run inside ``optimizer.step(closure)``) and pytorch-tabnet 4.1
(``TabNetClassifier`` with its sparsemax attentive transformer and Ghost BatchNorm, the recorder
attached to ``clf.network`` and ``clf._optimizer`` from its own ``Callback``), until a planted
bug of tabular data fires, then replayed with the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
import skorch_tabnet_models as M
import torch
from bundles import nanreplay_json, source_line
from skorch import NeuralNetClassifier, NeuralNetRegressor
from skorch.callbacks import EarlyStopping, EpochScoring, GradientNormClipping, LRScheduler
from skorch.dataset import ValidSplit

from recorder import NonFiniteError
from recorder.bundle import read_bundle

pytestmark = [pytest.mark.usefixtures("in_tests_dir"),
              # (TabNet's fit without an eval_set warns that it stops early on nothing)
              pytest.mark.filterwarnings("ignore:No early stopping will be performed")]

BATCH = 32


def line_of(text: str) -> str:
    return source_line("skorch_tabnet_models.py", text)


def net_of(cls, module, out_dir=None, factory=None, extra=(), **params):
    callbacks = list(extra)
    if out_dir is not None:
        callbacks.append(M.RecordTraining(out_dir, f"skorch_tabnet_models:{factory}"))
    return cls(module, **{"max_epochs": 3, "lr": 0.05, "batch_size": BATCH, "train_split": None,
                          "verbose": 0, "callbacks": callbacks, **params})


def fire(net, X, y) -> NonFiniteError:
    """Fit until the recorder raises; skorch calls no ``on_train_end`` after an exception, so
    the test detaches what the callback attached."""
    try:
        with pytest.raises(NonFiniteError) as info:
            net.fit(X, y)
    finally:
        for cb in net.callbacks:
            if isinstance(cb, M.RecordTraining) and cb.recorder is not None:
                cb.recorder.detach()
    return info.value


def report(err: NonFiniteError, step: int, phase: str) -> tuple[dict, dict]:
    assert (err.event["step"], err.event["phase"]) == (step, phase), err.event
    rep = nanreplay_json(err.bundle_path)
    assert rep["reproduced"] is True, json.dumps(rep, indent=1)
    return rep, rep["origin"]


def test_healthy_skorch_training_raises_nothing_and_trains_bit_identically(tmp_path):
    X, y, _ = M.tabular()
    states = []
    for out in (None, tmp_path):
        torch.manual_seed(0)
        extra = [EpochScoring("accuracy", on_train=True),
                 LRScheduler(policy=torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5),
                 GradientNormClipping(1.0)]
        net = net_of(NeuralNetClassifier, M.MLPClassifier, out, "make_classifier", extra,
                     optimizer=torch.optim.SGD, optimizer__momentum=0.9)
        net.fit(X, y)
        states.append({k: v.clone() for k, v in net.module_.state_dict().items()})
        assert np.isfinite(net.history[:, "train_loss"]).all()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert not list(tmp_path.glob("*.nan"))


def test_healthy_tabnet_training_raises_nothing_and_trains_bit_identically(tmp_path):
    X, y, _ = M.tabular()
    states = []
    for out in (None, tmp_path):
        clf = M.TabNetClassifier(**M.TABNET)
        cbs = [] if out is None else [M.TabNetRecord(out, "skorch_tabnet_models:tabnet_network")]
        clf.fit(X, y, max_epochs=2, batch_size=64, virtual_batch_size=M.VIRTUAL_BATCH,
                callbacks=cbs)
        states.append({k: v.clone() for k, v in clf.network.state_dict().items()})
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert not list(tmp_path.glob("*.nan"))


def test_a_missing_value_left_as_nan_in_a_numpy_column_is_an_input_event(tmp_path):
    """Rows 70 and 75 of column 3 hold NaN (an empty cell of the CSV): batch 2 of 32, its
    samples 6 and 11."""
    X, y, _ = M.tabular()
    net = net_of(NeuralNetClassifier, M.MLPClassifier, tmp_path, "make_classifier",
                 optimizer=torch.optim.SGD, optimizer__momentum=0.9)
    rep, o = report(fire(net, M.with_missing(X, [70, 75]), y), 2, "input")
    assert (rep["cause"], rep["event"]["samples"]) == ("input", [6, 11])
    assert "sample 6 at feature(s) 3" in rep["hint"] and "impute" in rep["hint"]


def test_a_constant_column_standardised_by_its_std_of_0_is_named_at_the_scaler(tmp_path):
    X, y, _ = M.tabular()
    Xc = M.constant_column(X)
    mean, std = M.column_stats(Xc)
    net = net_of(NeuralNetClassifier, M.MLPClassifier, tmp_path, "make_scaled_classifier",
                 module__mean=mean, module__std=std)
    rep, o = report(fire(net, Xc, y), 0, "forward")
    assert (o["module"], o["op"], rep["cause"]) == ("scaler", "aten.div", "invalid")
    assert o["source"] == line_of("return (x - self.mean) / self.std")
    assert o["all_samples"] and "scaler.std" in rep["hint"] and "entry 4" in rep["hint"]


def test_a_target_holding_inf_is_named_as_the_loss_target(tmp_path):
    """Row 100 of the regression target is inf: batch 3, sample 4."""
    X, _, _ = M.tabular()
    y = (2 * X[:, :1]).astype(np.float32)
    y[100, 0] = np.inf
    net = net_of(NeuralNetRegressor, M.MLPRegressor, tmp_path, "make_regressor", lr=0.01)
    rep, o = report(fire(net, X, y), 3, "input")
    assert (rep["cause"], o["tensor"], o["samples"]) == ("input", "loss_args[1]", [4])


def test_balanced_class_weights_of_an_absent_class_are_named_as_the_loss_weight(tmp_path):
    """``n / (k * count)`` counted on a split without class 2: its weight is inf, and the
    weighted mean of CrossEntropyLoss is inf / inf on the first batch holding that class."""
    X, y, _ = M.tabular()
    w = torch.tensor(M.class_weights(y[y != 2]))
    assert torch.isinf(w[2])
    net = net_of(NeuralNetClassifier, M.LogitsClassifier, tmp_path, "make_logits_classifier",
                 criterion=torch.nn.CrossEntropyLoss, criterion__weight=w)
    rep, o = report(fire(net, X, y), 0, "loss")
    assert (o["module"], o["op"], rep["cause"]) == ("<loss>", "aten.nll_loss_forward", "weights")
    assert o["samples"] == np.flatnonzero(y[:BATCH] == 2).tolist()
    assert "'weight' holding inf at index 2" in rep["hint"], rep["hint"]


def test_a_poisson_deviance_masked_by_where_has_a_backward_only_nan(tmp_path):
    """``torch.where(y > 0, y * log(y / mu), 0)``: the forward is finite, the gradient of
    the unused branch at a count of 0 is 0 * inf."""
    X, _, counts = M.tabular()
    net = net_of(NeuralNetRegressor, M.MLPRegressor, tmp_path, "make_count_regressor",
                 module__log_link=True, criterion=M.PoissonDeviance, lr=0.01)
    rep, o = report(fire(net, X, counts.reshape(-1, 1)), 0, "backward")
    assert (o["module"], o["op"], rep["cause"]) == ("<loss>", "LogBackward0", "invalid")
    assert o["source"] == line_of("term = torch.where(y > 0, y * torch.log(y / mu)")
    assert o["samples"] == np.flatnonzero(counts[:BATCH] == 0).tolist()
    assert "xlogy" in rep["hint"]


def test_an_unscaled_nanosecond_timestamp_column_overflows_the_first_linear(tmp_path):
    """A datetime column as int64 nanoseconds (1.7e18 in every record): the first update's
    gradients come from backward itself (activations of 1e17 under a squared error of 3e31),
    and the next forward overflows. The hint blamed noise the loop added to the gradients
    after backward (DP-SGD's), as the loss 'had not jumped' at step 0, the first step of the
    history; now it names the column."""
    X, _, _ = M.tabular()
    Xt = M.nanosecond_timestamps(X, missing_every=len(X) + 1)
    net = net_of(NeuralNetRegressor, M.MLPRegressor, tmp_path, "make_regressor", lr=0.01)
    rep, o = report(fire(net, Xt, 2 * X[:, :1]), 1, "forward")
    assert (o["module"], o["op"], rep["cause"], o["all_samples"]) == \
        ("body.0", "aten.addmm", "overflow", True)
    assert [(p["step"], p["kind"]) for p in rep["precursors"]] == \
        [(0, "grad_norm_jump"), (1, "weight_jump")]
    assert "DP-SGD" not in rep["hint"], rep["hint"]
    assert "column(s) 5 of batch reach 1.7e+18" in rep["hint"] and "standardise" in rep["hint"]


def test_timestamps_with_missing_filled_by_0_are_not_blamed_on_added_noise(tmp_path):
    """The same column with every other entry missing and filled with 0: the records holding a
    timestamp stand out (1.7e18 against 3.8). The hint called them records out of scale ('a
    wrong unit, a corrupt record': fix or filter them, --try drop= half the batch); they
    stand out in that column only, alike, where every other record holds 0: the column's
    unit is said instead."""
    X, _, _ = M.tabular()
    net = net_of(NeuralNetRegressor, M.MLPRegressor, tmp_path, "make_regressor", lr=0.01)
    rep, o = report(fire(net, M.nanosecond_timestamps(X), 2 * X[:, :1]), 1, "forward")
    assert (o["module"], o["op"], rep["cause"]) == ("body.0", "aten.addmm", "overflow")
    assert o["samples"] == list(range(1, BATCH, 2))
    assert "DP-SGD" not in rep["hint"] and "--try drop" not in rep["hint"], rep["hint"]
    assert "stand out only in column(s) 5, where they hold 1.7e+18 and every other sample " \
        "holds 0" in rep["hint"] and "standardise that column" in rep["hint"]


def test_a_one_pass_batch_variance_of_unix_seconds_cancels_below_0(tmp_path):
    """``E[x^2] - E[x]^2`` of timestamps 1.7e9 a minute apart in float32: -2.7e11, and sqrt
    of it is NaN."""
    X, _, _ = M.tabular()
    net = net_of(NeuralNetRegressor, M.BatchNormedRegressor, tmp_path,
                 "make_batch_normed_regressor", lr=0.01)
    rep, o = report(fire(net, M.unix_seconds(X), 2 * X[:, :1]), 0, "forward")
    assert (o["module"], o["op"], rep["cause"]) == ("norm", "aten.sqrt", "precision")
    assert o["source"] == line_of("return (x - mean) / torch.sqrt(var + 1e-6)")
    assert "catastrophic cancellation" in rep["hint"] and "torch.var" in rep["hint"]


def test_an_income_in_dollars_under_float16_autocast_is_named_as_the_column(tmp_path):
    """A ``train_step_single`` override running the forward under float16 autocast; column 2
    is an income in dollars (2e4 to 1.15e5): the cast of the records above 65504 is +inf. The
    hint said those records were out of the scale of the rest ('crop or rescale such
    records', a range filter's points), then that the column was in another unit."""
    X, _, _ = M.tabular()
    Xi = X.copy()
    Xi[:, 2] = np.abs(Xi[:, 2]) * 5e4 + 2e4
    net = net_of(M.AutocastRegressor, M.MLPRegressor, tmp_path, "make_regressor", lr=1e-3)
    rep, o = report(fire(net, Xi, 2 * X[:, :1]), 0, "forward")
    assert (o["module"], o["op"], rep["cause"]) == ("body.0", "aten._to_copy", "overflow")
    assert o["samples"] == np.flatnonzero(Xi[:BATCH, 2] > 65504).tolist()
    assert "column(s) 2 of batch reach 1.15e+05" in rep["hint"], rep["hint"]
    assert "crop or rescale such records" not in rep["hint"] and "float32" in rep["hint"]


def test_adam_with_eps_0_on_a_column_of_zeros_is_named_as_the_optimizer(tmp_path):
    X, y, _ = M.tabular()
    net = net_of(NeuralNetClassifier, M.MLPClassifier, tmp_path, "make_classifier",
                 optimizer=torch.optim.Adam, optimizer__eps=0.0, lr=0.01)
    err = fire(net, M.constant_column(X, value=0.0), y)
    assert (err.event["step"], err.event["phase"], err.event["params"]) == \
        (0, "optimizer", ["hidden.weight"])
    rep = nanreplay_json(err.bundle_path, code=1)
    assert rep["cause"] == "optimizer" and "eps=0" in rep["hint"]
    assert "column(s) 4 of hidden.weight" in rep["hint"], rep["hint"]


def test_a_missing_value_in_the_validation_split_is_an_evaluation_event(tmp_path):
    """skorch's ``ValidSplit(4)`` holds rows 0-63 out; row 10 is NaN: the validation forward
    (no_grad, eval mode) after the 6 training batches of epoch 0."""
    X, y, _ = M.tabular()
    net = net_of(NeuralNetClassifier, M.MLPClassifier, tmp_path, "make_classifier",
                 train_split=ValidSplit(4, stratified=False), extra=[EarlyStopping(patience=2)])
    err = fire(net, M.with_missing(X, [10]), y)
    assert err.event["evaluation"] is True
    rep, o = report(err, 6, "input")
    assert (rep["cause"], o["tensor"], o["samples"]) == ("input", "batch", [10])


def test_tabnet_with_epsilon_0_takes_log_0_of_its_sparsemax_mask(tmp_path):
    """The sparsity regulariser ``sum(M * log(M + epsilon))`` of the attentive transformer's
    sparsemax mask, built with ``epsilon=0``: the mask holds exact zeros, log 0 = -inf."""
    X, y, _ = M.tabular()
    clf = M.TabNetClassifier(**M.TABNET, epsilon=0.0)
    cb = M.TabNetRecord(tmp_path, "skorch_tabnet_models:tabnet_network", {"epsilon": 0.0})
    try:
        with pytest.raises(NonFiniteError) as info:
            clf.fit(X, y, max_epochs=1, batch_size=64, virtual_batch_size=M.VIRTUAL_BATCH,
                    callbacks=[cb])
    finally:
        cb.recorder.detach()
    rep, o = report(info.value, 0, "forward")
    assert (o["module"], o["op"], rep["cause"], o["made"]) == \
        ("tabnet.encoder", "aten.log", "invalid", "-inf")
    assert o["source"].endswith("pytorch_tabnet/tab_network.py:174"), o["source"]
    assert "attribute epsilon" in rep["hint"] and "epsilon > 0" in rep["hint"]


def test_a_nan_in_a_dict_input_names_the_keyword_skorch_passes(tmp_path):
    """skorch passes a dict X as keyword arguments (``forward(x_num, x_cat)``): row 40 of
    ``x_num`` is NaN, batch 1's sample 8."""
    X, y, _ = M.tabular()
    Xd = {"x_num": M.with_missing(X[:, :5], [40], col=2),
          "x_cat": (np.arange(len(X)) % 4).astype(np.int64)}
    net = net_of(NeuralNetClassifier, M.DictInputClassifier, tmp_path, "make_dict_classifier")
    rep, o = report(fire(net, Xd, y), 1, "input")
    assert (rep["cause"], o["tensor"], o["samples"]) == ("input", 'kwargs["x_num"]', [8])
    assert "sample 8 at feature(s) 2 (of 5)" in rep["hint"]


def test_log_of_softmax_under_nll_loss_underflows(tmp_path):
    """``log(softmax(z))`` for skorch's NLLLoss, column 1 in another unit (x1000): the
    probabilities of the unlikely classes round to 0."""
    X, y, _ = M.tabular()
    Xs = X.copy()
    Xs[:, 1] *= 1e3
    net = net_of(NeuralNetClassifier, M.LogProbClassifier, tmp_path,
                 "make_log_prob_classifier", criterion=torch.nn.NLLLoss)
    rep, o = report(fire(net, Xs, y), 0, "forward")
    assert (o["module"], o["op"], rep["cause"], o["made"]) == ("", "aten.log", "underflow", "-inf")
    assert o["source"] == line_of("return torch.log(torch.softmax(super().forward(X), dim=-1))")
    assert "log_softmax instead of log(softmax)" in rep["hint"]


def test_an_inf_target_in_the_second_accumulated_batch_names_its_micro_batch(tmp_path):
    """skorch's gradient-accumulation recipe (``train_step`` stepping every 2 batches): row
    100 is batch 3, the second micro-batch of step 1, its sample 4."""
    X, _, _ = M.tabular()
    y = (2 * X[:, :1]).astype(np.float32)
    y[100, 0] = np.inf
    net = net_of(M.GradAccRegressor, M.MLPRegressor, tmp_path, "make_regressor", lr=0.01)
    rep, o = report(fire(net, X, y), 1, "input")
    assert (rep["event"]["micro_batch"], rep["event"]["micro_batches"]) == (1, 2)
    assert (rep["cause"], o["tensor"], o["samples"]) == ("input", "loss_args[1]", [4])


def test_a_one_cycle_schedule_s_peak_set_too_high_is_named_over_the_net_s_lr(tmp_path):
    """skorch's ``LRScheduler(policy=OneCycleLR, max_lr=30, step_every="batch")`` over SGD
    with ``lr=0.01``: the rate warms up from 1.2 and the run diverges at step 5, still rising.
    The hint said only 'lower the learning rate', which reads as the net's lr=0.01 that the
    schedule sets over; it now names the schedule's rise and its peak."""
    X, _, _ = M.tabular()
    sched = LRScheduler(policy=torch.optim.lr_scheduler.OneCycleLR, max_lr=30.0,
                        total_steps=64, step_every="batch")
    net = net_of(NeuralNetRegressor, M.MLPRegressor, tmp_path, "make_regressor", [sched],
                 optimizer=torch.optim.SGD, lr=0.01, max_epochs=8)
    rep, o = report(fire(net, X, 2 * X[:, :1]), 5, "forward")
    assert (o["module"], o["op"], rep["cause"]) == ("body.2", "aten.addmm", "overflow")
    assert "rising under a schedule up to the event, from 1.2 at step 0 to 6.239 at step 5" \
        in rep["hint"] and "max_lr" in rep["hint"], rep["hint"]


def test_tabnet_regression_target_with_inf_through_rec_loss_fn(tmp_path):
    """The callback hands TabNet's loss function to the recorder and puts ``rec.loss_fn`` in
    its place (``compute_loss`` calls ``self.loss_fn``): the inf target (row 100, in batch 2 of
    the shuffled loader) is named as the loss's target."""
    X, _, _ = M.tabular()
    y = (2 * X[:, :1]).astype(np.float32)
    y[100, 0] = np.inf
    clf = M.TabNetRegressor(**M.TABNET)
    cb = M.TabNetRecord(tmp_path, "skorch_tabnet_models:tabnet_network",
                        {"kind": "regressor", "output_dim": 1}, wrap_loss=True)
    try:
        with pytest.raises(NonFiniteError) as info:
            clf.fit(X, y, max_epochs=1, batch_size=64, virtual_batch_size=M.VIRTUAL_BATCH,
                    callbacks=[cb])
    finally:
        cb.recorder.detach()
    rep, o = report(info.value, 2, "input")
    assert (rep["cause"], o["tensor"]) == ("input", "loss_args[1]")
    (row,) = o["samples"]
    _, tensors = read_bundle(info.value.bundle_path)
    assert torch.equal(tensors["batch/0/0"][row], torch.from_numpy(X[100]))


# ---------------------------------------------------------------------------------------------
# recorder.skorch: the callback the product ships


def _product_net(module, tmp_path, factory, **params):
    from recorder.skorch import FlightRecorderCallback

    cb = FlightRecorderCallback(out_dir=tmp_path, factory=f"skorch_tabnet_models:{factory}")
    net = NeuralNetClassifier(module, **{"max_epochs": 3, "lr": 0.05, "batch_size": BATCH,
                                         "train_split": None, "verbose": 0, "callbacks": [cb],
                                         "criterion": torch.nn.CrossEntropyLoss, **params})
    return net, cb


def test_the_skorch_callback_records_the_fit_and_leaves_nothing_on_the_module(tmp_path):
    """A NaN cell at rows 70 and 75: the event of batch 2 comes out of ``fit`` as with the
    user's own callback, and, although skorch skips ``on_train_end`` after it, no hook of the
    recorder's is left on the module, nor the wrapper of the net's ``fit_loop``."""
    X, y, _ = M.tabular()
    net, cb = _product_net(M.LogitsClassifier, tmp_path, "make_logits_classifier")
    with pytest.raises(NonFiniteError) as info:
        net.fit(M.with_missing(X, [70, 75]), y)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in net.module_.modules())
    assert "fit_loop" not in vars(net)
    rep, o = report(info.value, 2, "input")
    assert (rep["cause"], rep["event"]["samples"]) == ("input", [6, 11])
    net.fit(X, y)  # (a healthy fit after it: recorded again, nothing raised)
    assert cb.recorder is not None and not list(tmp_path.glob("step00000010*"))


def test_the_modules_own_nan_check_raising_in_fit_writes_the_bundle(tmp_path):
    """The module raises ``ValueError("NaN in logits")`` on the 0/0 of a constant column's
    std of 0. skorch tells no callback of the exception, so a callback attaching in
    ``on_train_begin`` wrote nothing; the product's callback checks the step the exception
    cut short: the scaler's NaN output, seen before the check raised, is a forward event at
    step 0, the error noted with its bundle, replayed to the scaler's division."""
    X, y, _ = M.tabular()
    Xc = M.constant_column(X)
    mean, std = M.column_stats(Xc)
    net, _ = _product_net(M.CheckedClassifier, tmp_path, "make_checked_classifier",
                          module__mean=mean, module__std=std)
    with pytest.raises(ValueError, match="NaN in logits") as info:
        net.fit(Xc, y)
    [bundle] = tmp_path.glob("*.nan")
    assert any(str(bundle) in n for n in getattr(info.value, "__notes__", []))
    meta, _ = read_bundle(bundle, want=lambda name: False)
    ev = meta["event"]
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "forward", "scaler"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], rep["cause"]) == ("scaler", "aten.div", "invalid"), o

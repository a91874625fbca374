"""End to end: networks trained through Poutyne 1.19 (``poutyne.Model`` fit with
``fit_generator`` / ``fit`` / ``Experiment.train``, Poutyne's callbacks beside the recorder's
``recorder.poutyne.FlightRecorderCallback``) until a planted bug fires, then replayed with the
CLI."""

from __future__ import annotations

import json

import poutyne_fit_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from poutyne import ClipNorm, Experiment, Model, ModelCheckpoint, ReduceLROnPlateau
from torch import nn
from torch.nn import functional as F

from recorder import NonFiniteError
from recorder.poutyne import FlightRecorderCallback

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("poutyne_fit_models.py", text)


def recorder_cb(out_dir, factory: str) -> FlightRecorderCallback:
    return FlightRecorderCallback(out_dir=out_dir, factory=f"poutyne_fit_models:{factory}")


def fire(model: Model, train, callbacks, **kw) -> NonFiniteError:
    with pytest.raises(NonFiniteError) as info:
        model.fit_generator(train, epochs=2, verbose=False, callbacks=callbacks, **kw)
    return info.value


def report(err: NonFiniteError, step: int, phase: str, code: int = 0) -> tuple[dict, dict]:
    assert (err.event["step"], err.event["phase"]) == (step, phase), err.event
    rep = nanreplay_json(err.bundle_path, code=code)
    assert rep["reproduced"] is (code == 0), json.dumps(rep, indent=1)
    return rep, rep["origin"]


def hooks_left(net: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in net.modules())


def test_healthy_fit_raises_nothing_and_trains_bit_identically(tmp_path):
    X, y = M.tabular()
    Xv, yv = M.tabular(32, seed=3)
    states = []
    for record in (False, True):
        torch.manual_seed(0)
        net = M.make_mlp()
        model = Model(net, "adam", nn.CrossEntropyLoss(), batch_metrics=["accuracy"])
        cbs = [ClipNorm(net.parameters(), 1.0), ReduceLROnPlateau(monitor="val_loss", patience=1),
               ModelCheckpoint(str(tmp_path / "best.ckpt"), monitor="val_loss")]
        if record:
            cbs.append(recorder_cb(tmp_path, "make_mlp"))
        logs = model.fit_generator(M.tensor_loader(X, y), M.tensor_loader(Xv, yv), epochs=3,
                                   verbose=False, callbacks=cbs, batches_per_step=2)
        assert all(torch.isfinite(torch.tensor(e["loss"])) for e in logs)
        states.append({k: v.clone() for k, v in net.state_dict().items()})
        assert hooks_left(net) == 0 and "_fit_batch" not in vars(model)
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert not list(tmp_path.glob("*.nan"))


def test_missing_value_in_a_csv_column_is_an_input_event_on_its_record(tmp_path):
    X, y = M.tabular()
    model = Model(M.make_mlp(), "adam", nn.CrossEntropyLoss(), batch_metrics=["accuracy"])
    err = fire(model, M.tensor_loader(M.with_missing(X, [37]), y),
               [recorder_cb(tmp_path, "make_mlp")])
    rep, o = report(err, 2, "input")  # row 37: batch 2 of 16, its row 5
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == (None, None, [5], "input")
    assert "missing values" in rep["hint"]


def test_a_later_fit_numbers_its_steps_on_and_a_validation_nan_is_an_evaluation_event(tmp_path):
    X, y = M.tabular()
    Xv, yv = M.tabular(32, seed=5)
    model = Model(M.make_mlp(), "adam", "cross_entropy", batch_metrics=["accuracy"])
    cb = recorder_cb(tmp_path, "make_mlp")
    model.fit_generator(M.tensor_loader(X, y), epochs=1, verbose=False, callbacks=[cb])
    assert cb.recorder.step == 6
    err = fire(model, M.tensor_loader(X, y), [cb],
               valid_generator=M.tensor_loader(M.with_missing(Xv, [20]), yv))
    assert err.event["evaluation"] is True
    rep, o = report(err, 12, "input")  # after the second fit's 6 steps; row 20: batch 1, row 4
    assert (o["samples"], rep["cause"]) == ([4], "input")
    assert hooks_left(model.network) == 0 and "_validate" not in vars(model)


def test_a_text_of_no_token_is_a_0_by_0_in_the_masked_mean(tmp_path):
    ids, mask, y = M.sentences(empty=(21,))
    model = Model(M.make_text(), "adam", nn.CrossEntropyLoss(), batch_metrics=["accuracy"])
    err = fire(model, M.PairLoader(ids, mask, y), [recorder_cb(tmp_path, "make_text")])
    rep, o = report(err, 1, "forward")
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == ("pool", "aten.div", [5],
                                                                   "invalid")
    assert o["source"] == line_of("return (e * m).sum(1) / m.sum(1)")
    assert "no valid entry" in rep["hint"]


@pytest.mark.parametrize("batches_per_step", [1, 2])
def test_a_price_typed_in_dollars_overflows_cosh_in_the_log_cosh_loss(tmp_path,
                                                                      batches_per_step):
    X, y = M.prices()
    model = Model(M.make_regressor(), "adam", M.LogCoshLoss())
    err = fire(model, M.tensor_loader(X, M.in_dollars(y, [40])),
               [recorder_cb(tmp_path, "make_regressor")], batches_per_step=batches_per_step)
    # row 40: batch 2, row 8; under accumulation of 2 batches, step 1's first micro-batch
    rep, o = report(err, 2 // batches_per_step, "loss")
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == ("<loss>", "aten.cosh", [8],
                                                                   "overflow")
    assert o["micro_batch"] == 0
    assert "out of scale" in rep["hint"] and "log1p(exp(-2 * x.abs()))" in rep["hint"]


def test_log_of_a_softmax_head_underflows_on_a_feature_in_raw_units(tmp_path):
    X, y = M.tabular()
    # a plain function as the loss: Poutyne wraps it in its DecomposableMetric, recorded
    model = Model(M.make_softmax_mlp(), "sgd", M.nll_of_probs, batch_metrics=["accuracy"])
    err = fire(model, M.tensor_loader(M.raw_units(X), y),
               [recorder_cb(tmp_path, "make_softmax_mlp")])
    rep, o = report(err, 0, "loss")
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == ("<loss>", "aten.log", [9, 14],
                                                                   "underflow")
    assert o["source"] == line_of("return F.nll_loss(torch.log(y_pred), y_true)")
    assert "log_softmax instead of log(softmax)" in rep["hint"]
    # the column in raw units behind the logits hundreds apart, named
    assert "column(s) 5 of batch reach" in rep["hint"] and "standardise the columns" in rep["hint"]


def test_strict_clipping_in_a_callback_surfaces_the_sqrt_backward_of_zero_embeddings(tmp_path):
    ids, mask, y = M.sentences()
    net = M.make_normalised_text()
    model = Model(net, "adam", nn.CrossEntropyLoss())
    with pytest.raises(RuntimeError, match="non-finite, so it cannot be clipped") as info:
        model.fit_generator(M.PairLoader(ids, mask, y), epochs=1, verbose=False, callbacks=[
            recorder_cb(tmp_path, "make_normalised_text"), M.StrictClipNorm(net.parameters(), 1)])
    # poutyne calls no callback after the exception: the callback's own check bundled the step
    assert "phase backward" in info.value.__notes__[0]
    assert hooks_left(net) == 0 and "_fit_batch" not in vars(model)
    (bundle,) = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], rep["cause"]) == ("backward", "", "SqrtBackward0",
                                                                "invalid")
    assert o["source"] == line_of("norm = e.pow(2).sum(-1, keepdim=True).sqrt()")
    lengths = mask[:16].sum(1)
    assert o["samples"] == (lengths < M.SEQ).nonzero().flatten().tolist()  # the padded texts


def test_poutyne_clipnorm_spreading_the_sqrt_backward_nan_is_said_in_a_note(tmp_path):
    """Poutyne's own ClipNorm (no error): the NaN total norm multiplies every gradient, so the
    event lists head.weight and head.bias too; the re-run names embed.weight's origin and a
    note says the clip spread it (before: the other two were left unexplained)."""
    ids, mask, y = M.sentences()
    net = M.make_normalised_text()
    model = Model(net, "adam", nn.CrossEntropyLoss())
    err = fire(model, M.PairLoader(ids, mask, y), [
        recorder_cb(tmp_path, "make_normalised_text"), ClipNorm(net.parameters(), 1.0)])
    assert err.event["params"] == ["embed.weight", "head.weight", "head.bias"]
    rep, o = report(err, 0, "backward")
    assert (o["params"], o["op"], rep["cause"]) == (["embed.weight"], "SqrtBackward0", "invalid")
    (note,) = [p for p in rep["problems"] if "NaN in every element" in p]
    assert note.startswith("the recorded gradients of head.weight, head.bias are NaN in every "
                           "element, while the re-run's backward leaves them finite")
    assert "spread embed.weight's NaN into them, as a clip_grad_norm_ does" in note


@pytest.mark.parametrize(("warm", "phase", "op", "samples", "cause"), [
    ((0, 3, 5), "backward", "AcosBackward0", [0, 3, 5], "invalid"),  # cos 1: acos' pole
    ((0, 7, 1), "forward", "aten.acos", [7], "precision")])  # rounded past 1 (0, 1: to 1): NaN
def test_arcface_centres_warm_started_on_records_round_their_cosine_to_1(tmp_path, warm, phase,
                                                                         op, samples, cause):
    """Each class centre starts at a record's embedding, its features at the start; the
    cosine of that record with its own centre is 1 up to rounding. The records are sparse ones
    whose norm is exact (``M.SPARSE_RECORDS``), so the rounding is the same on every CPU: to
    exactly 1.0 for rows 0, 1, 3, 5 (acos finite, its derivative -inf: a backward event; float64
    rounds below 1), to 1.0000001 for row 7 (acos NaN: a forward event). At step 0 a centre is
    its record's embedding exactly, so its cosine is 1 in exact arithmetic: the backward pole
    is ``invalid`` (replay.exact_edge: equal operands, whatever float64 rounds them to), while
    the forward's NaN past 1 is rounding's, ``precision`` (exact acos(1) is 0)."""
    X, y = M.tabular()
    X = M.with_sparse_records(X)
    net = M.make_arcface(warm)
    with torch.no_grad():  # the plant, as the head computes it: each record on its own centre
        cos = (F.normalize(net.embed(X[:16])) @ F.normalize(net.centres).T)[list(warm), [0, 1, 2]]
    assert (cos > 1).nonzero().flatten().tolist() == ([] if phase == "backward" else [1])
    assert bool((cos >= 1).all())
    model = Model(net, "adam", nn.CrossEntropyLoss(), batch_metrics=["accuracy"])
    err = fire(model, M.PairLoader(X, y, y), [recorder_cb(tmp_path, "make_arcface")])
    rep, o = report(err, 0, phase)
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == ("", op, samples, cause)
    assert o["source"] == line_of("theta = torch.acos(cos)")
    assert "cos.clamp(-1 + eps, 1 - eps)" in rep["hint"]


@pytest.mark.parametrize("guard", [False, True])
def test_adam_with_eps_0_breaks_the_embedding_rows_no_gradient_reached(tmp_path, guard):
    """Padding zeroed by ``embed(ids) * mask``, not ``padding_idx``: id 0 is looked up in every
    padded text, but at positions no loss reaches, so its row's gradient is 0 as are those of
    ids absent from the batch. With the guard's copies the batch is the update's own, and the
    hint tells those rows apart (without it the bundle holds the next step's batch)."""
    ids, mask, y = M.sentences()
    model = Model(M.make_text(), {"optim": "adam", "eps": 0.0}, nn.CrossEntropyLoss())
    cb = FlightRecorderCallback(out_dir=tmp_path, factory="poutyne_fit_models:make_text",
                                guard_optimizer=guard)
    err = fire(model, M.PairLoader(ids, mask, y), [cb])
    rep, o = report(err, 0, "optimizer", code=0 if guard else 1)
    assert (o["param"], rep["cause"]) == ("embed.weight", "optimizer")
    assert "set eps > 0" in rep["hint"] and "only row(s) 0, 7, 18 of 20" in rep["hint"]
    assert set(ids[:16].flatten().tolist()) & {0, 7, 18} == {0}  # 7, 18: absent
    if guard:
        assert (o["op"], o["rows"]) == ("aten.addcdiv_", [0, 7, 18])
        assert ("row(s) 0 looked up by the batch only at positions whose output no loss "
                "reached") in rep["hint"] and "the others absent from the batch" in rep["hint"]


def test_experiment_train_records_with_the_callback(tmp_path):
    X, y = M.tabular()
    torch.manual_seed(0)
    exp = Experiment(str(tmp_path / "exp"), M.make_mlp(), optimizer="adam",
                     loss_function="cross_entropy", batch_metrics=["accuracy"],
                     logging=False)
    with pytest.raises(NonFiniteError) as info:
        exp.train(M.tensor_loader(M.with_missing(X, [50]), y), epochs=2, verbose=False,
                  callbacks=[recorder_cb(tmp_path, "make_mlp")])
    rep, o = report(info.value, 3, "input")
    assert (o["samples"], rep["cause"]) == ([2], "input")

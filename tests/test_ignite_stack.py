"""End to end: PyTorch-Ignite training as its users write it (``ignite_stack_models``: a DeepSets
classifier called as ``model(x, mask)`` through ``create_supervised_trainer``'s
``prepare_batch`` and ``model_fn``, a tabular regressor), with ``TerminateOnNan``,
gradient accumulation, an LR scheduler handler, ``ModelCheckpoint``, handlers that edit the
weights between iterations and a ``create_supervised_evaluator`` run at each epoch's end — under
``FlightRecorder`` around ``trainer.run`` until a planted bug fires, then replayed with the
CLI. Step numbers are checked against ignite's ``state.iteration``."""

from __future__ import annotations

import contextlib

import pytest

pytest.importorskip("ignite")

import ignite_stack_models as M  # noqa: E402
import torch  # noqa: E402
from bundles import nanreplay_json, source_line  # noqa: E402
from ignite.engine import (  # noqa: E402
    Engine,
    Events,
    create_supervised_evaluator,
    create_supervised_trainer,
)
from ignite.handlers import LRScheduler, ModelCheckpoint, PiecewiseLinear, TerminateOnNan  # noqa: E402
from ignite.metrics import Accuracy, Loss  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from recorder import FlightRecorder, NonFiniteError  # noqa: E402

pytestmark = pytest.mark.usefixtures("in_tests_dir")

B = 4  # batch size


def line_of(text: str) -> str:
    return source_line("ignite_stack_models.py", text)


def trainer(model, opt, loss, accumulate=1, sets=True):
    """``create_supervised_trainer`` as the domain writes it, ``TerminateOnNan`` attached."""
    kw = dict(prepare_batch=M.prepare_batch, model_fn=M.model_fn) if sets else {}
    t = create_supervised_trainer(model, opt, loss, gradient_accumulation_steps=accumulate, **kw)
    t.add_event_handler(Events.ITERATION_COMPLETED, TerminateOnNan())
    return t


def fire(tmp_path, t, model, opt, loss, data, factory, epochs=1):
    """``t.run`` under the recorder until the event: its JSON report and the event."""
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=loss, out_dir=tmp_path / "b",
                            factory=f"ignite_stack_models:{factory}"):
            t.run(DataLoader(data, batch_size=B), max_epochs=epochs)
    assert not t.should_terminate  # the recorder spoke before TerminateOnNan
    return nanreplay_json(info.value.bundle_path, code=None), info.value.event


def origin(rep):
    o = rep["origin"]
    return o["phase"], o["module"], o["op"], rep["event"]["step"], rep["cause"]


def sgd(model, lr=0.05):
    return torch.optim.SGD(model.parameters(), lr=lr)


def healthy_run(tmp_path, record):
    """Two epochs: accumulation over 2 iterations, a warmup-then-decay ``PiecewiseLinear``, an
    evaluator with accuracy and loss at each epoch's end, a checkpoint of the best accuracy."""
    model, loss = M.make_set(), nn.CrossEntropyLoss()
    opt = sgd(model)
    t = trainer(model, opt, loss, accumulate=2)
    t.add_event_handler(Events.ITERATION_COMPLETED, PiecewiseLinear(
        opt, "lr", milestones_values=[(0, 0.0), (4, 0.05), (20, 0.005)]))
    ev = create_supervised_evaluator(model, metrics={"acc": Accuracy(), "nll": Loss(loss)},
                                     prepare_batch=M.prepare_batch, model_fn=M.model_fn)
    ev.add_event_handler(Events.COMPLETED, ModelCheckpoint(
        tmp_path / "ckpt", "set", n_saved=1, score_function=lambda e: e.state.metrics["acc"],
        require_empty=False), {"model": model})
    t.add_event_handler(Events.EPOCH_COMPLETED,
                        lambda: ev.run(DataLoader(M.sets(12), batch_size=B)))
    rec = FlightRecorder(model, opt, loss_fn=loss, out_dir=tmp_path / "b") if record else None
    if rec is not None:
        with rec:
            t.run(DataLoader(M.sets(40), batch_size=B), max_epochs=2)
        assert rec.event is None and rec.step == t.state.iteration // 2 == 10
        assert list((tmp_path / "b").glob("*.nan")) == []
    else:
        t.run(DataLoader(M.sets(40), batch_size=B), max_epochs=2)
    assert not t.should_terminate and len(list((tmp_path / "ckpt").glob("*.pt"))) == 1
    return model.state_dict(), ev.state.metrics


def test_healthy_run_raises_nothing_and_trains_identically(tmp_path):
    plain, m0 = healthy_run(tmp_path / "plain", record=False)
    recorded, m1 = healthy_run(tmp_path / "rec", record=True)
    assert plain.keys() == recorded.keys() and m0 == m1
    assert all(torch.equal(plain[k], recorded[k]) for k in plain)


def test_a_nan_record_surfaces_through_the_engine_before_terminate_on_nan(tmp_path):
    """A record with a NaN feature in the third batch: the recorder raises inside the process
    function's ``optimizer.step()``, ignite fires ``EXCEPTION_RAISED`` with it and re-raises,
    and ``TerminateOnNan`` (at ``ITERATION_COMPLETED``) never runs."""
    model, loss = M.make_set(), nn.CrossEntropyLoss()
    opt = sgd(model)
    t = trainer(model, opt, loss)
    seen = []

    @t.on(Events.EXCEPTION_RAISED)
    def log_and_reraise(engine, e):  # (ignite calls it from the epoch's loop and the run's)
        seen.append(e)
        raise e

    rep, ev = fire(tmp_path, t, model, opt, loss, M.sets(40, nan_at=[2 * B + 1]), "make_set")
    assert seen and all(e is seen[0] for e in seen) and isinstance(seen[0], NonFiniteError)
    assert t.state.iteration == 3 and ev["step"] == t.state.iteration - 1
    assert origin(rep) == ("input", None, None, 2, "input")
    assert rep["origin"]["samples"] == [1] and rep["origin"]["tensor"] == "args[0]"


def test_under_accumulation_terminate_on_nan_stops_first_and_the_event_comes_at_exit(tmp_path):
    """With ``gradient_accumulation_steps=2`` a NaN record in an odd iteration (micro-batch 0)
    makes a NaN loss that ``TerminateOnNan`` sees before any ``optimizer.step()``: the run ends
    quietly, and the recorder's check of the open step raises when the ``with`` block exits,
    naming ignite's iteration 5 as step 2, micro-batch 0."""
    model, loss = M.make_set(), nn.CrossEntropyLoss()
    opt = sgd(model)
    t = trainer(model, opt, loss, accumulate=2)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=loss, out_dir=tmp_path / "b",
                            factory="ignite_stack_models:make_set") as rec:
            t.run(DataLoader(M.sets(40, nan_at=[4 * B + 1]), batch_size=B), max_epochs=1)
            assert t.should_terminate and t.state.iteration == 5 and rec.event is None
    ev = info.value.event
    assert (ev["step"], ev["micro_batch"]) == ((t.state.iteration - 1) // 2, 0) == (2, 0)
    rep = nanreplay_json(info.value.bundle_path)
    assert origin(rep) == ("input", None, None, 2, "input") and rep["origin"]["samples"] == [1]


def test_close_step_on_stop_makes_trainer_run_raise_the_accumulated_steps_event(tmp_path):
    """The same run with ``recorder.ignite.CloseStepOnStop`` attached: ``Events.TERMINATE``
    closes the open step, so ``trainer.run`` itself raises (nothing after it runs); a healthy
    run whose last micro-batch had no ``step()`` (27 iterations, the 14th step closed at
    ``COMPLETED``; steps across epochs' ends) trains identically."""
    from recorder.ignite import CloseStepOnStop

    model, loss = M.make_set(), nn.CrossEntropyLoss()
    opt = sgd(model)
    t, after = trainer(model, opt, loss, accumulate=2), []
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=loss, out_dir=tmp_path / "b") as rec:
            CloseStepOnStop(rec).attach(t)
            t.run(DataLoader(M.sets(40, nan_at=[4 * B + 1]), batch_size=B), max_epochs=1)
            after.append(t.state.iteration)
    assert after == [] and (info.value.event["step"], info.value.event["micro_batch"]) == (2, 0)
    weights = []
    for record in (False, True):
        model = M.make_set()
        opt = sgd(model)
        t = trainer(model, opt, loss, accumulate=2)
        with FlightRecorder(model, opt, loss_fn=loss, out_dir=tmp_path / "h") if record \
                else contextlib.nullcontext() as rec:
            if record:
                CloseStepOnStop(rec).attach(t)
            t.run(DataLoader(M.sets(36), batch_size=B), max_epochs=3)
        assert t.state.iteration == 27 and not record or (rec.event is None and rec.step == 14)
        weights.append(model.state_dict())
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    with pytest.raises(TypeError, match="needs a FlightRecorder"):
        CloseStepOnStop(model)


def test_log_of_a_softmax_that_underflowed_on_a_mis_scaled_record(tmp_path):
    """A hand-written NLL, ``-log(softmax(logits)[y])``: a record in the wrong units (1e6x)
    whose label is not its largest logit's class gives a probability of exactly 0."""
    model, loss = M.make_set(), M.SoftmaxNLL()
    opt = sgd(model)
    rep, ev = fire(tmp_path, trainer(model, opt, loss), model, opt, loss,
                   M.sets(40, scaled_at=[2 * B + 1, 2 * B + 3], scale=1e6), "make_set")
    assert origin(rep) == ("loss", "<loss>", "aten.log", 2, "underflow")
    assert rep["origin"]["samples"] == [1, 3]
    assert rep["origin"]["source"] == line_of("return -p.gather(1, y[:, None]).log().mean()")
    assert "log_softmax instead of log(softmax)" in rep["hint"]
    assert "sample(s) 1,3 of args[0] reach" in rep["hint"] and "out of scale" in rep["hint"]


def test_an_empty_set_makes_a_backward_only_nan_at_the_hand_written_norm(tmp_path):
    """A record with no item: the masked mean is 0 (its count clamped to 1), the forward stays
    finite, and backward of ``sqrt(sum(z * z))`` at 0 sends ``inf * 0`` into the embedding."""
    model, loss = M.make_set(), nn.CrossEntropyLoss()
    opt = sgd(model)
    rep, ev = fire(tmp_path, trainer(model, opt, loss), model, opt, loss,
                   M.sets(40, empty_at=[2 * B + 2]), "make_set")
    assert ev["phase"] == "backward" and ev["params"][0] == "embed.0.weight"
    assert origin(rep) == ("backward", "", "SqrtBackward0", 2, "invalid")
    assert rep["origin"]["samples"] == [2]
    assert rep["origin"]["source"] == line_of("length = torch.sqrt((z * z).sum(1, keepdim=True))")
    assert "torch.linalg.vector_norm" in rep["hint"]


def test_an_exponential_lr_handler_with_gamma_above_one_diverges_the_regressor(tmp_path):
    """``LRScheduler(ExponentialLR(gamma=3))`` at every iteration (meant: 0.3 per epoch): the
    rate triples each step until the MSE overflows float32 at ignite's iteration 13."""
    model, loss = M.make_regressor(), nn.MSELoss()
    opt = sgd(model, lr=0.01)
    t = trainer(model, opt, loss, sets=False)
    t.add_event_handler(Events.ITERATION_COMPLETED, LRScheduler(
        torch.optim.lr_scheduler.ExponentialLR(opt, gamma=3.0)))
    rep, ev = fire(tmp_path, t, model, opt, loss, M.tabular(400), "make_regressor")
    assert t.state.iteration == 13 and ev["step"] == 12
    assert origin(rep) == ("loss", "<loss>", "aten.mse_loss", 12, "overflow")
    assert rep["origin"]["all_samples"]
    assert "rose at each of the 12 steps from step 0 to step 12, about 3x" in rep["hint"]
    assert "ExponentialLR with gamma > 1" in rep["hint"]


def test_a_head_renormalised_after_pruning_a_row_to_zero_is_a_weights_event(tmp_path):
    """Two ``ITERATION_COMPLETED`` handlers: a structured pruning at iteration 3 zeroes the
    head's weakest row, then the cosine head's row renormalisation divides it by its norm 0.
    The update of step 2 left the weights finite: the loop wrote the NaN between steps."""
    model, loss = M.make_set(), nn.CrossEntropyLoss()
    opt = sgd(model)
    t = trainer(model, opt, loss)
    t.add_event_handler(Events.ITERATION_COMPLETED(once=3),
                        lambda: M.prune_weakest_rows(model.head))
    t.add_event_handler(Events.ITERATION_COMPLETED, lambda: M.renormalise_rows(model.head))
    rep, ev = fire(tmp_path, t, model, opt, loss, M.sets(40), "make_set")
    assert t.state.iteration == 4 and (ev["step"], ev["last_update_step"]) == (3, 2)
    assert origin(rep) == ("weights", "head", "aten.addmm", 3, "weights")
    assert rep["origin"]["param"] == "head.weight" and rep["origin"]["rows"] == [1]
    assert "the loop wrote it between that update and step 3" in rep["hint"]
    assert "row(s) 1 of 3 of head.weight" in rep["hint"]
    assert "row(s) 1 of head.weight are NaN throughout and every other row has L2 norm 1" \
        in rep["hint"] and "norm.clamp_min(eps)" in rep["hint"]


def test_unit_rows_needs_whole_nan_rows_beside_rows_of_one_norm():
    """``replay.unit_rows``: a row-normalised matrix with a 0/0 row is named; a NaN row among
    rows of different norms, a row NaN in part, or too few finite rows are not."""
    from replay.unit_rows import unit_rows_text

    w = torch.nn.functional.normalize(torch.randn(5, 4), dim=1)
    w[3] = float("nan")
    assert unit_rows_text("w", w).startswith("row(s) 3 of w are NaN throughout")
    raw = torch.randn(5, 4)
    raw[3] = float("nan")
    assert unit_rows_text("w", raw) is None
    part = w.clone()
    part[3, :2] = 0.5
    assert unit_rows_text("w", part) is None
    assert unit_rows_text("w", w[2:4]) is None and unit_rows_text("w", w[:, 0]) is None


def test_a_nan_record_in_the_validation_set_is_an_evaluation_event(tmp_path):
    """``create_supervised_evaluator`` run at each epoch's end over a validation set whose
    sixth record holds a NaN: an evaluation forward (no_grad, eval mode) before training step 4
    (ignite's iteration 5), the validation batch's row 1."""
    model, loss = M.make_set(), nn.CrossEntropyLoss()
    opt = sgd(model)
    t = trainer(model, opt, loss)
    ev = create_supervised_evaluator(model, metrics={"acc": Accuracy(), "nll": Loss(loss)},
                                     prepare_batch=M.prepare_batch, model_fn=M.model_fn)
    t.add_event_handler(Events.EPOCH_COMPLETED,
                        lambda: ev.run(DataLoader(M.sets(12, nan_at=[5]), batch_size=B)))
    rep, event = fire(tmp_path, t, model, opt, loss, M.sets(16), "make_set", epochs=2)
    assert t.state.iteration == 4 and ev.state.iteration == 2
    assert event["evaluation"] and rep["event"]["evaluation"]
    assert origin(rep) == ("input", None, None, 4, "input") and rep["origin"]["samples"] == [1]


def test_a_custom_engine_with_autocast_and_clipping_names_a_one_pass_variance(tmp_path):
    """A hand-written ``Engine(process_function)``: bf16 autocast, ``clip_grad_norm_``,
    AdamW. The per-record layer norm's ``E[x^2] - E[x]^2`` of a record offset by 3e4 (raw
    sensor counts) cancels to -64 in float32: sqrt of a negative number, in sample 0 of
    ignite's iteration 4."""
    model, loss = M.make_normed_regressor(), nn.MSELoss()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def process(engine, batch):
        model.train()
        opt.zero_grad()
        x, y = batch
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pred = model(x)
        out = loss(pred.float(), y)
        out.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return out.item()

    t = Engine(process)
    t.add_event_handler(Events.ITERATION_COMPLETED, TerminateOnNan())
    rep, ev = fire(tmp_path, t, model, opt, loss, M.offset_tabular(40, offset_at=[3 * B]),
                   "make_normed_regressor")
    assert t.state.iteration == 4 and ev["step"] == 3
    assert origin(rep) == ("forward", "0", "aten.sqrt", 3, "precision")
    assert rep["origin"]["samples"] == [0]
    assert rep["origin"]["source"] == line_of("return (h - mean) / torch.sqrt(var + self.eps)")
    assert "catastrophic cancellation" in rep["hint"] and "torch.var" in rep["hint"]


def test_the_evaluators_loss_metric_names_the_validation_records_out_of_scale(tmp_path):
    """The hand-written NLL is the trainer's loss and the evaluator's ``Loss`` metric: two
    validation records in the wrong unit (rows 1 and 2 of the second validation batch), of
    which only row 1's label has a probability of 0. An evaluation loss event before step 4;
    the hint names both records out of scale, not only the one that reached log(0)."""
    model, loss = M.make_set(), M.SoftmaxNLL()
    opt = sgd(model)
    t = trainer(model, opt, loss)
    ev = create_supervised_evaluator(model, metrics={"acc": Accuracy(), "nll": Loss(loss)},
                                     prepare_batch=M.prepare_batch, model_fn=M.model_fn)
    val = M.sets(12, scaled_at=[B + 1, B + 2], scale=1e6)
    t.add_event_handler(Events.EPOCH_COMPLETED,
                        lambda: ev.run(DataLoader(val, batch_size=B)))
    rep, event = fire(tmp_path, t, model, opt, loss, M.sets(16), "make_set", epochs=2)
    assert event["evaluation"] and ev.state.iteration == 2
    assert origin(rep) == ("loss", "<loss>", "aten.log", 4, "underflow")
    assert rep["origin"]["samples"] == [1]
    assert "sample(s) 1,2 of args[0] reach" in rep["hint"] and "out of scale" in rep["hint"]

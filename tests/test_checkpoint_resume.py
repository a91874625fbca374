"""End to end: long runs that save and resume (``checkpoint_resume_models``): ``torch.save`` /
``torch.load`` of the model, optimizer and scheduler state dicts mid-run, a resume in a fresh
recorder (``start_step``, built after the load), ``load_state_dict(assign=True)`` and
``strict=False``, a rollback to the last good checkpoint under ``on_event='warn'``, EMA weights
swapped in for evaluation and back. Damaged checkpoints (a NaN from a crashed save, a flipped
exponent bit, a float16 copy, NaN optimizer state, a buffer the checkpoint lacks) are named
with their step, module, op, samples and cause: the checkpoint's weights where they are to
blame, never the optimizer for a load."""

from __future__ import annotations

import checkpoint_resume_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

MODELS = "checkpoint_resume_models.py"
FACTORY = "checkpoint_resume_models:make_model"
SAVED = 6  # the step the checkpoint was written at


@pytest.fixture(scope="module")
def blob() -> bytes:
    """A checkpoint of a run trained for ``SAVED`` steps (model, AdamW, cosine schedule)."""
    model = M.make_model()
    opt = M.make_optimizer(model)
    sched = M.make_scheduler(opt)
    crit = M.SmoothedCE()
    for _, batch in zip(range(SAVED), M.loader()):
        M.train_step(model, opt, crit, batch)
        sched.step()
    return M.save_checkpoint(SAVED, model, opt, sched)


def _resume(blob: bytes, out_dir, edit=None, model=None, crit=None, steps: int = 4):
    """A fresh process's resume: build the model, load the (edited) checkpoint, build the
    recorder after the load with ``start_step``, train ``steps`` more; the bundle's path."""
    ck = M.load_checkpoint(blob)
    if edit is not None:
        edit(ck)
    model = model or M.make_model()
    missing = model.load_state_dict(ck["model"], strict=False).missing_keys
    opt = M.make_optimizer(model)
    opt.load_state_dict(ck["optimizer"])
    sched = M.make_scheduler(opt)
    sched.load_state_dict(ck["scheduler"])
    crit = crit or M.SmoothedCE()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, factory=FACTORY,
                            start_step=ck["step"]):
            for _, batch in zip(range(steps), M.loader(seed=1)):
                M.train_step(model, opt, crit, batch)
                sched.step()
    assert missing == (["norm.mean", "norm.var"] if "norm.var" not in ck["model"] else [])
    return info.value.bundle_path


def _healthy(blob: bytes, record: bool, out_dir) -> dict[str, torch.Tensor]:
    """Resume, train with an EMA evaluated every 3 steps (its weights swapped in and back),
    a checkpoint every 2 steps and a rollback to the last one at step 9."""
    ck = M.load_checkpoint(blob)
    model = M.make_model()
    model.load_state_dict(ck["model"])
    opt = M.make_optimizer(model)
    opt.load_state_dict(ck["optimizer"])
    crit, ema = M.SmoothedCE(), M.EMA(model)
    batches = list(M.loader(seed=1))
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, factory=FACTORY,
                         start_step=ck["step"]) if record else None
    if rec is not None:
        rec.attach()
    good = None
    for i, batch in enumerate(batches[:12]):
        M.train_step(model, opt, crit, batch)
        ema.update(model)
        if i % 3 == 2:
            ema.evaluate(model, batches[-1])
        if i % 2 == 0:
            good = M.save_checkpoint(SAVED + i, model, opt)
        if i == 9:  # roll back to the last checkpoint, copied into the same tensors
            last = M.load_checkpoint(good)
            model.load_state_dict(last["model"])
            opt.load_state_dict(last["optimizer"])
    if rec is not None:
        rec.detach()
        assert rec.event is None and rec.bundle_path is None
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def test_resume_without_a_bug_raises_no_event_and_trains_bit_identically(tmp_path, blob):
    """A resume, checkpoints, a rollback and EMA weights swapped in for evaluation and back
    are no event, and the recorder changes no weight."""
    plain = _healthy(blob, False, tmp_path)
    recorded = _healthy(blob, True, tmp_path)
    assert list(plain) == list(recorded)
    assert all(torch.equal(plain[n], recorded[n]) for n in plain)
    assert not list(tmp_path.glob("*.nan"))


def test_nan_weight_from_a_crashed_save_is_the_checkpoints(tmp_path, blob):
    def crashed(ck):
        ck["model"]["proj.weight"][3, 5] = float("nan")

    r = nanreplay_json(_resume(blob, tmp_path, crashed))
    o = r["origin"]
    assert (r["event"]["step"], r["cause"], o["phase"]) == (SAVED, "weights", "weights")
    assert (o["module"], o["op"], o["param"], o["rows"]) == ("proj", "aten.addmm",
                                                             "proj.weight", [3])
    assert o["all_samples"] and o["first_seen_step"] == SAVED
    assert "first step the recorder saw" in r["hint"] and "checkpoint" in r["hint"]
    assert "optimizer.step()" not in r["hint"]


def test_flipped_exponent_bit_is_named_as_the_weight_not_a_wider_type(tmp_path, blob):
    """A flipped bit 30 of one float32 weight (x 2**128): an overflow in GELU of the Linear's
    output. Before: 'compute it in float64'; now the weight element and the checkpoint."""
    def flipped(ck):
        M.flip_bit(ck["model"]["proj.weight"], 3 * M.DIM + 5, 30)

    r = nanreplay_json(_resume(blob, tmp_path, flipped))
    o = r["origin"]
    assert (r["event"]["step"], r["cause"], o["phase"]) == (SAVED, "overflow", "forward")
    assert (o["module"], o["op"], o["samples"]) == ("", "aten.gelu", [0])
    assert o["source"] == source_line(MODELS, "h = F.gelu(self.proj(self.embed(ids)))")
    assert r["hint"].startswith("proj.weight holds 1 element out of scale")
    assert "at (3, 5)" in r["hint"] and "first step the recorder saw" in r["hint"]
    assert "float64" not in r["hint"]


def test_float16_checkpoint_in_a_float32_model_names_the_cast(tmp_path, blob):
    """A checkpoint saved with ``.half()``: an embedding value of 7e4 became inf."""
    def halved(ck):
        ck["model"]["embed.weight"][7, 2] = 7e4
        ck["model"] = {k: v.half() if v.is_floating_point() else v
                       for k, v in ck["model"].items()}

    r = nanreplay_json(_resume(blob, tmp_path, halved))
    o = r["origin"]
    assert (r["event"]["step"], r["cause"], r["event"]["kind"]) == (SAVED, "weights", "+inf")
    assert (o["module"], o["op"], o["param"], o["rows"]) == ("embed", "aten.embedding",
                                                             "embed.weight", [7])
    ids = next(iter(M.loader(seed=1)))[0]
    assert o["samples"] == sorted({int(i) for i in (ids == 7).any(1).nonzero()})
    assert "float16" in r["hint"] and ".half()" in r["hint"]
    assert "element-wise division" not in r["hint"]


def test_float16_checkpoint_flushes_a_tiny_variance_to_zero(tmp_path, blob):
    """A calibrated normaliser's variance of 2e-8 (a near-constant feature) saved with
    ``.half()``: 0 after the cast, then x / sqrt(0). Before: a data statistic constant in the
    feature (an allele frequency); now the float16 cast's underflow."""
    def halved(ck):
        var = torch.rand(M.DIM, generator=torch.Generator().manual_seed(3)) * 2 + 0.5
        var[5] = 2e-8
        ck["model"]["norm.var"] = var
        ck["model"] = {k: v.half() if v.is_floating_point() else v
                       for k, v in ck["model"].items()}

    r = nanreplay_json(_resume(blob, tmp_path, halved))
    o = r["origin"]
    assert (r["event"]["step"], r["cause"], o["phase"]) == (SAVED, "invalid", "forward")
    assert (o["module"], o["op"]) == ("norm", "aten.div") and o["all_samples"]
    assert "is 0 at entry 5 of its shape (16,)" in r["hint"]
    assert "float16" in r["hint"] and "underflow" in r["hint"]
    assert "allele" not in r["hint"]


def test_nan_in_ema_weights_swapped_in_for_evaluation(tmp_path):
    """The EMA copy (NaN in one bias entry) loaded into the model for a no-grad evaluation:
    an evaluation forward's weights event, the write outside optimizer.step() named."""
    model = M.make_model()
    opt = M.make_optimizer(model)
    crit, ema = M.SmoothedCE(), M.EMA(model)
    batches = list(M.loader())
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path, factory=FACTORY):
            for i, batch in enumerate(batches[:8]):
                M.train_step(model, opt, crit, batch)
                ema.update(model)
                if i == 4:
                    ema.shadow["proj.bias"][0] = float("nan")
                if i % 3 == 2:
                    ema.evaluate(model, batches[-1])
    r = nanreplay_json(info.value.bundle_path)
    o = r["origin"]
    assert (r["event"]["step"], r["event"]["evaluation"], r["cause"]) == (6, True, "weights")
    assert (o["module"], o["op"], o["param"], o["last_update_step"]) == (
        "proj", "aten.addmm", "proj.bias", 5)
    assert "EMA or SWA average copied in" in r["hint"]


def test_nan_optimizer_state_is_the_load_not_the_update_rule(tmp_path, blob):
    def bad_moments(ck):
        ck["optimizer"]["state"][2]["exp_avg_sq"][1] = float("nan")  # proj.bias

    r = nanreplay_json(_resume(blob, tmp_path, bad_moments), code=1)  # (not re-run)
    o = r["origin"]
    assert (r["event"]["step"], r["cause"], o["phase"], o["param"]) == (
        SAVED, "optimizer", "optimizer", "proj.bias")
    assert "held NaN before this update" in r["hint"]
    assert "optimizer.load_state_dict" in r["hint"]


def test_buffer_missing_from_an_old_checkpoint_is_never_filled(tmp_path, blob):
    """``strict=False`` over a checkpoint of the model's earlier version (no ``norm``): its
    ``var`` stays at the 0 it is built with. Before: a data statistic constant in a feature
    (an allele frequency); now a buffer never filled, with strict=False's missing_keys."""
    def old_version(ck):
        ck["model"] = {k: v for k, v in ck["model"].items() if not k.startswith("norm.")}

    torch.manual_seed(0)
    r = nanreplay_json(_resume(blob, tmp_path, old_version,
                               model=M.TokenClassifier(calibrated=False)))
    o = r["origin"]
    assert (r["event"]["step"], r["cause"], o["phase"]) == (SAVED, "invalid", "forward")
    assert (o["module"], o["op"]) == ("norm", "aten.div") and o["all_samples"]
    assert o["source"] == source_line(MODELS, "return (x - self.mean) / self.var.sqrt()")
    assert "norm.var is 0 in every entry" in r["hint"]
    assert "strict=False" in r["hint"] and "missing_keys" in r["hint"]
    assert "allele" not in r["hint"]


def test_focal_loss_backward_at_a_saturated_class(tmp_path, blob):
    """A resumed head whose bias for class 2 came in at 40: p_t rounds to 1 for its samples,
    and the hand-written focal loss's ``(1 - p) ** 0.5`` has an infinite derivative at 0."""
    def biased(ck):
        ck["model"]["head.bias"][2] = 40.0

    r = nanreplay_json(_resume(blob, tmp_path, biased, crit=M.FocalLoss()))
    o = r["origin"]
    y = next(iter(M.loader(seed=1)))[2]
    assert (r["event"]["step"], r["cause"], o["phase"]) == (SAVED, "invalid", "backward")
    assert (o["module"], o["op"]) == ("<loss>", "PowBackward0")
    assert o["samples"] == (y == 2).nonzero().flatten().tolist()
    assert o["source"] == source_line(MODELS, "return (-(1 - logp.exp()) ** self.gamma")


def assign_true_rollback(tmp_path, blob, steps: int, new_optimizer: bool):
    """Train under the recorder; at step 3 load the checkpoint, with NaN at head.weight[2, 3],
    by ``load_state_dict(assign=True)`` (new Parameter objects), and with ``new_optimizer``
    build the optimizer again over them (from the checkpoint's state) without telling the
    recorder. The bundle of the event."""
    model = M.make_model()
    opt = M.make_optimizer(model)
    crit = M.SmoothedCE()
    ck = M.load_checkpoint(blob)
    ck["model"]["head.weight"][2, 3] = float("nan")
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path, factory=FACTORY):
            for i, batch in zip(range(steps), M.loader()):
                if i == 3:
                    model.load_state_dict(ck["model"], assign=True)
                    if new_optimizer:
                        opt = M.make_optimizer(model)
                        opt.load_state_dict(ck["optimizer"])
                M.train_step(model, opt, crit, batch)
    return info.value.bundle_path


def test_assign_true_load_keeps_the_optimizer_on_the_old_parameters(tmp_path, blob):
    """A mid-run rollback with ``load_state_dict(assign=True)``: new Parameter objects, NaN in
    one; the optimizer still holds the old ones. Before: 'densification, pruning' and 'not a
    checkpoint'; now the whole-model load, the checkpoint and the stale optimizer."""
    r = nanreplay_json(assign_true_rollback(tmp_path, blob, steps=8, new_optimizer=False))
    o = r["origin"]
    assert (r["event"]["step"], r["cause"], o["phase"]) == (3, "weights", "weights")
    assert (o["module"], o["op"], o["params"], o["rows"]) == ("head", "aten.addmm",
                                                              ["head.weight"], [2])
    assert "replaced every parameter of the model at once" in r["hint"]
    assert "assign=True" in r["hint"] and "build the optimizer" in r["hint"]
    assert "densification" not in r["hint"]


def test_rollback_after_an_event_under_warn_continues_with_the_same_recorder(tmp_path):
    """``on_event='warn'``: a record with every position masked makes 0/0 at step 5; the
    loop rolls back to its last good checkpoint and trains on. One bundle, naming sample 3."""
    model = M.make_model()
    opt = M.make_optimizer(model)
    crit = M.SmoothedCE()
    good, rolled = None, []
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path, factory=FACTORY,
                        on_event="warn") as rec:
        for i, (ids, mask, y) in zip(range(12), M.loader()):
            if i == 5:
                mask = mask.clone()
                mask[3] = 0
            loss = M.train_step(model, opt, crit, (ids, mask, y))
            if not torch.isfinite(loss) or not all(
                    bool(torch.isfinite(p).all()) for p in model.parameters()):
                last = M.load_checkpoint(good)
                model.load_state_dict(last["model"])
                opt.load_state_dict(last["optimizer"])
                rolled.append(i)
            elif i % 2 == 0:
                good = M.save_checkpoint(i, model, opt)
    assert rolled == [5] and all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert [p.name for p in tmp_path.glob("*.nan")] == [rec.bundle_path.name]
    r = nanreplay_json(rec.bundle_path)
    o = r["origin"]
    assert (r["event"]["step"], r["cause"], o["phase"]) == (5, "invalid", "forward")
    assert (o["module"], o["op"], o["samples"]) == ("", "aten.div", [3])
    assert o["source"] == source_line(MODELS, "pooled = (h * mask.unsqueeze(-1)).sum(1)")
    assert "no valid entry" in r["hint"]


@pytest.mark.parametrize("scale", [2.0 ** 16, float("inf")])
def test_grad_scaler_state_of_inf_from_the_checkpoint(tmp_path, blob, scale):
    """AMP resume: the scaler's state is loaded with the rest. A checkpoint whose scale is inf
    skips every update (``inf * loss``) and is never halved back: its first skipped step is the
    event (before, only the recorder's skip limit, max_skipped_steps later, ended it). Before: the
    re-run unscaled, 'loss terms computed outside loss_fn', MGDA weights; now the scale, and
    that it came in with the scaler state loaded. A finite scale trains with no event."""
    ck = M.load_checkpoint(blob)
    model = M.make_model()
    model.load_state_dict(ck["model"])
    opt = M.make_optimizer(model)
    opt.load_state_dict(ck["optimizer"])
    scaler = torch.amp.GradScaler("cpu")
    scaler.load_state_dict({**scaler.state_dict(), "scale": scale})
    crit = M.SmoothedCE()
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path, factory=FACTORY,
                         start_step=SAVED, scaler=scaler, max_skipped_steps=3)
    try:
        with rec:
            for _, batch in zip(range(6), M.loader(seed=1)):
                M.amp_step(model, opt, crit, scaler, batch)
    except NonFiniteError:
        pass
    if scale == 2.0 ** 16:
        assert rec.event is None and 0 < scaler.get_scale() <= 2.0 ** 16
        assert not torch.equal(model.head.weight, ck["model"]["head.weight"])  # (it trained)
        return
    r = nanreplay_json(rec.bundle_path, code=1)  # (not re-run)
    o = r["origin"]
    assert (r["event"]["step"], r["event"]["kind"], r["cause"]) == (SAVED, "scale", "overflow")
    assert (o["phase"], o["tensor"], o["module"], o["op"]) == ("backward", "GradScaler scale",
                                                               None, None)
    assert r["hint"].startswith("the GradScaler's scale is inf")
    assert "first step the recorder saw (step 6)" in r["hint"]
    assert "scaler.load_state_dict" in r["hint"] and "MGDA" not in r["hint"]


def test_assign_true_load_with_a_new_optimizer_the_recorder_was_not_given(tmp_path, blob):
    """The same load, the optimizer then built again over the new parameters (and the old one
    dropped) without telling the recorder: no step closes, the new optimizer's updates spread
    the NaN unseen, and every parameter is NaN when the recorder detaches. Before: each of the
    five 'already held nan before any update' (densification); now the dropped optimizer,
    and that which of them the load brought in is not known."""
    r = nanreplay_json(assign_true_rollback(tmp_path, blob, steps=6, new_optimizer=True))
    o = r["origin"]
    assert (r["event"]["step"], r["cause"], o["phase"]) == (3, "weights", "weights")
    assert r["event"]["micro_batches"] == 3 and len(o["params"]) == 5
    assert "gone from the bundle and never stepped again" in r["hint"]
    assert "is not known" in r["hint"] and "before any update" not in r["hint"]


def test_optimizer_state_of_another_models_shapes_is_no_event(tmp_path, blob):
    """``optimizer.load_state_dict`` checks the number of parameters, not their shapes: the
    state of a model with 8 classes loads into the 4-class one, and AdamW's first update
    raises its own shape error. That error is the loop's to see, unchanged; no bundle."""
    ck = M.load_checkpoint(blob)
    other = M.TokenClassifier(classes=8)
    other_opt = M.make_optimizer(other)
    M.train_step(other, other_opt, M.SmoothedCE(), next(iter(M.loader())))
    model = M.make_model()
    model.load_state_dict(ck["model"])
    opt = M.make_optimizer(model)
    opt.load_state_dict(other_opt.state_dict())
    crit = M.SmoothedCE()
    with pytest.raises(RuntimeError, match="must match the size"):
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path, factory=FACTORY,
                            start_step=SAVED) as rec:
            for _, batch in zip(range(2), M.loader(seed=1)):
                M.train_step(model, opt, crit, batch)
    assert rec.event is None and not list(tmp_path.glob("*.nan"))


@pytest.mark.parametrize("optimizer_after_load", [False, True])
def test_a_resume_by_assign_true_that_leaves_the_optimizer_behind_is_said_once(
        tmp_path, blob, caplog, optimizer_after_load):
    """A resume with a healthy checkpoint, loaded by ``load_state_dict(assign=True)`` inside the
    recorded block after the optimizer was built: ``step()`` updates the old tensors, the model
    never trains, and nothing goes non-finite. The first training step's close says so once;
    with the optimizer built again after the load (and the recorder told, by building it
    there), nothing is said."""
    model = M.make_model()
    opt = M.make_optimizer(model)
    crit = M.SmoothedCE()
    ck = M.load_checkpoint(blob)
    with caplog.at_level("WARNING", logger="nanreplay"):
        if optimizer_after_load:
            model.load_state_dict(ck["model"], assign=True)
            opt = M.make_optimizer(model)
            opt.load_state_dict(ck["optimizer"])
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path, factory=FACTORY):
            if not optimizer_after_load:
                model.load_state_dict(ck["model"], assign=True)
            before = model.head.weight.detach().clone()
            for _, batch in zip(range(3), M.loader()):
                M.train_step(model, opt, crit, batch)
    said = [r.getMessage() for r in caplog.records if "optimizer holds" in r.getMessage()]
    assert not list(tmp_path.glob("*.nan"))
    trained = not torch.equal(before, model.head.weight)
    assert trained == optimizer_after_load  # (the oracle: did the weights move)
    if optimizer_after_load:
        assert not said, said
        return
    n = len(list(model.parameters()))
    assert said == [said[0]] and said[0].startswith(
        f"nanreplay: the optimizer holds {n} parameter tensor(s), and none of them is among "
        "the model's now"), said
    assert "assign=True" in said[0] and "build the optimizer after" in said[0]

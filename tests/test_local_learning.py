"""End to end on learning rules without end-to-end backprop (``local_learning_models``):
Hinton's Forward-Forward (per-layer goodness, inputs normalised by their length, ``detach``
between layers), a predictive coding network relaxing its latents by gradient steps on a local
energy inside ``forward`` (``autograd.grad`` in a loop) before its local weight updates, target
propagation through a tanh layer's analytic inverse, and a
Hebbian feature layer updated in place under ``torch.no_grad()`` after a backprop-trained
readout's step. Each planted bug of the domain fires under the recorder and is replayed with
the CLI; the healthy versions raise no event and train bit-identically with and without the
recorder."""

from __future__ import annotations

import contextlib

import local_learning_models as M
import pytest
import torch
import torch.nn.functional as F
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

LOSSES = {"ff": M.ff_loss, "pc": M.pc_loss, "tp": M.pc_loss, "hebb": F.cross_entropy}


def line_of(text: str) -> str:
    return source_line("local_learning_models.py", text)


def train(kind: str, make: str, out_dir, bad: int | None = None, steps: int = 4,
          record: bool = True, hebb_lr: float = 0.01, oja: bool = True):
    """Adam over the trained parameters, a step schedule and gradient clipping; ``bad``: the
    FF sample blanked in the last step's batch. The Hebbian layer learns after each step of
    the readout, in place. Returns the model."""
    model = getattr(M, make)()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    crit = LOSSES[kind]
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"local_learning_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step in range(steps):
            if kind == "ff":
                loss = loss_fn(*model(*M.ff_batch(g, bad if step == steps - 1 else None)))
            elif kind == "pc":
                loss = loss_fn(model(*M.pc_batch(g)))
            elif kind == "tp":  # (bad: the record whose labels are written as +-1)
                last = bad is not None and step == steps - 1
                loss = loss_fn(model(*(M.tp_batch_saturated(g, bad) if last else M.tp_batch(g))))
            else:
                x, y = M.hebb_batch(g)
                logits, h = model(x)
                loss = loss_fn(logits, y)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if kind == "hebb":
                M.hebbian_update(model, x, h.detach(), lr=hebb_lr, oja=oja)
    return model


def fire(kind: str, make: str, tmp_path, bad: int | None = None, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(kind, make, tmp_path, bad, **kw)
    return info.value.event, info.value.bundle_path


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def test_ff_blank_record_normalised_without_eps_names_the_division_and_its_sample(tmp_path):
    """A Forward-Forward layer normalises its input by its length without eps; a blank record
    (its label pixels lost too) is 0/0 in the first layer's positive pass. The replay names the
    division in layers.0, call 0 (the positive batch's), its line and sample 5, says the
    divisor is the norm of all-zero records of the batch, and dropping the record makes the
    step finite."""
    ev, bundle = fire("ff", "make_ff", tmp_path, bad=5)
    assert (ev["step"], ev["phase"], ev["module"], ev["call"], ev["samples"], ev["kind"]) == (
        3, "forward", "layers.0", 0, [5], "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["call"], o["op"], o["samples"]) == (
        True, "layers.0", 0, "aten.div", [5]), o
    assert o["source"] == line_of("x = x / x.norm(dim=1, keepdim=True)"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "all zeros" in rep["hint"] and "norm > 0" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_predictive_coding_inference_rate_past_stability_says_the_loop_diverged(tmp_path):
    """The latents' inference rate raised to 3 to relax in fewer iterations: past the local
    energy's stability bound the relaxation inside forward diverges, and the energy's sum
    overflows at the first step, in every sample. The replay names that sum on the energy's
    line in the root's own loop, overflow, and says the loop running that line was diverging
    (the op's values at its earlier runs grew run after run), with the step size to lower."""
    ev, bundle = fire("pc", "make_pc_fast", tmp_path)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "forward", "", "+inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["all_samples"], rep["cause"]) == (
        "", "aten.sum", True, "overflow"), rep
    assert o["source"] == line_of("return sum(0.5 * (xs[i + 1] - p(torch.tanh(xs[i])))"), o
    assert o["line_run"] > 100, o
    assert "loop running that line was diverging" in rep["hint"], rep["hint"]
    assert "smaller inference step size" in rep["hint"], rep["hint"]
    assert any("run after run" in p for p in rep["problems"]), rep["problems"]


def test_target_propagation_label_at_tanhs_asymptote_names_the_atanh_and_its_record(tmp_path):
    """Target propagation with the target step taken to the label (beta = 1) pulls the output's
    target back through tanh's analytic inverse; one record's labels written as +-1 (tanh's
    asymptotes) make atanh infinite there, and the pseudo-inverse's matmul NaN. The replay
    names the atanh on its line, the record's sample, invalid math at the pole, and says to
    clamp its input inside (-1, 1); dropping the record makes the step finite."""
    ev, bundle = fire("tp", "make_tp_full", tmp_path, bad=6)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"], ev["kind"]) == (
        3, "forward", "", [6], "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=6")
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == (
        "", "aten.atanh", [6], "invalid"), rep
    assert o["source"] == line_of("t1 = (torch.atanh(t2) - self.l2.bias)"), o
    assert [c["op"] for c in o["chain"]] == ["aten.atanh", "aten.mm"], o["chain"]
    assert "of -1 and 1 (its poles)" in rep["hint"] and "inside (-1, 1)" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


@pytest.mark.parametrize("oja,lr,step", [(False, 0.5, 44), (True, 0.8, 6)])
def test_hebbian_rule_growing_the_weights_says_the_update_grew_them(tmp_path, oja, lr, step):
    """The Hebbian layer's rule with its Oja decay term left out grows the weights by a factor
    each step until a row overflows at step 44; Oja's rule at a rate past its stable range
    overshoots its decay term and overflows within six steps. Either way a weights event on
    hebb.weight, which no optimizer holds. The replay says the loop's own update wrote them,
    and, from the ring's history of hebb's output growing step after step, that the rule grew
    them without bound, with Oja's decay and row renormalisation as the fix."""
    ev, bundle = fire("hebb", "make_hebb", tmp_path, steps=60, hebb_lr=lr, oja=oja)
    assert (ev["step"], ev["phase"], ev["params"], ev["kind"]) == (
        step, "weights", ["hebb.weight"], "+inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], rep["cause"]) == ("weights", "weights"), rep
    assert o["source"] == line_of("h = F.relu(self.hebb(x))"), o
    assert "the loop's own update of them did" in rep["hint"], rep["hint"]
    assert "grew its weights without bound" in rep["hint"], rep["hint"]
    assert "Oja's decay" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("kind,make,kw", [
    ("ff", "make_ff_eps", {"bad": 5}), ("pc", "make_pc", {}), ("tp", "make_tp", {}),
    ("hebb", "make_hebb", {"steps": 20})])
def test_healthy_runs_raise_nothing_and_train_the_same(tmp_path, kind, make, kw):
    """FF with eps on its norm (a blank record normalises to 0, finite), predictive coding at
    a stable inference rate (autograd.grad on the energy in every one of 20 iterations) and
    Oja's rule: no event, bit-identical weights with and without the recorder."""
    recorded = train(kind, make, tmp_path, **kw)
    plain = train(kind, make, tmp_path, record=False, **kw)
    assert not list(tmp_path.glob("*.nan"))
    same_weights(recorded, plain)


def test_unrecorded_hebbian_run_ends_with_non_finite_weights(tmp_path):
    """Without the recorder the same run goes on with an infinite Hebbian layer: the event
    above is the bug, not a false alarm."""
    model = train("hebb", "make_hebb", tmp_path, steps=60, hebb_lr=0.5, oja=False,
                  record=False)
    assert not torch.isfinite(model.hebb.weight).all()


def train_per_layer(make: str, out_dir, bad: int | None, record: bool = True, steps: int = 5):
    """Forward-Forward with one Adam per layer, as most FF code trains; the recorder is given
    the first layer's, stepped first (docs/guide.md: two optimizers)."""
    model = getattr(M, make)()
    opts = [torch.optim.Adam(layer.parameters(), lr=0.03) for layer in model.layers]
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opts[0], loss_fn=M.ff_loss, out_dir=out_dir,
                         factory=f"local_learning_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else M.ff_loss
        for step in range(steps):
            loss = loss_fn(*model(*M.ff_batch(g, bad if step == steps - 1 else None)))
            for opt in opts:
                opt.zero_grad()
            loss.backward()
            for opt in opts:
                opt.step()
    return model


def test_ff_one_optimizer_per_layer_trains_the_same_and_names_the_blank_record(tmp_path):
    """Per-layer Adams: with eps, a blank record raises nothing and the weights are
    bit-identical with and without the recorder; without eps, the blank record's 0/0 is named
    in layers.0 on its sample, and dropping it (the unrecorded layer's Adam re-run from the
    bundle's weights) makes the step finite."""
    same_weights(train_per_layer("make_ff_eps", tmp_path, 3),
                 train_per_layer("make_ff_eps", tmp_path, 3, record=False))
    assert not list(tmp_path.glob("*.nan"))
    with pytest.raises(NonFiniteError) as info:
        train_per_layer("make_ff", tmp_path, 3)
    ev = info.value.event
    assert (ev["step"], ev["module"], ev["samples"]) == (4, "layers.0", [3]), ev
    rep = nanreplay_json(info.value.bundle_path, "--try", "drop=3")
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == (
        "layers.0", "aten.div", [3], "invalid"), rep
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def train_amp(out_dir, bad: int | None, record: bool = True, steps: int = 4):
    """FF with raw pixels into the first layer and summed goodness, under float16 autocast
    with a GradScaler (the loss in float32, threshold 64)."""
    model = M.make_ff_amp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=M.ff_loss, out_dir=out_dir, scaler=scaler,
                         factory="local_learning_models:make_ff_amp") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else M.ff_loss
        for step in range(steps):
            with torch.autocast("cpu", dtype=torch.float16):
                g_pos, g_neg = model(*M.ff_batch_unscaled(g, bad if step == steps - 1 else None))
            loss = loss_fn(g_pos.float(), g_neg.float(), 64.0)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return model


def test_ff_float16_goodness_of_an_unscaled_record_names_the_sum_and_the_data(tmp_path):
    """Under float16 autocast, one record left in [0, 255] makes its summed goodness
    (sum of 64 squared activations) overflow float16 in the positive pass: the replay names
    that sum on its line, sample 9, overflow, float16, and the record's out-of-scale data as
    the fix; dropping it makes the step finite. The same run on scaled records raises
    nothing and trains the same with and without the recorder."""
    same_weights(train_amp(tmp_path, None), train_amp(tmp_path, None, record=False))
    assert not list(tmp_path.glob("*.nan"))
    with pytest.raises(NonFiniteError) as info:
        train_amp(tmp_path, 9)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"], ev["kind"]) == (
        3, "forward", "", [9], "+inf"), ev
    rep = nanreplay_json(info.value.bundle_path, "--try", "drop=9")
    o = rep["origin"]
    assert (o["op"], o["samples"], o["dtype"], rep["cause"]) == (
        "aten.sum", [9], "float16", "overflow"), rep
    assert o["source"] == line_of("g_pos.append(h_pos.pow(2).sum(1)"), o
    assert "out of scale" in rep["hint"] and "args[0]" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]

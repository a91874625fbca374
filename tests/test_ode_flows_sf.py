"""End to end on continuous-time and density models written with torchdiffeq 0.2.5, zuko
1.6.0 and schedulefree 1.4.1 (``ode_flows_sf_models``): a neural ODE classifier under
``dopri5`` (whose own assertion ends a step with a NaN state), a Riccati growth model through
RK4, ``odeint_adjoint`` over a radial field (the backward solves the adjoint ODE), zuko's
conditional NSF and MAF trained by maximum likelihood (their hyper-networks called lazily
inside ``log_prob``, in the loss), a logit-space pixel flow, a density mixture averaged
outside log space, and schedule-free optimizers whose ``train()``/``eval()`` swap the weights
outside ``step()``. Each planted bug fires under the recorder and is replayed with the CLI;
the healthy runs raise no event and train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import ode_flows_sf_models as M
import pytest
import schedulefree
import torch
from bundles import nanreplay_json, source_line
from torch import nn
from torch.utils.data import DataLoader

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("ode_flows_sf_models.py", text)


def _slices(args, n):
    return [tuple(a[i:i + n] for a in args) for i in range(0, len(args[0]), n)]


def batches(kind: str):
    """Each step's (model args, loss args after the model's output), four steps."""
    if kind == "classifier":
        x, y = M.classification_data()
        return [((a,), (b,)) for a, b in _slices((x, y), 16)]
    if kind == "growth":
        y0, census = M.growth_data()
        return [((a,), (b,)) for a, b in _slices((y0, census), 8)]
    if kind == "adjoint":
        x, y = M.adjoint_data(64)
        return [((a,), (b,)) for a, b in _slices((x, y), 16)]
    if kind == "pixels":
        x, u = M.pixel_data(64)
        return [((a, b), ()) for a, b in _slices((x, u), 16)]
    x, c = M.flow_data(64)  # (a DataLoader over the records, as zuko's tutorials train)
    loader = DataLoader(M.FlowDataset(x, c), batch_size=16, shuffle=False)
    return [((cb,), (xb,)) for xb, cb in loader]


def train(make: str, kind: str, loss, out_dir, plant=None, opt=None, steps: int = 4,
          record: bool = True, evaluate: bool = False):
    """Maximum likelihood or regression with Adam (or ``opt(model)``: a schedule-free one,
    put in train mode before each step and in eval mode after it, as its docs ask); ``plant``
    edits the last step's batch; ``evaluate`` runs a no-grad forward after each step."""
    model = getattr(M, make)()
    optimizer = opt(model) if opt else torch.optim.Adam(model.parameters(), lr=1e-3)
    schedule_free = hasattr(optimizer, "eval")
    data = batches(kind)[:steps]
    torch.manual_seed(1)  # (the mixture's context draws)
    rec = FlightRecorder(model, optimizer, loss_fn=loss, out_dir=out_dir,
                         factory=f"ode_flows_sf_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else loss
        for step, (args, targets) in enumerate(data):
            if plant is not None and step == len(data) - 1:
                args, targets = plant(list(args), list(targets))
            if schedule_free:
                optimizer.train()
            model.train()
            optimizer.zero_grad()
            loss_fn(model(*args), *targets).backward()
            optimizer.step()
            if schedule_free:
                optimizer.eval()
            if evaluate:
                model.eval()
                with torch.no_grad():
                    model(*args)
    return model


def fire(make, kind, loss, tmp_path, plant, raises=NonFiniteError, **kw):
    """(the event, the bundle) of a run that raises ``raises``: the recorder's error, or a
    library's own (torch's argument check of a distribution given the NaN, torchdiffeq's
    assertion) that goes on with the recorder's summary as a note, the event read off the
    bundle then."""
    with pytest.raises(raises) as info:
        train(make, kind, loss, tmp_path, plant, **kw)
    if isinstance(info.value, NonFiniteError):
        return info.value.event, info.value.bundle_path
    assert any(n.startswith("nanreplay: ") for n in info.value.__notes__), info.value
    (bundle,) = tmp_path.glob("*.nan")
    return read_bundle(bundle, want=lambda name: False)[0]["event"], bundle


def at(i: int, row, value: float):
    """A plant: entries ``row`` of argument ``i`` (model args, then loss args) set to
    ``value``."""
    def plant(args, targets):
        both = args + targets
        t = both[i].clone()
        t[row] = value
        both[i] = t
        return tuple(both[:len(args)]), tuple(both[len(args):])
    return plant


def test_nan_record_under_dopri5_ends_the_step_with_the_solvers_assertion(tmp_path):
    """A NaN feature in record 5: dopri5's error ratio is NaN, every step is rejected until
    torchdiffeq asserts ``underflow in dt``. The AssertionError goes on, the recorder writes
    the bundle of the step its hooks saw NaN in, and the replay names the input record."""
    ev, bundle = fire("make_classifier", "classifier", nn.CrossEntropyLoss(), tmp_path,
                      at(0, (5, 2), float("nan")), raises=AssertionError)
    assert (ev["step"], ev["phase"], ev["samples"]) == (3, "input", [5]), ev
    rep = nanreplay_json(bundle)
    assert (rep["origin"]["samples"], rep["cause"]) == ([5], "input"), rep


def test_riccati_growth_overflows_in_the_field_at_the_record_past_its_blowup(tmp_path):
    """A species counted at 40 (the others below 0.5) is past ``d / r``: ``r y²`` blows up
    within the horizon and RK4's iterates follow it until ``r * y * y`` overflows in the
    field's 10th call, on that record; the hint says the iterates diverged and names the
    out-of-scale record."""
    ev, bundle = fire("make_growth", "growth", nn.MSELoss(), tmp_path, at(0, (3, 1), 40.0))
    assert (ev["step"], ev["phase"], ev["module"], ev["call"], ev["samples"], ev["kind"]) == (
        3, "forward", "field", 9, [3], "+inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["call"], o["op"], o["samples"]) == ("field", 9, "aten.mul", [3]), o
    assert o["source"] == line_of("return self.log_r.exp() * y * y"), o
    assert rep["cause"] == "overflow" and "diverging" in rep["hint"], rep["hint"]
    assert "--try drop=3" in rep["hint"], rep["hint"]


def test_adjoint_radial_field_at_a_blank_record_is_a_backward_sqrt_pole(tmp_path):
    """A record of all zeros through the bias-free encoder starts the state at the origin,
    where the field's radius ``sqrt(sum y²)`` is 0: the forward is finite (the field is 0
    there), the adjoint ODE's vjp of sqrt is 0 * inf. The replay names SqrtBackward0 in
    ``field`` on that record and calls it a blank record to fix or drop, not zeros a mask
    of the code's handles (the 0 entering the node is ``W y`` at y = 0); the adjoint's own
    Function, whose backward re-ran the field, is not named as a second maker."""
    ev, bundle = fire("make_adjoint", "adjoint", nn.MSELoss(), tmp_path, at(0, 4, 0.0))
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "backward", "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=4")
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"]) == (
        "backward", "field", "SqrtBackward0", [4]), o
    assert o["source"] == line_of("r = torch.sqrt((y * y).sum(-1, keepdim=True))"), o
    assert rep["cause"] == "invalid" and "vector_norm" in rep["hint"], rep["hint"]
    assert "blank record" in rep["hint"] and "keep those samples" not in rep["hint"], rep["hint"]
    assert "also" not in o and not any("fix is needed there too" in p
                                       for p in rep.get("problems", [])), rep
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


@pytest.mark.parametrize("make", ["flow_nsf", "flow_maf", "flow_cnf"])
def test_fill_value_in_a_flows_data_overflows_the_base_log_density(tmp_path, make):
    """A missing value stored as 1e20 in record 7: the NSF's splines pass it through outside
    their bound, the MAF's affine steps barely scale it, the CNF's adaptive solve (zuko's
    own adjoint Function) carries it, and the standard normal's ``z²`` overflows in
    ``log_prob``, zuko's line called from the loss ``nll``."""
    steps = 2 if make == "flow_cnf" else 4  # (the CNF's solves are the slow ones)
    ev, bundle = fire(make, "flow", M.nll, tmp_path, at(1, (7, 0), 1e20), steps=steps)
    assert (ev["step"], ev["phase"], ev["module"]) == (steps - 1, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["op"], o["samples"]) == ("loss", "aten.pow", [7]), o
    assert o["source"].endswith("zuko/distributions.py:119"), o
    assert o["called_from"] == line_of("return -dist.log_prob(x).mean()"), o
    assert rep["cause"] == "overflow" and "out of scale" in rep["hint"], rep["hint"]


def test_pixel_above_255_takes_the_logit_preprocessing_out_of_its_domain(tmp_path):
    """A pixel of 300 (an unclipped 8-bit image in a float tensor): the dequantised value
    lands above 1 and ``log(1 - p)`` is log of a negative number, in the root's own code. The
    flow's base Normal then refuses the NaN logits (torch's argument validation, on by
    default): that ValueError goes on, noted with the bundle of the step."""
    ev, bundle = fire("make_logit_flow", "pixels", M.mean_nll, tmp_path, at(0, (9, 2), 300.0),
                      raises=ValueError)
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "forward", ""), ev  # (no output)
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.log", "nan", [9]), o
    assert o["source"] == line_of("logit = torch.log(p) - torch.log(1 - p)"), o
    assert rep["cause"] == "invalid" and "negative" in rep["hint"], rep["hint"]


def test_density_mixture_averaged_outside_log_space_underflows(tmp_path):
    """A record far out (40 in every coordinate) has log-densities near -1000 under each
    context draw: ``exp`` underflows to 0 and the mixture's ``log`` is -inf; the replay says
    underflow and to compute it in log space (logsumexp)."""
    ev, bundle = fire("make_context_draws", "flow", M.mixture_nll, tmp_path, at(1, 6, 40.0))
    assert (ev["step"], ev["phase"]) == (3, "loss"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"]) == ("aten.log", "-inf", [6]), o
    assert o["source"] == line_of("return -torch.log(lp.exp().mean(0)).mean()"), o
    assert rep["cause"] == "underflow" and "logsumexp" in rep["hint"], rep["hint"]


def test_schedule_free_sgd_without_warmup_diverges_and_the_hint_names_its_warmup(tmp_path):
    """SGDScheduleFree at lr=10 (schedule-free SGD runs 10-50x a scheduled SGD's rate) with
    warmup_steps=0: the first updates take the full rate, the weights jump, and a
    hyper-network layer of the MAF overflows two steps in, inside ``log_prob``. The eval()
    and train() swaps between the steps are no event; the hint names the warmup that is
    off."""
    def sgd(m):
        return schedulefree.SGDScheduleFree(m.parameters(), lr=10.0, warmup_steps=0)
    ev, bundle = fire("flow_maf", "flow", M.nll, tmp_path, None, opt=sgd, evaluate=True,
                      raises=ValueError)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (
        2, "forward", "transform.transforms.1.hyper.0", "+inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["samples"]) == (
        True, "transform.transforms.1.hyper.0", "aten.addmm", list(range(16))), o
    assert rep["cause"] == "overflow", rep["cause"]
    assert "SGDScheduleFree runs with warmup_steps=0" in rep["hint"], rep["hint"]
    assert "the event came at step 2" in rep["hint"], rep["hint"]


def adamw_sf(m):
    return schedulefree.AdamWScheduleFree(m.parameters(), lr=1e-3, warmup_steps=2)


@pytest.mark.parametrize("make,kind,loss,opt", [
    ("make_classifier", "classifier", nn.CrossEntropyLoss(), None),
    ("make_adjoint", "adjoint", nn.MSELoss(), None),
    ("flow_nsf", "flow", M.nll, adamw_sf),
    ("make_context_draws", "flow", M.mixture_nll, adamw_sf),
])
def test_healthy_runs_raise_nothing_and_train_the_same(tmp_path, make, kind, loss, opt):
    """dopri5 under error control, the adjoint's backward ODE, zuko's lazily built
    transforms, and AdamWScheduleFree's eval()/train() swaps of the weights around each step
    with a no-grad evaluation forward between them: no event, bit-identical weights."""
    recorded = train(make, kind, loss, tmp_path, opt=opt, evaluate=True)
    plain = train(make, kind, loss, tmp_path, opt=opt, evaluate=True, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_logit_of_a_dequantised_255_rounded_to_1_is_precision(tmp_path):
    """The logit without RealNVP's squeeze (``alpha = 0``): pixel 255 with dequantisation
    noise 0.999996 is 255.999996, which float32 rounds to 256, so ``p`` is exactly 1 and
    ``log(1 - p)`` is -inf where exact arithmetic gives log(1.6e-8): precision, not invalid
    math, on that record."""
    def plant(args, targets):
        x, u = args[0].clone(), args[1].clone()
        x[9, 2], u[9, 2] = 255.0, 0.999996
        return (x, u), targets
    ev, bundle = fire("make_logit_flow_unsqueezed", "pixels", M.mean_nll, tmp_path, plant,
                      raises=ValueError)  # (the base Normal then refuses the logit's +inf)
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "forward", ""), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.log", "-inf", [9]), o
    assert o["source"] == line_of("logit = torch.log(p) - torch.log(1 - p)"), o
    assert rep["cause"] == "precision" and "rounding" in rep["hint"], rep["hint"]


def mixture_run(out_dir=None, steps: int = 30):
    """The flow mixture under Adam at lr 0.1, a 64-record slice of 512 per step (the slices
    cycle), under the recorder writing to ``out_dir``; with none, a plain run that stops at
    the first step whose model output is not finite and returns (step, its records, the
    weights that step ran with), or None."""
    model = M.make_flow_mixture()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x, c = M.flow_data(512)
    rec = FlightRecorder(model, opt, loss_fn=M.mean_nll, out_dir=out_dir,
                         factory="ode_flows_sf_models:make_flow_mixture") \
        if out_dir is not None else None
    with rec if rec is not None else contextlib.nullcontext():
        for step in range(steps):
            i = slice(step % 8 * 64, step % 8 * 64 + 64)
            out = model(x[i], c[i])
            if rec is None and not out.isfinite().all():
                return step, (~out.isfinite()).nonzero().flatten().tolist(), \
                    model.weights.detach().clone()
            loss = rec.loss_fn(out) if rec is not None else M.mean_nll(out)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return None


def test_mixture_weight_stepped_below_zero_is_named_at_the_log_of_the_density(tmp_path):
    """Two NSFs mixed by weights normalised by their sum, not a softmax: Adam steps the
    second weight below 0 (by step 20 on the Xeon this was written on), and some steps later
    the mixture density of a record where that component dominates is negative: log of it is
    NaN (step 24, record 50 there; the step, the record and the weight's value at it are
    rounding's, so a plain run without the recorder says which). The hint names the
    parameter ``weights`` with its negative entry and says to keep it non-negative by
    construction (softmax of logits), not to clamp the log's input."""
    step, records, weights = mixture_run()  # (the oracle: the same training, unwatched)
    assert weights.min() < 0 < weights.max() and records, (step, records, weights)
    with pytest.raises(NonFiniteError) as info:
        mixture_run(tmp_path)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        step, "forward", "", records), (ev, step, records)
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.log", "nan", records), o
    assert o["source"] == line_of("return torch.log((lp.exp() * w).sum(-1))"), o
    assert rep["cause"] == "invalid", rep["cause"]
    said = f"weights (min {float(weights.min()):.3g}) holds negative entries"
    assert said in rep["hint"], (said, rep["hint"])
    assert "softmax(logits)" in rep["hint"], rep["hint"]


def growth_under_schedule_free(tmp_path, train_first: bool):
    """The growth model under AdamWScheduleFree, the record at 40 in the last step's batch;
    ``train_first``: ``optimizer.train()`` at the top of the loop, as schedule_free's docs
    ask, else just before ``optimizer.step()`` (after the forward and backward)."""
    model = M.make_growth()
    opt = schedulefree.AdamWScheduleFree(model.parameters(), lr=0.05, warmup_steps=2)
    y0, census = M.growth_data()
    crit = nn.MSELoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="ode_flows_sf_models:make_growth"):
            opt.eval()
            for step in range(4):
                x = y0[8 * step:8 * step + 8].clone()
                if step == 3:
                    x[3, 1] = 40.0
                if train_first:
                    opt.train()
                opt.zero_grad()
                crit(model(x), census[8 * step:8 * step + 8]).backward()
                if not train_first:
                    opt.train()
                opt.step()
                opt.eval()
    return info.value.event, info.value.bundle_path


@pytest.mark.parametrize("train_first", [True, False])
def test_schedule_free_train_after_the_forward_is_said_not_blamed_on_the_factory(
        tmp_path, train_first):
    """Called in order, ``optimizer.train()`` swaps the weights to y between steps: the RK4
    overflow on the record at 40 is reproduced and named. Called after the forward, the
    forward ran on the eval-mode x and ``train()`` moved the weights in place before
    ``step()``, which closes the step: the bundle holds y, the re-run differs, and the
    report said the factory builds a different model; it now says the loop moved the
    weights after the forward (schedule-free's ``train()`` out of order)."""
    ev, bundle = growth_under_schedule_free(tmp_path, train_first)
    assert (ev["step"], ev["phase"], ev["module"], ev["call"], ev["samples"]) == (
        3, "forward", "field", 9, [3]), ev
    rep = nanreplay_json(bundle, code=None)
    if train_first:
        o = rep["origin"]
        assert (rep["reproduced"], o["op"], o["samples"], rep["cause"]) == (
            True, "aten.mul", [3], "overflow"), rep
        return
    assert rep["reproduced"] is False, rep
    assert "its weights are not those the step ran with" in rep["hint"], rep["hint"]
    assert rep["fidelity"]["moved_after"] is True, rep["fidelity"]


@pytest.mark.parametrize("validate", [True, False])
def test_nan_in_the_flows_data_is_named_as_the_losss_input_not_invalid_math(tmp_path, validate):
    """A NaN in record 53 of the data a conditional NSF models, loaded by a DataLoader with
    two workers: zuko builds the transforms lazily and runs their hyper-networks inside
    ``log_prob``, in the loss, on that data; the first NaN is a MaskedLinear's output there.
    The event was a forward one at that layer and the replay said ``invalid`` (no op, the
    generic advice); both now say the NaN came in with the loss's data argument, on that
    record (sample 5 of the fourth batch). With torch's argument validation (on by default)
    the base Normal then refuses the NaN and its ValueError goes on; without it the loss is
    NaN through zuko's spline, whose own in-bounds mask (``mask * (x - x0)``) the hint read as
    the user's mask meant to drop missing targets."""
    torch.distributions.Distribution.set_default_validate_args(validate)  # (conftest resets)
    x, c = M.flow_data(64)
    x[53, 1] = float("nan")
    model = M.flow_nsf()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = DataLoader(M.FlowDataset(x, c), batch_size=16, num_workers=2)
    with pytest.raises(ValueError if validate else NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.nll, out_dir=tmp_path,
                            factory="ode_flows_sf_models:flow_nsf") as rec:
            for xb, cb in loader:
                loss = rec.loss_fn(model(cb), xb)
                opt.zero_grad()
                loss.backward()
                opt.step()
    del loader
    if validate:  # (the base Normal's check refused the NaN: the recorder's note on it)
        assert any(n.startswith("nanreplay: ") for n in info.value.__notes__), info.value
    (bundle,) = tmp_path.glob("*.nan")
    ev = read_bundle(bundle, want=lambda name: False)[0]["event"]
    assert (ev["step"], ev["phase"], ev["module"], ev["tensor"], ev["samples"]) == (
        3, "input", "<loss>", "loss_args[1]", [5]), ev
    assert ev["detail"].endswith("taken in by transform.transforms.0.hyper.0, which the loss "
                                 "called"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["tensor"], o["samples"], rep["cause"]) == (
        "input", "loss_args[1]", [5], "input"), rep
    assert "fix the data pipeline for these samples" in rep["hint"], rep["hint"]
    assert "meant to drop" not in rep["hint"], rep["hint"]

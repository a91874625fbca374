"""Statistics are written into preallocated slots: right values, no per-statistic allocation,
and a step that needs more slots than there are still records everything."""

from __future__ import annotations

import math

import models as M
import pytest
import torch
from models import check_event
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from recorder.ring import decode_call
from recorder.slots import GRAD, LOOSE, STRICT, Slots, flat_view, split_extrema

CPU = torch.device("cpu")


def _v(slots: Slots, ref) -> float:
    return slots.value(ref).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_reductions_match_torch(dtype):
    slots = Slots(CPU, n=64)
    x = torch.randn(5, 7).to(dtype)
    lo, hi = slots.minmax(x, STRICT)
    assert (_v(slots, lo), _v(slots, hi)) == (x.min().item(), x.max().item())
    assert _v(slots, slots.total(x, LOOSE)) == pytest.approx(x.float().sum().item(), rel=1e-5)
    assert _v(slots, slots.norm(x, LOOSE)) == pytest.approx(x.float().norm().item(), rel=1e-5)
    assert _v(slots, slots.sq_norm(x, GRAD)) == \
        pytest.approx(x.float().norm().item() ** 2, rel=1e-5)
    small = [torch.randn(3).to(dtype) for _ in range(4)]
    assert [_v(slots, r) for r in slots.sq_norms(small, GRAD)] == \
        pytest.approx([t.float().norm().item() ** 2 for t in small], rel=1e-5)
    # every statistic is in its region's slots, in order: one vector per region
    strict, grad, nan_only, loose = slots.gather()
    assert (strict.numel(), grad.numel(), nan_only.numel(), loose.numel()) == (2, 5, 0, 2)
    assert strict.tolist() == [_v(slots, lo), _v(slots, hi)]
    assert grad.numel() == 5 and loose.numel() == 2
    # ...read in place: gathering copies nothing
    for vec, code in ((strict, STRICT), (grad, GRAD), (loose, LOOSE)):
        assert vec.data_ptr() == slots._regions[code].data.data_ptr()


def test_relu_of_a_pair():
    slots = Slots(CPU)
    for lo_v, hi_v in [(-2.0, 3.0), (-float("inf"), float("inf")), (float("nan"),) * 2,
                       (-3.0, -1.0)]:
        lo, hi = slots.minmax(torch.tensor([lo_v, hi_v]), LOOSE)
        r_lo, r_hi = slots.relu(lo, hi, STRICT)
        want = torch.relu(torch.tensor([lo_v, hi_v]))
        got = torch.tensor([_v(slots, r_lo), _v(slots, r_hi)])
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_non_finite_values_survive_the_reductions():
    slots = Slots(CPU)
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(100)
        x[37] = bad
        lo, hi = slots.minmax(x, STRICT)
        assert not (math.isfinite(_v(slots, lo)) and math.isfinite(_v(slots, hi)))
        assert not math.isfinite(_v(slots, slots.total(x, LOOSE)))
        assert not math.isfinite(_v(slots, slots.sq_norm(x, GRAD)))


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "transposed"])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf")])
def test_min_and_max_of_large_and_strided_outputs(layout, bad):
    """Large or strided float32 outputs take two reductions (amin, amax) instead of one aminmax
    on CPU: the same values, NaN anywhere still NaN in both, an infinity still the extreme."""
    x = torch.randn(8, 16, 32, 32)  # 131072 elements: past the split
    if bad is not None:
        x.view(-1)[5001] = bad
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "transposed":
        x = x.view(-1)[:8192].view(64, 128).t()  # 8192 elements, not contiguous
    assert split_extrema(x)
    slots = Slots(CPU)
    lo, hi = slots.minmax(x, STRICT)
    want_lo, want_hi = torch.aminmax(x)
    got = torch.tensor([_v(slots, lo), _v(slots, hi)])
    want = torch.stack([want_lo, want_hi])
    assert torch.equal(got.isnan(), want.isnan()) and \
        torch.equal(got.nan_to_num(), want.nan_to_num())
    if bad is not None:
        assert not (math.isfinite(got[0]) and math.isfinite(got[1]))
    if bad is not None and bad != bad:
        assert got.isnan().all()
    if bad == float("inf"):
        assert got[1] == bad
    if bad == -float("inf"):
        assert got[0] == bad


def test_norms_of_channels_last_and_transposed_tensors_read_them_in_place():
    """A gradient or weight whose elements fill one dense block (channels-last, transposed) is
    normed through a flat view of that block, not a copy; a strided slice is copied."""
    base = torch.randn(4, 3, 5, 5)
    for t in (base, base.contiguous(memory_format=torch.channels_last),
              base.reshape(12, 25).t()):
        flat = flat_view(t, copy=False)
        assert flat is not None and flat.data_ptr() == t.data_ptr()
        assert sorted(flat.tolist()) == sorted(t.flatten().tolist())
        slots = Slots(CPU)
        assert _v(slots, slots.sq_norm(t, GRAD)) == pytest.approx(t.norm().item() ** 2, rel=1e-5)
    sliced = base[:, :2]
    assert flat_view(sliced, copy=False) is None
    assert torch.equal(flat_view(sliced), sliced.reshape(-1))


def test_running_out_keeps_the_rest_apart_then_grows():
    slots = Slots(CPU, n=5)
    slots.start_step()
    refs = [slots.minmax(torch.tensor([float(i), i + 1.0]), STRICT) for i in range(4)]
    assert [(_v(slots, a), _v(slots, b)) for a, b in refs] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    # the third pair did not fit in the 5 slots: it and all after it are kept apart, numbered
    # on from the slots (the lone fifth slot is left zeroed, a finite value no ref names), so
    # every ref indexes the gathered region
    row = slots.gather()[STRICT]
    assert slots.short and row.numel() == 5 + 4
    assert [(row[a[1]].item(), row[b[1]].item()) for a, b in refs] == [(0, 1), (1, 2), (2, 3),
                                                                       (3, 4)]
    assert row[4].item() == 0.0
    slots.start_step()
    assert not slots.short and [v.numel() for v in slots.gather()] == [0, 0, 0, 0]
    for i in range(4):
        slots.minmax(torch.tensor([float(i), i + 1.0]), STRICT)
    assert not slots.short and slots.gather()[0].tolist() == [0, 1, 1, 2, 2, 3, 3, 4]


def test_values_from_other_dtypes_are_copied_into_slots():
    slots = Slots(CPU)
    lo, hi = slots.minmax(torch.tensor([1.0, 2.0], dtype=torch.float16), STRICT)
    assert slots.value(lo).data_ptr() == slots.gather()[0].data_ptr()
    assert slots.gather()[0].tolist() == [1.0, 2.0]


def test_a_step_never_allocates_its_statistics(out_dir):
    """Every statistic of a float32 CPU step lives in the recorder's preallocated slots."""
    model, crit = M.mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir) as rec:
        for step in range(3):
            x, y = M.batch(step)
            opt.zero_grad()
            crit(model(x), y).backward()
            slots = rec.cycle.tape.slots
            opt.step()
            assert not slots.short and sum(v.numel() for v in slots.gather()) > 10
            assert all(not r.extra for r in slots._regions)


def test_more_statistics_than_slots(out_dir):
    """A model needing more than the first allocation: the first step falls back, the ring
    has every value, and the next steps have room for all of them; their rows, the grown slots
    copied whole, are longer than the ring was made for it, which grows once to store them."""
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(200)])  # > 256 statistics
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    outs = []
    model[150].register_forward_hook(lambda m, a, o: outs.append(o.detach().clone()))
    with FlightRecorder(model, opt, out_dir=out_dir) as rec:
        for step in range(3):
            opt.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            if step == 0:
                assert rec.cycle.slots.short
        assert not rec.cycle.slots.short
    assert rec.cycle.ring.truncated == 0
    rows = rec.cycle.ring.ordered_rows()
    for row, layout, out in zip(rows, rec.cycle.ring.layouts, outs):
        call = [c for c in layout.materialize().calls if c[0] == 151][0]
        (lo, hi), = call[3]
        assert (row[lo], row[hi]) == (out.min().item(), out.max().item())


@pytest.mark.parametrize("stats", ["minmax", "full"])
def test_float64_model_is_recorded(out_dir, stats):
    """float64 weights, many small ones (one foreach call): norms in float64, stored float32."""
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(10)]).double()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with FlightRecorder(model, opt, out_dir=out_dir, stats=stats) as rec:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
            norms = [p.grad.norm().item() ** 2 for p in model.parameters()]
            opt.step()
    assert rec.health.internal_errors == 0
    layout = rec.cycle.ring.layouts[-1].materialize()
    row = rec.cycle.ring.ordered_rows()[-1]
    assert [row[k] for _, k in sorted(layout.grads)] == pytest.approx(norms, rel=1e-5)
    assert len(layout.params) == (20 if stats == "full" else 0)


# ---------------------------------------------------------------------------------------------
# statistics derived or reused without a pass over the tensor


class _AddThenReLU(nn.Module):
    """A ReLU whose input is functional code's (no module produced it), then a flatten view."""

    def __init__(self, inplace: bool):
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.relu = nn.ReLU(inplace=inplace)
        self.relu2 = nn.ReLU(inplace=inplace)
        self.head = nn.Linear(12, 2)

    def forward(self, x):
        h = self.relu(self.lin(x))  # input made by a module
        h = self.relu2(h * self.poison - 1.0)  # input made by the parent's own code
        return self.head(h.reshape(-1, 12))  # a whole view of relu2's output


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("poison", [1.0, float("nan"), float("inf"), -float("inf")])
def test_relu_statistics_are_those_of_its_output(out_dir, inplace, poison):
    model = _AddThenReLU(inplace)
    model.poison = poison
    outs = {}
    for name in ("relu", "relu2"):
        getattr(model, name).register_forward_hook(
            lambda m, a, o, name=name: outs.__setitem__(name, o.detach().clone()))
    on_event = "warn"  # NaN is an event; this test is about the numbers
    with FlightRecorder(model, out_dir=out_dir, on_event=on_event) as rec:
        model(torch.randn(4, 4))
        rec.end_step()
    layout = rec.cycle.ring.layouts[-1].materialize()
    row = rec.cycle.ring.ordered_rows()[-1]
    names = rec.target.module_names
    calls = {names[c[0]]: c for c in layout.calls}
    _, tables = rec.cycle.ring.export(n_params=4, n_groups=0)  # what a bundle holds
    exported = {names[m]: tables["ring/calls"][-1, j, :2].tolist()
                for j, m in enumerate(tables["ring/call_module"][-1].tolist()) if m >= 0}
    for name, out in outs.items():
        d = decode_call(row, calls[name])
        want = (out.min().item(), out.max().item())
        if out.isnan().any():
            assert math.isnan(d["min"]) and math.isnan(d["max"])
            assert all(map(math.isnan, exported[name]))
        else:
            assert (d["min"], d["max"]) == want
            assert exported[name] == list(want)
    # the head's input is a flatten of relu2's output: same statistics, no new reduction
    # (False: an inner output's +-Inf is no event by default, see strict_inf, but it makes the
    # next call's inputs non-finite; only an allow_inf module's leaves them finite)
    assert calls["head"][5] == ((*calls["relu2"][3][0], False),)
    if poison == 1.0:
        assert rec.event is None
    else:  # relu2's input was already non-finite: the parent's own code is blamed, not relu2
        assert rec.event["module"] == "" and rec.event["phase"] == "forward"


def test_relu_after_a_nan_blames_the_producer(out_dir):
    model = nn.Sequential(nn.Linear(4, 4), M.LogOf(), nn.ReLU(), nn.Linear(4, 2))
    model[1].armed = True
    with FlightRecorder(model, out_dir=out_dir, on_event="warn") as rec:
        model(torch.randn(8, 4))
        rec.end_step()
    assert rec.event["module"] == "1" and rec.event["phase"] == "forward"


class _ComplexLayer(nn.Module):
    """A complex weight (a spectral or unitary layer), read out through its magnitude."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(M.D_IN, 8, dtype=torch.complex64))
        self.head = nn.Linear(8, M.N_CLASSES)

    def forward(self, x):
        return self.head((x.to(torch.complex64) @ self.w).abs())


def test_a_complex_parameter_is_recorded_and_checked(out_dir):
    """A complex gradient's and weight's norms are real (float32 for complex64): recorded like
    any other, and a NaN in the complex weight is an event naming it (the recorder used to ask
    for a float32 norm of it, fail, and switch itself off)."""
    model, crit = _ComplexLayer(), nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    grad_norms = []
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir) as rec:
            for step in range(5):
                if step == 3:
                    with torch.no_grad():
                        model.w[2, 5] = complex(float("nan"), 0.0)
                x, y = M.batch(step)
                opt.zero_grad()
                crit(model(x), y).backward()
                grad_norms.append(model.w.grad.abs().pow(2).sum().sqrt().item())
                opt.step()
    assert rec.health.internal_errors == 0
    ev = info.value.event  # written between two updates, the last of which left it finite
    assert (ev["step"], ev["phase"], ev["params"], ev["last_update_step"]) == (3, "weights",
                                                                               ["w"], 2)
    _, tables = rec.cycle.ring.export(n_params=3, n_groups=1)
    assert tables["ring/grad_norms"][:3, 0].tolist() == pytest.approx(grad_norms[:3], rel=1e-5)


def test_the_root_output_made_by_its_last_layer_is_reduced_once(out_dir):
    """A language model's logits are the root's output and its head's: the head's min and max
    (checked for NaN only) are copied into the must-be-finite slots, not computed again over
    the whole output; +inf there is still an event of the root's output."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 500))
    opt, crit = torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss()
    seen = []

    class Reductions(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("aminmax", "amin", "amax"):
                seen.append(args[0].shape)
            return func(*args, **(kwargs or {}))

    def step(ids, target):
        logits = model(ids)
        loss = crit(logits.flatten(0, 1), target.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()

    ids, target = torch.randint(0, 50, (4, 12)), torch.randint(0, 500, (4, 12))
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir):
            step(ids, target)
            with Reductions():
                step(ids, target)
            assert seen.count((4, 12, 500)) == 1, seen  # the head's, once
            with torch.no_grad():  # class 7's logit overflows (the ReLU's outputs are >= 0)
                model[3].weight[7] = 3e38
            step(ids, target)
    ev = info.value.event
    assert (ev["phase"], ev["module"], ev["kind"]) == ("forward", "3", "+inf"), ev


def test_relu_of_an_allowed_infinity_is_checked_as_its_own(out_dir):
    """Under strict_inf, a layer allowed to return +-Inf followed by a ReLU that is not: the
    ReLU's output is checked must-be-finite, so the +Inf it passes on is an event at the ReLU
    (its statistics cannot be left to the allowed layer's NaN-only check)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with torch.no_grad():
        model[0].weight[1] = 3e38  # finite weights whose products overflow to +Inf
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, out_dir=out_dir, strict_inf=True, allow_inf=["0"]) as rec:
            model(torch.rand(8, 4) + 1.0)
            rec.end_step()
    ev = info.value.event
    assert (ev["module"], ev["phase"], ev["kind"]) == ("1", "forward", "+inf"), ev


@pytest.mark.parametrize("strict_inf", [False, True])
def test_a_model_ending_in_relu_checks_its_output(out_dir, strict_inf):
    """The root's output is a ReLU's (a Sequential ending in one): an +Inf made inside reaches
    it and is an event, at the layer that made it under either policy."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with torch.no_grad():
        model[0].weight[1] = 3e38  # finite weights whose products overflow to +Inf
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, out_dir=out_dir, strict_inf=strict_inf) as rec:
            out = model(torch.rand(8, 4) + 1.0)
            rec.end_step()
    assert out[:, 1].isinf().all()
    ev = info.value.event
    assert (ev["module"], ev["phase"], ev["kind"]) == ("0", "forward", "+inf"), ev
    layout = rec.cycle.ring.layouts[-1].materialize()
    row = rec.cycle.ring.ordered_rows()[-1]
    root = next(c for c in layout.calls if c[0] == 0)
    assert (decode_call(row, root)["min"], decode_call(row, root)["max"]) == (0.0, math.inf)


# ---------------------------------------------------------------------------------------------
# many small parameters: their norms in one foreach call each, chosen by C loops


def _conv_bn_net(channels_last: bool) -> nn.Module:
    """A small CNN as vision code writes it: 26 parameters, each under the size whose norms
    are batched (conv kernels, biases, BatchNorm's affine pairs)."""
    layers, c = [], 3
    for _ in range(6):
        layers += [nn.Conv2d(c, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()]
        c = 8
    net = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    return net.to(memory_format=torch.channels_last) if channels_last else net


@pytest.mark.parametrize("channels_last", [False, True])
def test_small_parameters_gradient_and_update_norms(out_dir, channels_last):
    """Each small parameter's squared gradient norm before the update and squared weight
    norm right after it are the step's, in the row, under the parameter's own index."""
    torch.manual_seed(0)
    model = _conv_bn_net(channels_last)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    crit = nn.CrossEntropyLoss()
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir) as rec:
        assert len(rec.target.small) == 26 and not rec.target.large
        for _ in range(4):
            opt.zero_grad()
            crit(model(torch.randn(4, 3, 8, 8)), torch.randint(0, 4, (4,))).backward()
            grads = [p.grad.norm().item() ** 2 for p in model.parameters()]
            opt.step()
            weights = [p.detach().norm().item() ** 2 for p in model.parameters()]
        opt.zero_grad()
        crit(model(torch.randn(4, 3, 8, 8)), torch.randint(0, 4, (4,))).backward()
        opt.step()  # (its row holds the evidence of step 3's update)
    assert rec.health.internal_errors == 0
    rows, layouts = rec.cycle.ring.ordered_rows(), rec.cycle.ring.layouts
    step3, step4 = layouts[-2].materialize(), layouts[-1].materialize()
    assert [i for i, _ in step3.grads] == list(range(26))
    assert [rows[-2][k] for _, k in step3.grads] == pytest.approx(grads, rel=1e-4)
    assert step4.update_step == 3 and [i for i, _ in step4.updates] == list(range(26))
    assert [rows[-1][k] for _, k in step4.updates] == pytest.approx(weights, rel=1e-4)


def test_nan_gradient_of_one_small_parameter_is_named(out_dir):
    """A NaN in one BatchNorm bias's gradient (the only non-finite value of the step) is a
    backward event naming that parameter, at the step it came."""
    torch.manual_seed(0)
    model = _conv_bn_net(False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    crit = nn.CrossEntropyLoss()
    bias = model[7].bias
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir):
            for step in range(5):
                if step == 3:
                    bias.register_hook(lambda g: g * float("nan"))
                opt.zero_grad()
                crit(model(torch.randn(4, 3, 8, 8)), torch.randint(0, 4, (4,))).backward()
                opt.step()
    ev = info.value.event
    check_event(ev, step=3, phase="backward", params=["7.bias"])


def test_nan_update_of_one_small_parameter_is_named(out_dir):
    """An update that writes NaN into one BatchNorm weight (its own parameter group, whose
    learning rate a broken schedule made NaN) is an optimizer event naming it, at the step
    whose update it was (read with the next step's one host read)."""
    torch.manual_seed(0)
    model = _conv_bn_net(False)
    weight = model[4].weight
    opt = torch.optim.SGD([{"params": [p for p in model.parameters() if p is not weight]},
                           {"params": [weight]}], lr=1e-2)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir):
            for step in range(5):
                if step == 2:
                    opt.param_groups[1]["lr"] = float("nan")
                opt.zero_grad()
                crit(model(torch.randn(4, 3, 8, 8)), torch.randint(0, 4, (4,))).backward()
                opt.step()
    check_event(info.value.event, step=2, phase="optimizer", params=["4.weight"],
                after_update=True)


def test_the_history_shares_the_refs_of_steps_that_took_the_same_slots(tmp_path):
    """Steps that take the same slots in the same order share one copy of their refs in the
    ring's history (no objects kept per step); a step laid out otherwise (two micro-batches)
    keeps its own, and every step still decodes to its own calls."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = nn.CrossEntropyLoss()
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path) as rec:
        for step in range(6):
            opt.zero_grad()
            for _ in range(2 if step == 3 else 1):  # step 3 accumulates two micro-batches
                crit(model(torch.randn(5, 4)), torch.randint(0, 2, (5,))).backward()
            opt.step()
        layouts = list(rec.cycle.ring.layouts)
    assert [lay.step for lay in layouts] == list(range(6))
    # (step 0 has no update before it; after step 3 the refs are new again, then shared)
    raws = [id(lay.raw) for lay in layouts]
    assert raws[1] == raws[2] and raws[4] == raws[5] and len(set(raws)) == 4
    micro_batches = [{mb for _, mb, *_ in lay.materialize().calls} for lay in layouts]
    assert micro_batches == [{0}, {0}, {0}, {0, 1}, {0}, {0}]

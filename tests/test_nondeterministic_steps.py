"""Steps a replay cannot make again, because they compute with state the bundle does not hold
(``nondeterministic_models``): the report names the first op where two re-runs part ways, its
line and module, and why (a tensor made outside torch, other Python arguments, the op itself);
state kept where the bundle holds it replays."""

from __future__ import annotations

import contextlib

import nondeterministic_models as M
import numpy as np
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("nondeterministic_models.py", text)


def fire(make: str, tmp_path, features: int = 4, steps: int = 300) -> int:
    """Adam on random regression batches until the recorder stops the run; the event's step."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=torch.nn.MSELoss(), out_dir=tmp_path,
                         factory=f"nondeterministic_models:{make}")
    with pytest.raises(NonFiniteError) as info, rec:  # (the first step it NaN in)
        for _ in range(steps):
            x, y = torch.randn(8, features, generator=g), torch.randn(8, 1, generator=g)
            loss = rec.loss_fn(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return info.value.event["step"]


def replayed(tmp_path) -> dict:
    (bundle,) = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle, code=1)
    assert (rep["reproduced"], rep["cause"]) == (False, "not_reproduced"), rep["cause"]
    assert "two re-runs of the step disagree: nondeterminism" in rep["problems"], rep["problems"]
    return rep


def test_masks_from_a_fresh_numpy_generator_are_named_where_torch_takes_them(tmp_path):
    """Dropout masks drawn from ``np.random.default_rng()`` made at each call (seeded from the
    OS: no bundle can hold it): a row that kept nothing is 0/0. Each re-run draws other masks,
    NaN in other rows (not "reproduced", as when two runs NaN anywhere compared equal): the
    first op that differs takes the NumPy array into torch, on the mask's line, in the
    dropout module; the hint names such generators."""
    fire("make_drop_fresh", tmp_path)
    rep = replayed(tmp_path)
    d = rep["diverged"]
    assert (d["op"], d["why"], d["phase"], d["module"], d["source"]) == (
        "aten.lift_fresh", "outside", "forward", "1",
        line_of("keep = torch.from_numpy(self.draw(tuple(x.shape)) > self.p)")), d
    assert "numpy.random.default_rng()" in rep["hint"], rep["hint"]
    assert any("a tensor no torch op of the step made" in p for p in rep["problems"])


def test_masks_numpy_writes_into_a_torch_buffer_are_named_as_inputs_written_outside_torch(
        tmp_path):
    """The same fresh draws written by NumPy into ``torch.zeros_like(x)`` through ``.numpy()``:
    no op sees the write and the buffer's version does not move, so a fingerprint kept by
    version would call the comparison that reads it nondeterministic (before: ``aten.gt``,
    "the same inputs gave another result", use_deterministic_algorithms). Fingerprinted afresh,
    the comparison's input 0 differs, a tensor the step made: ``inputs``, on its line, in the
    dropout module; the note and hint say it was written behind torch's back and what to do."""
    fire("make_drop_numpy_view", tmp_path)
    rep = replayed(tmp_path)
    d = rep["diverged"]
    assert (d["op"], d["why"], d["input"], d["phase"], d["module"], d["source"]) == (
        "aten.gt", "inputs", 0, "forward", "1", line_of("keep = (u > self.p).to(x.dtype)")), d
    assert any("no torch op was seen (NumPy through .numpy()" in p for p in rep["problems"])
    assert "t.numpy()" in rep["hint"] and "use_deterministic_algorithms" not in rep["hint"], \
        rep["hint"]


def test_masks_from_a_torch_generator_seeded_from_the_clock_blame_the_generator(tmp_path):
    """The masks drawn with ``torch.rand(generator=g)``, ``g`` seeded from ``time.time_ns()``
    at each call: the same inputs draw other values in each re-run. The draw is named on its
    line, in the dropout module, as ``generator`` (before: ``op``, "aten.rand is not
    deterministic", use_deterministic_algorithms), the hint says to keep the generator on a
    module or use torch's own."""
    fire("make_drop_clock", tmp_path)
    rep = replayed(tmp_path)
    d = rep["diverged"]
    assert (d["op"], d["why"], d["module"], d["source"]) == ("aten.rand", "generator", "1", line_of(
        "keep = (torch.rand(x.shape, generator=g) > self.p).to(x.dtype)")), d
    assert "torch.Generator the bundle does not hold" in rep["hint"] \
        and "use_deterministic_algorithms" not in rep["hint"], rep["hint"]


@pytest.mark.parametrize("make", ["make_drop_module", "make_drop_legacy", "make_drop_numpy_attr",
                                  "make_drop_random_attr"])
def test_generators_the_code_keeps_are_recorded_and_replayed(tmp_path, make):
    """The same dropout drawing from a NumPy ``Generator`` or legacy ``RandomState`` at module
    level beside the model's class, or from a NumPy or ``random.Random`` generator kept on
    the module: the recorder captures each as the step begins (drawing nothing: the run is
    the same with and without it), the replay sets it back before each re-run, so the
    recorded step (several steps in, the generator far from its seed) comes back: the
    division on its line, the recorded row, 0/0."""
    step = fire(make, tmp_path, features=8)
    (bundle,) = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert step > 0 and (rep["reproduced"], o["op"], o["module"], o["samples"], rep["cause"]) \
        == (True, "aten.div", "1", rep["event"]["samples"], "invalid"), (step, o, rep["problems"])
    assert o["source"] == line_of("return x * keep / keep.mean(1, keepdim=True)"), o


@pytest.mark.parametrize("make", ["make_drop_module", "make_drop_random_attr"])
def test_capturing_the_code_s_generators_draws_nothing(tmp_path, make):
    """Eight steps (before the first all-dropped row) with and without the recorder: the same
    losses, bit for bit, and the generators left where the run without it left them."""
    def run(record: bool):
        model = getattr(M, make)()
        M.MASKS.bit_generator.state = np.random.default_rng(0).bit_generator.state
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        rec = FlightRecorder(model, opt, loss_fn=torch.nn.MSELoss(), out_dir=tmp_path,
                             factory=f"nondeterministic_models:{make}") if record else None
        losses = []
        with rec if rec is not None else contextlib.nullcontext():
            for _ in range(8):
                x, y = 0.01 + torch.rand(8, 8, generator=g), torch.randn(8, 1, generator=g)
                out = model(x)
                loss = (rec.loss_fn if rec is not None else torch.nn.functional.mse_loss)(out, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
        return losses, (M.MASKS.random(), model[1].rng.random() if make.endswith("attr") else None)

    assert run(True) == run(False)


def test_a_temperature_annealed_in_a_global_names_the_division_and_its_two_values(tmp_path):
    """The softmax temperature halves at every forward, its count in a module-level dict: at
    step 127 the logits over 2^-128 overflow and the softmax makes NaN. Each re-run of the
    replay halves it again, so the two re-runs divide by two different numbers: the division
    is named on its line in the root, with the two temperatures (the second half the first),
    and the hint says to keep such state where the bundle holds it."""
    M.ANNEAL["calls"] = 0
    step = fire("make_annealed", tmp_path, features=6)
    assert step == 127  # (2^127 still fits float32; the logits times 2^128 do not)
    M.ANNEAL["calls"] = 0  # (as a fresh replay process imports it)
    rep = replayed(tmp_path)
    d = rep["diverged"]
    assert (d["op"], d["why"], d["module"], d["source"]) == (
        "aten.div", "arguments", "", line_of("w = torch.softmax(self.q(x) / t, 1)")), d
    ((first, second),) = d["arguments"]
    assert float(second) == float(first) / 2, d["arguments"]
    assert "module attribute or buffer" in rep["hint"], rep["hint"]


def test_the_same_schedule_kept_on_the_module_replays(tmp_path):
    """The fix the hint gives: the count as the module's attribute, which the bundle records
    and the replay puts back before each re-run: reproduced, the overflowing division named,
    nothing diverged."""
    step = fire("make_annealed_own", tmp_path, features=6)
    (bundle,) = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle)
    assert (step, rep["reproduced"], rep["diverged"]) == (127, True, None), rep["problems"]
    assert rep["origin"]["source"] == line_of("w = torch.softmax(self.q(x) / t, 1)"), \
        rep["origin"]


def test_a_custom_op_with_a_generator_of_its_own_is_named_as_the_nondeterministic_op(tmp_path):
    """Stochastic rounding as a ``torch.library.custom_op`` whose kernel draws from its own
    NumPy generator: a row rounded to all zeros is 0/0 under the per-row absmax. Its inputs are
    the same in both re-runs, its result is not: the custom op is named as the op that is not
    deterministic, with the fix (pass its randomness in), not torch's deterministic mode."""
    fire("make_rounded", tmp_path)
    rep = replayed(tmp_path)
    d = rep["diverged"]
    assert (d["op"], d["why"], d["module"], d["source"]) == (
        "nanreplay_tests.stochastic_round", "op", "", line_of("q = stochastic_round(self.inp(x))")
    ), d
    assert "a custom op" in rep["hint"] and "torch.Generator" in rep["hint"] \
        and "use_deterministic_algorithms" not in rep["hint"], rep["hint"]


def test_code_that_branches_on_a_global_names_the_ops_of_the_two_paths(tmp_path):
    """The activation alternates by a call count in a module-level dict: the run's first step
    took tanh, whose log of a negative value is NaN; one re-run takes tanh, the next sigmoid.
    The report says the re-runs took different paths, names the op the second ran where the
    first ran the other, on the branch's line."""
    M.ANNEAL["calls"] = 0
    assert fire("make_alternating", tmp_path) == 0
    M.ANNEAL["calls"] = 0
    rep = replayed(tmp_path)
    d = rep["diverged"]
    assert (d["why"], {d["op"], d["first_ran"]}, d["module"], d["source"]) == (
        "path", {"aten.tanh", "aten.sigmoid"}, "",
        line_of("h = torch.tanh(h) if ANNEAL[\"calls\"] % 2 else torch.sigmoid(h)")), d
    assert any(p.startswith("the two re-runs took different paths") for p in rep["problems"])


def test_sums_rounded_in_another_order_each_run_still_replay_the_event(tmp_path):
    """A two-layer graph network whose scatter-sum adds in a new order at each call (as CUDA's
    atomic adds do): two re-runs differ in the last bits of the first layer's sums, but not in
    where the NaN is. At step 2 node 5 has no incoming edge, 0/0 in the second layer's mean:
    the replay says the re-runs differ in rounding only, at the first layer's scatter-sum,
    and goes on: reproduced, the division on its line in conv2, node 5, invalid. (Before,
    "NOT reproduced", as every such model on a GPU was.)"""
    model = M.make_mean_aggregation()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=torch.nn.MSELoss(), out_dir=tmp_path,
                         factory="nondeterministic_models:make_mean_aggregation")
    isolated, n = 5, 12
    with pytest.raises(NonFiniteError) as info, rec:
        for step in range(4):
            dst = torch.randint(0, n, (96,), generator=g)
            if step == 2:
                dst[dst == isolated] = (isolated + 1) % n
            edges = torch.stack([torch.randint(0, n, (96,), generator=g), dst])
            x, y = torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)
            loss = rec.loss_fn(model(x, edges), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert info.value.event["step"] == 2
    (bundle,) = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle)
    o, d = rep["origin"], rep["diverged"]
    assert (rep["reproduced"], o["op"], o["module"], o["samples"], rep["cause"]) == (
        True, "aten.div", "conv2", [isolated], "invalid"), (o, rep["problems"])
    assert o["source"] == line_of("return torch.relu(m / deg)"), o
    assert (d["op"], d["why"], d["module"], d["source"]) == (
        "nanreplay_tests.scatter_sum_unordered", "op", "conv1",
        line_of("m = scatter_sum_unordered(self.msg(x)[src], dst, x.shape[0])")), d
    assert any(p.startswith("the two re-runs differ in rounding only") for p in rep["problems"])


def test_a_generator_on_a_submodule_of_the_loss_is_recorded_and_replayed(tmp_path):
    """A loss wrapping a target-noise module that draws from its own ``torch.Generator``
    (``loss.noise.gen``): the first step whose noise takes a target below -1 makes log1p NaN.
    The generator is captured with the loss's (named ``<loss>.noise.gen``) and set back, so
    the replay draws the same noise: reproduced, aten.log1p on its line, the rows the noise
    took below -1 (derived from the generator), invalid."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    crit = M.NoisyLogError()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    probe = torch.Generator().manual_seed(11)  # (the noise the loss will draw, step by step)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path)
    below: dict[int, list[int]] = {}
    with pytest.raises(NonFiniteError) as info, rec:
        for step in range(100):
            x, y = torch.randn(8, 3, generator=g), torch.rand(8, 1, generator=g)
            noisy = y + 0.5 * torch.randn(y.shape, generator=probe)
            below[step] = (noisy < -1).flatten().nonzero().flatten().tolist()
            loss = rec.loss_fn(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    bad = below[info.value.event["step"]]
    assert bad and not any(below[s] for s in range(info.value.event["step"])), below
    (bundle,) = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["op"], o["module"], o["samples"], rep["cause"]) == (
        True, "aten.log1p", "<loss>", bad, "invalid"), (o, rep["problems"])
    assert not any("could not be stored" in p for p in rep["problems"]), rep["problems"]

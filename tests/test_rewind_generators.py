"""A rewind window over steps that draw from generators the model or loss keeps (see
``own_generator_models``): each window step re-runs from its own recorded generator states,
bit for bit, through micro-batches that draw between them, with the what-ifs; a NumPy
generator of any bit generator comes back through the bundle's JSON; a bundle replayed with
a model whose generator is of another kind says so in one note."""

from __future__ import annotations

import own_generator_models as M
import pytest
import torch
from bundles import nanreplay_json

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def fire(make: str, tmp_path, accum: int = 1, loss=None, rewind: int = 3):
    """Adam, ``accum`` micro-batches a step, until the dropout keeps nothing of a row: the
    event's step and micro-batch, and the loss of every micro-batch of every step."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=loss or torch.nn.MSELoss(), out_dir=tmp_path,
                         factory=f"own_generator_models:{make}", rewind=rewind)
    losses: list[list[float]] = []
    with pytest.raises(NonFiniteError) as info, rec:
        for _ in range(200):
            opt.zero_grad()
            losses.append([])
            for _ in range(accum):
                x, y = 0.01 + torch.rand(8, 6, generator=g), torch.randn(8, 1, generator=g)
                loss_ = rec.loss_fn(model(x), y) / accum
                loss_.backward()
                losses[-1].append(loss_.item())
            opt.step()
    return info.value.event, losses


def test_a_window_of_accumulated_steps_drawing_from_a_loss_generator_reruns_as_recorded(tmp_path):
    """Masks from a Philox generator on the model, drawn again in each of two micro-batches,
    and target noise from a ``torch.Generator`` on the loss: the window's steps re-run with
    their recorded states, each step's loss the recorded one bit for bit, the event at its
    step, micro-batch and row; no note that the loss's generator was not stored (it is, with
    the RNG states); the what-ifs run from the window."""
    event, losses = fire("make_philox", tmp_path, accum=2, loss=M.NoisyTargets())
    (bundle,) = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle, "--try", "lr=0.1x", "--try", "clip=1.0")
    w, o = rep["window"], rep["origin"]
    assert (w["reproduced"], w["event_step"], w["first_non_finite"]["micro_batch"]) == (
        True, event["step"], event["micro_batch"]), w
    assert (o["op"], o["samples"], rep["cause"]) == ("aten.div", event["samples"], "invalid"), o
    for s in w["per_step"][:-1]:  # (a step's loss: the mean of its micro-batches' losses)
        assert s["loss"] == sum(losses[s["step"]]), (s, losses[s["step"]])
    assert not any("could not be stored" in p or "is not the run" in p
                   for p in rep["problems"]), rep["problems"]
    assert [t["try"] for t in rep["what_if"]] == ["lr=0.1x", "clip=1.0"], rep["what_if"]


@pytest.mark.parametrize("make", ["make_sfc64", "make_mt19937"])
def test_a_numpy_generator_of_any_bit_generator_comes_back_through_the_bundle(tmp_path, make):
    """The state the bundle's JSON holds for ``np.random.Generator(SFC64(3))`` or
    ``MT19937(3)`` sets a fresh one to draw what the run's drew at the event step; the
    replay reproduces the event in its row."""
    event, _ = fire(make, tmp_path)
    (bundle,) = tmp_path.glob("*.nan")
    meta, _ = read_bundle(bundle)
    state = meta["rng"]["generator_states"]["1.rng"]["numpy"]
    drop = getattr(M, make)()[1]
    fresh = drop.rng
    fresh.bit_generator.state = state
    assert state["bit_generator"] == type(fresh.bit_generator).__name__
    keep = fresh.random((8, 6)) > drop.p
    assert [i for i in range(8) if not keep[i].any()] == event["samples"], keep
    rep = nanreplay_json(bundle)
    assert (rep["reproduced"], rep["origin"]["samples"]) == (True, event["samples"]), rep


def test_a_generator_of_another_kind_in_the_rebuilt_model_is_one_note(tmp_path):
    """Recorded with a ``torch.Generator`` at ``1.rng``, replayed with a factory whose
    ``1.rng`` is a NumPy Philox generator: no traceback, the replay runs and one note names
    the generator and both kinds."""
    fire("make_torch", tmp_path)
    (bundle,) = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle, "--factory", "own_generator_models:make_philox", code=None)
    notes = [p for p in rep["problems"] if "1.rng (recorded torch.Generator, now NumPy Philox)"
             in p]
    assert len(notes) == 1, rep["problems"]


@pytest.mark.parametrize(("recorded", "rebuilt", "op", "why"), [
    ("make_philox", "make_torch", "aten.rand", "generator"),
    ("make_torch", "make_philox", "aten.lift_fresh", "outside")])
def test_re_runs_that_part_at_a_generator_of_another_kind_blame_the_generator(
        tmp_path, recorded, rebuilt, op, why):
    """Recorded with ``1.rng`` of one kind, replayed with a factory building the other: the
    generator keeps the factory's state and each re-run draws anew, so they part where the
    masks are drawn (``torch.rand(generator=...)`` or their ``torch.from_numpy``). The report
    says so: the draw is named (a ``torch.Generator``'s as ``generator``, not an ``op`` that
    is nondeterministic) and the hint names the generator, both kinds and the remedy, not
    torch's deterministic mode (before: "aten.rand is not deterministic on this device")."""
    fire(recorded, tmp_path, rewind=None)
    (bundle,) = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle, "--factory", f"own_generator_models:{rebuilt}", code=None)
    d, kinds = rep["diverged"], {"make_philox": "NumPy Philox", "make_torch": "torch.Generator"}
    assert (rep["cause"], d["op"], d["why"], d["module"]) == ("not_reproduced", op, why, "1"), d
    assert f"1.rng (recorded {kinds[recorded]}, now {kinds[rebuilt]}) could not be set back" \
        in rep["hint"] and "recorded kind" in rep["hint"], rep["hint"]
    assert "use_deterministic_algorithms" not in rep["hint"], rep["hint"]

"""A loss's own state the replay must begin each re-run from as the run did: a count the loss
creates at its first call (after the recorder attached), a count kept on the loss's or the
model's class (``type(self).calls += 1``), and a loss's count with gradient accumulation,
where the loss re-run alone for a micro-batch before the last begins from that micro-batch's
count, not the last one's (``outside_state_models``)."""

from __future__ import annotations

import outside_state_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from test_outside_state import batches, positive, train

from recorder import FlightRecorder, NonFiniteError
from replay import replay

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("outside_state_models.py", text)


@pytest.mark.parametrize("loss, divides", [
    (M.LazyRampLoss, "(lazy ramp)"), (M.LazyRampLossModule, "(lazy ramp, a module)"),
    (M.ClassRampLoss, "(class ramp)")])
def test_a_ramp_over_a_count_made_after_attach_replays(tmp_path, loss, divides):
    """The loss divides by ``1 - calls / 3`` over a count it creates at its first call (on
    itself, or on its class): 0 at the third call, the event's step 2. The recorder reads the
    count as each step begins once the loss has it, and the replay sets it where the code
    keeps it, so every re-run divides by 0 on the ramp's line in the loss."""
    M.ClassRampLoss.calls = 0
    event = train("make_linear", tmp_path, loss_fn=loss(), steps=4)
    assert (event["step"], event["phase"]) == (2, "loss"), event
    (bundle,) = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["module"], o["source"]) == (
        True, "invalid", "aten.div", "<loss>", line_of(divides)), rep
    assert rep.get("loss_updates") is None, rep["loss_updates"]


def test_a_count_made_after_attach_changes_nothing_the_recorder_sees(tmp_path):
    """The lazy ramp, its span past the run, with and without the recorder: the same losses,
    bit for bit, no event, and the loss's count the same."""
    runs = []
    for record in (False, True):
        loss = M.LazyRampLoss(span=9)
        runs.append((train("make_linear", tmp_path, loss_fn=loss, steps=5, record=record),
                     loss.calls))
    assert runs[0] == runs[1] and runs[0][1] == 5 and len(runs[0][0]) == 5, runs
    assert not list(tmp_path.glob("*.nan"))


def test_the_model_s_class_count_is_set_on_its_class(tmp_path):
    """A model counting its calls on its class divides by 0 at the fourth (step 3). The
    replay's note says the re-run uses the recorded count: it is set on the class, where
    ``type(self).calls`` reads it, so every re-run divides by 0 there; and when the replay
    ends the class holds the count training left again (one more than the event's step:
    the count the replay's factory built with)."""
    M.ClassCounted.calls = 0
    event = train("make_class_counted", tmp_path, steps=5)
    left = M.ClassCounted.calls  # (the replay's factory builds it with the count left)
    assert (event["step"], event["phase"]) == (3, "forward"), event
    (bundle,) = tmp_path.glob("*.nan")
    rep = replay(bundle, factory=M.make_class_counted)
    assert (rep["reproduced"], rep["origin"]["op"]) == (True, "aten.div"), rep
    assert f"<root>.calls = {event['step']} (the factory built {left})" in " ".join(
        rep["problems"]), rep["problems"]
    assert (M.ClassCounted.calls, left) == (left, event["step"] + 1), M.ClassCounted.calls


def test_an_accumulated_micro_batch_s_loss_begins_from_its_own_count(tmp_path):
    """Four micro-batches a step; the loss takes the log of its targets during a warm-up of
    two calls its submodule counts, then MSE. Rows of micro-batch 1 (the warm-up's last call)
    are planted below 0, NaN there; a row of micro-batch 3 too, finite under MSE. The loss
    re-run alone for micro-batch 1 begins from the count as that call began (not the last
    micro-batch's, past the warm-up): the log on its line, on the planted rows of micro-batch
    1, out of its domain."""
    warmup, k, planted = 2, 4, {1: [2, 5], 3: [1]}
    bad = warmup - 1  # (the last call inside the warm-up: the log's)
    model, loss_fn = M.make_linear(), M.WarmLogLoss(warmup)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=tmp_path,
                            factory="outside_state_models:make_linear") as rec:
            data = batches(2 * k)
            for _ in range(2):
                opt.zero_grad()
                for mb in range(k):
                    x, y = next(data)
                    (rec.loss_fn(model(x), positive(mb, y, planted)) / k).backward()
                opt.step()
    event = info.value.event
    assert (event["step"], event["phase"], event["micro_batch"]) == (0, "loss", bad), event
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["module"], o["micro_batch"],
            o["samples"], o["source"]) == (
        True, "invalid", "aten.log", "<loss>", bad, planted[bad],
        line_of("return ((out - torch.log(y)) ** 2).mean()")), rep

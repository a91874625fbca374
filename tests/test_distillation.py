"""Knowledge distillation loops as people write them (a frozen teacher beside or inside the
recorded student, Hinton's KL with a temperature, masked vocabularies), with a planted
numerical bug: the recorder fires at the planted step and ``nanreplay --json`` names the
module (teacher or student), op, samples and cause.
"""

from __future__ import annotations

import json

import distill_models as D
import pytest
import torch
from bundles import nanreplay_json

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def batch(step: int, n: int = 16):
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, 12, generator=g), torch.randint(0, 10, (n,), generator=g)


def test_a_teacher_under_inference_mode_in_the_forward_is_replayed(tmp_path):
    """The distiller runs its teacher under ``torch.inference_mode()`` inside its forward, and
    the teacher's checkpoint holds a NaN in ``fc2.weight`` (row 2). The replay crashed in its
    instrumented pass ('Inference tensors do not track version counter', from the memo of
    module outputs); it now names the teacher's weight, read by the teacher's fc2."""
    model = D.make_distiller()
    sd = model.teacher.state_dict()
    sd["fc2.weight"][2, 5] = float("nan")
    model.teacher.load_state_dict(sd)
    opt = torch.optim.SGD(model.student.parameters(), lr=0.05, momentum=0.9)
    crit = D.KD()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="distill_models:make_distiller"):
            for step in range(3):
                x, y = batch(step)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["params"]) == (0, "weights", ["teacher.fc2.weight"]), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["param"], rep["cause"]) == \
        ("weights", "teacher.fc2.weight", "weights"), json.dumps(rep, indent=1)
    assert (o["module"], o["op"]) == ("teacher.fc2", "aten.linear"), o


def test_a_teacher_loaded_from_a_corrupt_checkpoint_is_named_not_an_ema_update(tmp_path):
    """The teacher inside the distiller (run under ``torch.no_grad()``) was loaded from a
    checkpoint holding a NaN. The event is the teacher's weight at step 0, the first step the
    recorder saw; the hint blamed 'the loop's own update of them' and its momentum, which no
    loop of this run ever ran, and now says they came in so, from the checkpoint."""
    model = D.Distiller(inference=False)
    sd = model.teacher.state_dict()
    sd["fc1.weight"][7] = float("nan")
    model.teacher.load_state_dict(sd)
    opt = torch.optim.SGD(model.student.parameters(), lr=0.05)
    crit = D.KD()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="distill_models:make_distiller"):
            for step in range(3):
                x, y = batch(step)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["param"], o["module"], rep["cause"]) == \
        ("weights", "teacher.fc1.weight", "teacher.fc1", "weights"), json.dumps(rep, indent=1)
    assert "first step the recorder saw" in rep["hint"] and "checkpoint" in rep["hint"], rep
    assert "momentum" not in rep["hint"], rep["hint"]


def test_a_masked_vocabulary_in_the_kl_names_the_mul_and_the_mask(tmp_path):
    """From step 2 the loss masks the classes past 7 to -inf in both the student's and the
    teacher's logits (a vocabulary that shrank). F.kl_div computes target * log_prob: the
    teacher's probability 0 times the student's log-probability -inf, 0 * -inf, NaN. The chain
    went on to the cross entropy's nll_loss, run after the NaN was made (its +inf, for labels
    on masked classes, is not where the NaN came from), and the hint said to find the op that
    made the first infinity, which is the mask on purpose; the chain now ends at the mul and
    the hint says to leave the masked entries out of the product or mask with a finite
    number."""
    student, teacher = D.make_student(), D.make_teacher().eval().requires_grad_(False)
    opt = torch.optim.Adam(student.parameters(), lr=1e-3)
    crit = D.MaskedKD()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(student, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="distill_models:make_student"):
            for step in range(4):
                x, y = batch(step)
                crit.allowed = 7 if step >= 2 else None
                with torch.no_grad():
                    t = teacher(x)
                loss = crit(student(x), t, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (2, "loss"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["made"], rep["cause"]) == \
        ("loss", "<loss>", "aten.mul", "nan", "invalid"), json.dumps(rep, indent=1)
    assert [c["op"] for c in o["chain"]] == ["aten.masked_fill", "aten.mul"], o["chain"]
    assert "0 * inf" in rep["hint"] and "masked entries out of the product" in rep["hint"], rep


def test_mutual_learning_s_other_optimizer_is_named_for_the_weights_it_wrote(tmp_path):
    """Deep mutual learning with one optimizer per network; the recorder is given the first,
    which steps first, as the guide asks. At step 4 the second one's learning rate is NaN
    (a schedule's 0/0), so the second network's weights are NaN when step 5 begins. The hint
    said 'no recorded update wrote them: find what writes weights outside optimizer.step()
    (checkpoint loading, in-place edits)'; it now says they train, the recorded optimizer does
    not hold them, and another optimizer's step() (or the loop's update) wrote them."""
    model = D.make_pair()
    opt1 = torch.optim.SGD(model.net1.parameters(), lr=0.1)
    opt2 = torch.optim.SGD(model.net2.parameters(), lr=0.1)
    crit = D.MutualKL()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt1, loss_fn=crit, out_dir=tmp_path,
                            factory="distill_models:make_pair"):
            for step in range(8):
                x, y = batch(step)
                if step == 4:
                    opt2.param_groups[0]["lr"] = float("nan")
                loss = crit(model(x), y)
                opt1.zero_grad()
                opt2.zero_grad()
                loss.backward()
                opt1.step()
                opt2.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["params"][0]) == (5, "weights", "net2.0.weight"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["param"], o["module"], rep["cause"]) == \
        ("weights", "net2.0.weight", "net2.0", "weights"), json.dumps(rep, indent=1)
    assert "another optimizer's step()" in rep["hint"] and "learning rate" in rep["hint"], rep


def test_a_kl_over_logits_the_model_masked_under_allow_inf_names_the_mask(tmp_path):
    """Both models mask the dead classes to -inf in their forward, which the recorder is told
    to allow (``allow_inf=[""]``: the root output may hold them). The KL's target 0 times the
    student's log-probability -inf is NaN at step 0. The hint said 'an infinity met another
    in arithmetic: find the op that made the first infinity (the chain)', with no chain to
    read; it now says the infinity was put in on purpose and to leave the masked entries out
    of the product."""
    model = D.make_masked_distiller()
    opt = torch.optim.Adam(model.student.parameters(), lr=1e-3)
    crit = D.KD(temperature=2.0, alpha=1.0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path, allow_inf=[""],
                            factory="distill_models:make_masked_distiller"):
            for step in range(3):
                x, y = batch(step)
                opt.zero_grad()
                crit(model(x), y.clamp(max=6)).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (0, "loss"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], rep["cause"]) == \
        ("loss", "<loss>", "aten.mul", "invalid"), json.dumps(rep, indent=1)
    assert "on purpose" in rep["hint"] and "masked entries out of the product" in rep["hint"], \
        rep["hint"]


def test_a_peer_network_s_output_with_its_graph_is_a_loss_input_not_the_loss(tmp_path):
    """Deep mutual learning with two separate networks, the recorder on the first. The peer's
    output reaches the loss with its autograd graph (the loss detaches it inside). At step 4
    the peer's optimizer gets a NaN learning rate, so from step 5 its output is NaN. The
    recorder took every loss argument with a graph for the model's output or a value made
    from it, and called the event 'loss' ('the loss is non-finite while the model output is
    finite'), which the replay could not place (no op made the NaN; cause 'check the loss
    inputs'). A graph that reaches neither the model's output nor its parameters is another
    network's: the event is that loss argument, and the hint names the network behind it."""
    net1, net2 = D.make_student(), D.make_teacher()
    opt1 = torch.optim.SGD(net1.parameters(), lr=0.1)
    opt2 = torch.optim.SGD(net2.parameters(), lr=0.1)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(net1, opt1, loss_fn=D.peer_kl, out_dir=tmp_path,
                            factory="distill_models:make_student") as rec:
            for step in range(8):
                x, y = batch(step)
                if step == 4:
                    opt2.param_groups[0]["lr"] = float("nan")
                a, b = net1(x), net2(x)
                loss = rec.loss_fn(a, b, y) + D.peer_kl(b, a, y)
                opt1.zero_grad()
                opt2.zero_grad()
                loss.backward()
                opt1.step()
                opt2.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["tensor"]) == (5, "input", "loss_args[1]"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["tensor"], rep["cause"]) == ("input", "loss_args[1]", "input"), \
        json.dumps(rep, indent=1)
    assert "teacher's" in rep["hint"] and "weights of the network" in rep["hint"], rep["hint"]


def test_a_loss_argument_made_from_the_model_output_stays_the_loss_s(tmp_path):
    """The other side of the rule above: a loss argument computed from the model's output
    outside the loss (log-probabilities, with a temperature of 0 at step 2) is no data; the
    event stays 'loss', not 'input'."""
    model = D.make_student()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = torch.nn.NLLLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="distill_models:make_student"):
            for step in range(4):
                x, y = batch(step)
                temperature = 0.0 if step == 2 else 2.0
                logp = torch.log_softmax(model(x) / temperature, -1)
                opt.zero_grad()
                crit(logp, y).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (2, "loss"), ev

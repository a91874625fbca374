"""End to end: federated learning and weight merging simulated in one process, as the
simulation repos write them (``federated_models``): one model and one optimizer reused for
every client in turn, the round's global weights loaded into it before each client's local
steps (FedLab's serial trainer), FedAvg / FedNova over the clients' state_dicts, FedProx's
proximal term in a loss given the model, TIES-merging of fine-tuned copies. The recorder is
attached to the model the clients train; the weights the server's averaging writes into it
between steps are not the optimizer's."""

from __future__ import annotations

import copy
import json
import math

import federated_models as FM
import pytest
import torch
from bundles import nanreplay_json

from recorder import FlightRecorder, NonFiniteError

SIZES = [40, 24, 16, 32]  # the clients' samples
STEPS = [math.ceil(n / FM.BATCH) for n in SIZES]  # their local steps a round


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def serial_rounds(model, opt, loss_fn, out_dir, rounds, data, aggregate, *, given_model=None,
                  in_loop=False, **rec_kwargs) -> NonFiniteError:
    """Each round, each sampled client in turn: the global weights loaded into the recorded
    model, its local epoch, its state_dict kept; then the server's ``aggregate``.
    ``given_model(r)``: whether round ``r``'s loss is given the model (FedProx); with
    ``in_loop`` the loop adds the proximal term to the loss instead."""
    glob = FM.snapshot(model)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir,
                            factory=f"federated_models:{rec_kwargs.pop('factory')}",
                            **rec_kwargs) as rec:
            for r, clients in enumerate(rounds):
                states, counts, taus = [], [], []
                for k in clients:
                    model.load_state_dict(glob)
                    if isinstance(loss_fn, FM.FedProxLoss):
                        loss_fn.global_model.load_state_dict(glob)
                    prox = bool(given_model and given_model(r))
                    more = (model,) if prox and not in_loop else ()
                    tau = 0
                    for x, y in FM.batches(data[k]):
                        loss = rec.loss_fn(model(x), y, *more)
                        if prox and in_loop:
                            loss = loss + loss_fn.mu / 2 * FM.prox_distance(
                                model, loss_fn.global_model) ** 2
                        opt.zero_grad()
                        loss.backward()
                        opt.step()
                        tau += 1
                    states.append(FM.snapshot(model))
                    counts.append(len(data[k][0]))
                    taus.append(tau)
                glob = aggregate(glob, states, counts, taus)
    return info.value


def fedavg(glob, states, counts, taus):
    return FM.fedavg(states, counts)


def test_a_window_through_a_clients_load_of_the_global_weights_is_not_the_run(tmp_path):
    """Client 2 (sampled in round 1 only) holds a record whose features are all equal: the
    on-device standardisation divides 0 by 0. Recorded with rewind: the window re-runs its
    steps with the optimizer alone, so where the loop loaded the global weights for client 2
    it went on from client 0's. Training's loss and gradient norm there were within 10% of
    the re-run's, and the report said the window re-ran the steps of the run, with
    ``--try lr=0.1x`` as evidence; the weights each update left (the recorder's norms right
    after it) say where the re-run left the run."""
    data = FM.client_data(SIZES)
    bad = 13
    data[2][0][bad] = 0.5
    rounds = [[0, 1, 3], [3, 0, 2]]
    model = FM.make_std_net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    err = serial_rounds(model, opt, torch.nn.CrossEntropyLoss(), tmp_path, rounds, data, fedavg,
                        factory="make_std_net", rewind=4)
    loaded = sum(STEPS[k] for k in rounds[0]) + STEPS[3] + STEPS[0]  # client 2's first step
    at = loaded + bad // FM.BATCH
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"]) == (at, "forward", "0"), ev
    rep = nanreplay_json(err.bundle_path, "--try", "lr=0.1x")
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["samples"]) == (
        True, "invalid", "0", "aten.div", [bad % FM.BATCH]), json.dumps(rep, indent=1)
    w = rep["window"]
    assert w["departed"] == loaded, w  # (was: no departure)
    (note,) = [p for p in rep["problems"] if "is not the run" in p]
    assert f"its update of step {loaded} left" in note and "load_state_dict" in note, note
    (tried,) = rep["what_if"]
    assert "no evidence of a fix" in tried["note"], tried


def test_fedprox_term_in_a_loss_given_the_model_names_its_sqrt_backward(tmp_path):
    """FedProx from round 1 on, in a loss given the model: ``sqrt(sum((w - w_g) ** 2))`` at
    ``w == w_g`` on the round's first local step, whose backward is 0/0 in every parameter's
    gradient. The re-run backpropagated the recorded output gradient alone, which leaves out
    the loss's direct path into the weights: 'NOT reproduced, the loop's own code wrote
    them', although the term is the recorded loss's."""
    data = FM.client_data(SIZES[:2])
    model = FM.make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    err = serial_rounds(model, opt, FM.FedProxLoss(), tmp_path, [[0, 1], [0, 1]], data,
                        fedavg, given_model=lambda r: r > 0, factory="make_net")
    names = [n for n, _ in model.named_parameters()]
    ev = err.event
    assert (ev["step"], ev["phase"], ev["params"]) == (STEPS[0] + STEPS[1], "backward", names)
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["samples"]) == (
        True, "invalid", "<loss>", "SqrtBackward0", []), json.dumps(rep, indent=1)
    assert "torch.sqrt(" in rep["source_lines"][o["source"]], rep["source_lines"]
    assert "vector_norm" in rep["hint"], rep["hint"]


def test_fedprox_term_the_loop_adds_says_to_give_the_loss_the_model(tmp_path):
    """The same term added to the loss in the loop: the bundle cannot re-run it, and the hint
    now says how to have it re-run (the loss given the model, as above)."""
    data = FM.client_data(SIZES[:2])
    model = FM.make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    err = serial_rounds(model, opt, FM.FedProxLoss(), tmp_path, [[0, 1], [0, 1]], data,
                        fedavg, given_model=lambda r: r > 0, in_loop=True, factory="make_net")
    assert (err.event["step"], err.event["phase"]) == (STEPS[0] + STEPS[1], "backward")
    rep = nanreplay_json(err.bundle_path, code=1)
    assert (rep["reproduced"], rep["cause"]) == (False, "not_reproduced"), rep
    assert "a FedProx or EWC penalty" in rep["hint"] and "loss_fn(out, y, model)" in rep["hint"]


def test_fednova_client_without_samples_says_the_loop_wrote_every_element(tmp_path):
    """Client 2 holds no sample: no local step, and FedNova's (w - w_k) / 0 is 0/0 in every
    entry of every weight, loaded into the model for round 1. The hint said 'find what writes
    weights outside optimizer.step() (checkpoint loading, in-place edits)'; it now says the
    optimizer holds them, the loop wrote them between the last update and this step, and that
    every element is non-finite, as a bad coefficient or divisor makes."""
    sizes = [40, 24, 0, 32]
    model = FM.make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    err = serial_rounds(model, opt, torch.nn.CrossEntropyLoss(), tmp_path, [[0, 1, 2, 3]] * 2,
                        FM.client_data(sizes), FM.fednova, factory="make_net")
    at = sum(math.ceil(n / FM.BATCH) for n in sizes)
    ev = err.event
    assert (ev["step"], ev["phase"], ev["first_seen_step"], ev["last_update_step"]) == (
        at, "weights", at, at - 1), ev
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["param"], o["params"], o["module"], o["op"]) == (
        "weights", "0.weight", [n for n, _ in model.named_parameters()], "0", "aten.addmm"), rep
    assert o["source"] is None, o  # (was torch's own linear.py, its forward's def line)
    hint = rep["hint"]
    assert f"its update of step {at - 1} left them finite: the loop wrote them between that " \
        f"update and step {at}" in hint, hint
    assert "every element of them is non-finite" in hint, hint


def test_a_ties_merge_with_no_agreeing_task_names_the_elements_it_made_nan(tmp_path):
    """Three fine-tuned copies merged with TIES whose disjoint mean divides by the number of
    agreeing tasks, 0 where none survived the trim: NaN in some entries of every weight. The
    merged model is fine-tuned under the recorder: a weights event at its first step, whose
    hint said to resume from an earlier checkpoint; it now says they came in so, with the
    state_dict loaded before, and how many elements are NaN, as an element-wise 0/0 makes."""
    data = FM.client_data([32, 32, 32])
    base = FM.make_net()
    crit = torch.nn.CrossEntropyLoss()
    tuned = []
    for d in data:
        m = copy.deepcopy(base)
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        for x, y in FM.batches(d):
            o.zero_grad()
            crit(m(x), y).backward()
            o.step()
        tuned.append(FM.snapshot(m))
    merged = FM.ties_merge(FM.snapshot(base), tuned)
    n_bad = int(merged["0.weight"].isnan().sum())
    assert 0 < n_bad < merged["0.weight"].numel()
    model = FM.make_net()
    model.load_state_dict(merged)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="federated_models:make_net"):
            for x, y in FM.batches(data[0]):
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["first_seen_step"]) == (0, "weights", 0), ev
    rep = nanreplay_json(info.value.bundle_path)
    assert (rep["cause"], rep["origin"]["param"]) == ("weights", "0.weight"), rep
    hint = rep["hint"]
    assert "non-finite at the first step the recorder saw" in hint and "TIES" in hint, hint
    assert f"only some elements are non-finite ({n_bad} of 512 in 0.weight)" in hint, hint
    assert "resume from" not in hint, hint


def test_a_fedavg_server_recorded_without_an_optimizer_names_the_weights_the_step_ran_on(
        tmp_path):
    """The recorder on the server's global model, given no optimizer: each round the clients
    train deep copies, the server loads their average and evaluates it under no_grad. A
    diverged client's +inf in one entry of 2.weight reaches the average at round 1; with no
    optimizer the step stays open until round 2's evaluation, after round 2 loaded weights
    made of NaN clients. The recorder named 2.weight and 2.bias and the replay blamed 0.weight
    (+5 more), read by module 0, which had returned finite values: the bundle holds the
    weights as round 2 wrote them. The weights event now lists those its forward read finite
    as written after it, the origin is of the others, and the hint says to end the step."""
    data = FM.client_data(SIZES)
    xt, yt = FM.client_data([64], seed=1)[0]
    glob = FM.make_net()
    crit = torch.nn.CrossEntropyLoss()
    rounds, diverged = [[0, 1], [2, 3], [1, 3]], (1, 3)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(glob, None, loss_fn=crit, out_dir=tmp_path,
                            factory="federated_models:make_net") as rec:
            for r, clients in enumerate(rounds):
                states = []
                for k in clients:
                    local = copy.deepcopy(glob)
                    o = torch.optim.SGD(local.parameters(), lr=0.05)
                    for x, y in FM.batches(data[k]):
                        o.zero_grad()
                        crit(local(x), y).backward()
                        o.step()
                    if (r, k) == diverged:
                        with torch.no_grad():
                            local[2].weight[3, 4] = float("inf")
                    states.append(FM.snapshot(local))
                glob.load_state_dict(FM.fedavg(states, [SIZES[k] for k in clients]))
                with torch.no_grad():
                    rec.loss_fn(glob(xt), yt)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["params"][:2]) == (1, "weights",
                                                            ["2.weight", "2.bias"]), ev
    assert ev["written_after_forward"] == ["0.weight", "0.bias"], ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["param"], o["module"]) == ("weights", "2.weight", None), rep
    assert "call rec.end_step() right after each step's forward and loss" in rep["hint"], \
        rep["hint"]
    assert "load_state_dict of a federated average" in rep["hint"], rep["hint"]


def test_an_ema_teacher_recorded_alone_is_said_to_be_written_by_its_update(tmp_path):
    """Mean teacher: the recorder on the teacher (a deep copy the loop froze, given no
    optimizer), run under no_grad for the targets; ``torch._foreach_lerp_`` moves it toward
    the student with 1 - decay, NaN at step 3 from the decay's schedule. The hint said the
    loop's own update ``p -= lr * p.grad`` wrote them, of parameters that take no gradient:
    the factory builds them trainable, and the bundle did not say the loop froze them. The
    event listed 0.weight and 0.bias only: the later layers' calls took NaN from upstream and
    were read as written after the forward, which their weights, NaN since step 3, were not."""
    x, y = FM.client_data([96])[0]
    student = FM.make_net()
    teacher = copy.deepcopy(student).requires_grad_(False)
    opt = torch.optim.SGD(student.parameters(), lr=0.05)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(teacher, None, out_dir=tmp_path,
                            factory="federated_models:make_net"):
            for step, (xb, yb) in enumerate(FM.batches((x, y), 16)):
                with torch.no_grad():
                    target = teacher(xb).softmax(-1)
                out = student(xb)
                loss = torch.nn.functional.cross_entropy(out, yb) \
                    + torch.nn.functional.mse_loss(out.softmax(-1), target)
                opt.zero_grad()
                loss.backward()
                opt.step()
                decay = float("nan") if step == 3 else 0.99
                with torch.no_grad():
                    torch._foreach_lerp_(list(teacher.parameters()),
                                         list(student.parameters()), 1 - decay)
    names = [n for n, _ in teacher.named_parameters()]
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["params"]) == (4, "weights", names), ev
    rep = nanreplay_json(info.value.bundle_path)
    assert (rep["cause"], rep["origin"]["param"]) == ("weights", "0.weight"), rep
    hint = rep["hint"]
    assert "require no gradient and the recorder was given no optimizer" in hint, hint
    assert "torch._foreach_lerp_" in hint and "every element of them is non-finite" in hint
    assert "p -= lr * p.grad" not in hint, hint


def test_a_new_optimizer_per_client_is_said_at_the_loops_last_step_too(tmp_path):
    """The serial trainer builds a new Adam for each client (its state reset, as many
    simulations do), the recorder given the first. Client 2's constant record makes NaN at
    the loop's last step, whose update by the client's own optimizer writes NaN weights
    before the ``with`` block closes the step. A forward closing a step notices the other
    optimizer's update; the exit did not, and the replay called the NaN weights 'made
    non-finite during it by the model's own code (a data-dependent initialisation)'."""
    data = FM.client_data(SIZES)
    bad = 13
    data[2][0][bad] = 0.5
    model = FM.make_std_net()
    crit = torch.nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    glob = FM.snapshot(model)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="federated_models:make_std_net") as rec:
            for k in (0, 2):
                model.load_state_dict(glob)
                opt = torch.optim.Adam(model.parameters(), lr=1e-2)
                for x, y in FM.batches(data[k]):
                    loss = rec.loss_fn(model(x), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
    ev = info.value.event
    # (another optimizer's update moves the weights: each forward closes the step before it)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        STEPS[0] + STEPS[2] - 1, "forward", "0", [bad % FM.BATCH]), ev
    rep = nanreplay_json(info.value.bundle_path, code=1)
    o = rep["origin"]
    assert (rep["cause"], o["module"], o["samples"], rep["not_rerun"]) == (
        None, "0", [bad % FM.BATCH], "weights written after its forward"), rep
    assert any("never stepped: the loop steps another one" in p for p in rep["problems"])
    assert not any("data-dependent" in p for p in rep["problems"]), rep["problems"]

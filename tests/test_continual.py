"""End to end: continual and federated learning as their well-known repositories write it
(``continual_models``): EWC's Fisher normalised by its max, Synaptic Intelligence, LwF's
distillation, class-incremental cross-entropy over the classes seen so far with a replay
buffer, FedAvg on one process with a client holding no sample. Each trains until the
recorder raises, then ``nanreplay`` names the module, op, step, cause and samples."""

from __future__ import annotations

import copy

import continual_models as C
import pytest
import torch
from bundles import invoke_cli, nanreplay_json
from torch import nn

from recorder import FlightRecorder, NonFiniteError

FACTORY = "continual_models:make_tasknet"


pytestmark = pytest.mark.usefixtures("in_tests_dir")


@pytest.mark.parametrize("with_loss_fn", [True, False], ids=["loss_fn", "record_loss-only"])
def test_ewc_penalty_given_to_record_loss_is_said_to_be_the_loops_term(tmp_path, with_loss_fn):
    """EWC over a frozen pretrained stem: its Fisher is 0 everywhere (no gradient), and
    ``F / F.max()`` is 0/0, so the penalty is NaN from task 2's first step (the frozen weights'
    gradients are never taken: every gradient stays finite). The loop adds the penalty to
    ``loss_fn``'s cross-entropy and hands the sum to ``rec.record_loss``. The report was
    'not_reproduced — ... state outside the model ... or it was transient', as if the step
    were nondeterministic, though ``loss_fn``'s own loss had been finite in the run. Without
    ``loss_fn`` (a Lightning ``training_step`` adding the penalty, whose loss the callback
    gives to ``record_loss``) the hint named the loss's inputs only."""
    model = C.make_tasknet()
    model.body[0].requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    crit = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    ewc = None
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit if with_loss_fn else None,
                            out_dir=tmp_path, factory=FACTORY) as rec:
            for task in range(2):
                for _ in range(4):
                    x, y = C.task_batch(g, task)
                    opt.zero_grad()
                    loss = crit(model(x, task), y)
                    if ewc is not None:
                        loss = loss + ewc.penalty(model, 100.0)
                    rec.record_loss(loss)
                    loss.backward()
                    opt.step()
                # the Fisher's two forwards are the next step's first micro-batches
                ewc = C.EWC(model, [C.task_batch(g, task) for _ in range(2)], task)
    assert torch.isnan(ewc.fisher["body.0.weight"]).all()  # the frozen stem's 0/0
    assert all(torch.isfinite(f).all() for n, f in ewc.fisher.items() if n.startswith("body.2"))
    err = info.value
    ev = err.event
    assert (ev["step"], ev["phase"], ev["micro_batch"], ev["kind"], ev.get("loss_given")) == (
        4, "loss", 2, "nan", True if with_loss_fn else None), ev
    rep = nanreplay_json(err.bundle_path, code=1)
    if not with_loss_fn:
        assert (rep["reproduced"], rep["cause"], rep["origin"]["micro_batch"]) == (
            False, None, 2), rep
        assert "a penalty on the weights: EWC's Fisher" in rep["hint"], rep["hint"]
        return
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["phase"], o["op"], o["micro_batch"]) == (
        False, None, "loss", None, 2), rep
    assert "record_loss" in rep["not_rerun"], rep["not_rerun"]
    assert "added to loss_fn's loss" in rep["hint"] and "EWC" in rep["hint"], rep["hint"]
    text = invoke_cli(err.bundle_path).stdout
    assert "origin     loss: nan in the loss given to rec.record_loss, while loss_fn's loss " \
        "was finite" in text, text


def _class_incremental(out_dir):
    """Two tasks of three classes each in one growing head; task 2's batches mix in rows
    replayed from task 1's buffer, while the cross-entropy masks the logits to the current
    task's classes (ER-ACE's asymmetric mask, applied to the replayed rows too)."""
    model = C.make_classinc()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    buf_x, buf_y, last = [], [], None
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=C.masked_ce, out_dir=out_dir,
                            factory="continual_models:make_classinc") as rec:
            for task in range(2):
                active = torch.zeros(2 * C.CLASSES, dtype=torch.bool)
                active[task * C.CLASSES:(task + 1) * C.CLASSES] = True
                for _ in range(4):
                    x, y = C.task_batch(g, task, 8)
                    y = y + task * C.CLASSES
                    if buf_x:
                        i = torch.randint(0, len(buf_x), (4,), generator=g)
                        x = torch.cat([x, torch.stack(buf_x)[i]])
                        y = torch.cat([y, torch.stack(buf_y)[i]])
                    last = (y, active)
                    loss = rec.loss_fn(model(x), y, active)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    if task == 0:
                        buf_x += list(x[:2])
                        buf_y += list(y[:2])
    return info.value, last


def test_replayed_rows_whose_class_is_masked_are_the_samples(tmp_path):
    """The logits masked to -inf hold a -inf in every row, and nll_loss's mean is a 0-d value:
    the samples were 'all 12 rows' (each row's non-finite entries), where only the replayed
    rows whose label sits on a masked class have an infinite loss."""
    err, (y, active) = _class_incremental(tmp_path)
    expected = (~active[y]).nonzero().flatten().tolist()
    assert expected and len(expected) < len(y)
    assert (err.event["step"], err.event["phase"]) == (4, "loss")
    rep = nanreplay_json(err.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "invalid", "<loss>", "aten.nll_loss_forward", "+inf", expected), rep
    assert o["source"].startswith("continual_models.py:") and "masked_fill" in \
        rep["source_lines"][o["source"]]
    assert "a target on a masked class" in rep["hint"], rep["hint"]
    (tried,) = rep["what_if"]
    assert (tried["try"], tried["finite"]) == ("drop=" + ",".join(map(str, expected)), True)


@pytest.mark.parametrize("rewind", [None, 2])
def test_ewc_loss_given_the_model_names_the_nan_fisher_buffer(tmp_path, rewind):
    """EWC as a loss module called ``crit(out, y, model)``: its Fisher buffers for the heads
    task 1 never used are 0/0. The model as a loss argument made the bundle unreplayable
    (exit 2, 'UnrebuildableLeaf: TaskNet TaskNet(...)'), with ``rewind`` too (the window's
    steps); replayed, the loss had no op (every op took a NaN it was given) and the cause was
    'invalid ... check the loss inputs'. The window, re-run from a copy taken before the
    consolidation, runs the event's NaN Fisher from its first step: a NaN where training's
    loss was finite, which the report said only as 'first non-finite at step 2'."""
    model = C.make_tasknet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = C.EWCLoss()
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path, factory=FACTORY,
                            rewind=rewind):
            for task in range(2):
                for _ in range(4):
                    x, y = C.task_batch(g, task)
                    opt.zero_grad()
                    crit(model(x, task), y, model).backward()
                    opt.step()
                crit.consolidate(model, [C.task_batch(g, task) for _ in range(2)], task)
    # heads.1 is the first parameter the loss meets whose Fisher is 0/0
    bad = [n for n in crit.names if not torch.isfinite(getattr(crit, f"fisher_{n}")).all()]
    assert bad[0] == "heads_1_weight" and all(n.startswith("heads_") for n in bad), bad
    err = info.value
    assert (err.event["step"], err.event["phase"], err.event["micro_batch"]) == (4, "loss", 2)
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "weights", "<loss>", "aten.mul", "nan", []), rep
    assert "f * (p - star)" in rep["source_lines"][o["source"]]
    assert "the loss's 'fisher_heads_1_weight' holding nan" in rep["hint"], rep["hint"]
    assert "f / f.max() only where f.max() > 0" in rep["hint"], rep["hint"]
    if rewind is None:
        return
    w = rep["window"]
    assert (w["copy_step"], w["reproduced"], w["event_step"]) == (2, False, 2), w
    assert any(p.startswith("training ran step 2 with a finite loss") and "EWC" in p
               for p in rep["problems"]), rep["problems"]


def test_fednova_client_without_samples_is_a_weights_event_with_the_model_in_the_loss(tmp_path):
    """FedNova on one process: each client loads the round's global weights into the recorded
    model and trains it with FedProx's proximal term (the loss given the model); the server
    normalises each client's update by its local steps, 0 for the client holding no sample:
    0/0 in every weight, loaded into the model for the next round. The bundle could not be
    replayed (the model as a loss argument)."""
    model = C.make_tasknet(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = C.FedProxLoss()
    g = torch.Generator().manual_seed(0)
    n_samples = [32, 16, 0]
    steps_per_round = sum(n // 8 for n in n_samples)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path, factory=FACTORY,
                            factory_kwargs={"tasks": 1}):
            for _ in range(2):
                global_sd = copy.deepcopy(model.state_dict())
                crit.set_global(model)
                client_sds, local_steps = [], []
                for n in n_samples:
                    model.load_state_dict(global_sd)
                    data = [C.task_batch(g, 0, 8) for _ in range(n // 8)]
                    for x, y in data:
                        opt.zero_grad()
                        crit(model(x, 0), y, model).backward()
                        opt.step()
                    client_sds.append(copy.deepcopy(model.state_dict()))
                    local_steps.append(len(data))
                model.load_state_dict(
                    C.fednova_aggregate(global_sd, client_sds, n_samples, local_steps))
    names = [n for n, _ in model.named_parameters()]
    err = info.value
    assert (err.event["step"], err.event["phase"], err.event["params"]) == (
        steps_per_round, "weights", names), err.event
    assert err.event["last_update_step"] == steps_per_round - 1
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["param"], o["module"], o["op"]) == (
        True, "weights", "body.0.weight", "body.0", "aten.addmm"), rep
    assert any("state_dict load" in p for p in rep["problems"]), rep["problems"]


def test_numpy_task_ids_and_a_half_precision_replay_buffer(tmp_path):
    """Experience replay over tasks in a NumPy-drawn order (``rng.permutation``: each task id
    an ``np.int64``, passed to ``forward``), the buffer kept in float16 to save memory: a raw
    reading of 1e5, finite in float32, is +inf once stored. The replayed rows go through a
    second forward with one task id per row. Every bundle stopped with exit 2: 'micro-batch 0
    holds an input that cannot be rebuilt (int64 np.int64(1))'."""
    np = pytest.importorskip("numpy")
    model = C.make_tasknet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    order = np.random.default_rng(0).permutation(C.TASKS)
    buf_x, buf_y, buf_t, taken = [], [], [], None
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path, factory=FACTORY):
            for k, task in enumerate(order):
                for it in range(4):
                    x, y = C.task_batch(g, int(task), 8)
                    if k == 1 and it == 1:
                        x[1, 0] = 1e5  # a raw sensor reading
                    opt.zero_grad()
                    loss = crit(model(x, task), y)
                    if buf_x:
                        i = torch.randint(0, len(buf_x), (4,), generator=g)
                        bx = torch.stack(buf_x)[i].float()
                        taken = bx
                        loss = loss + crit(model(bx, torch.stack(buf_t)[i]), torch.stack(buf_y)[i])
                    loss.backward()
                    opt.step()
                    buf_x += list(x[:2].half())  # (two rows a batch kept)
                    buf_y += list(y[:2])
                    buf_t += [torch.tensor(int(task))] * 2
    assert isinstance(order[0], np.int64)
    expected = torch.isinf(taken).any(1).nonzero().flatten().tolist()
    assert expected
    err = info.value
    ev = err.event
    assert (ev["step"], ev["phase"], ev["micro_batch"], ev["tensor"], ev["samples"]) == (
        10, "input", 1, "args[0]", expected), ev
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["tensor"], o["samples"], o["micro_batch"]) == (
        True, "input", "args[0]", expected, 1), rep


def test_fedavg_window_across_the_rounds_load_state_dict_is_said_not_to_be_the_run(tmp_path):
    """FedAvg on one process, recorded with ``rewind``: each client loads the round's global
    weights into the model, then trains; one client's features come in raw units (100x), and
    the run diverges until a layer overflows. The window re-runs its steps from its copy with
    the optimizer alone, so at the next client it goes on from the previous client's weights
    instead of the global ones the loop loaded: its steps are another run's. The report said
    only 'every value finite: the event does NOT come back', as if the event were not
    reproducible from the steps before it, and ``--try auto``'s tries, re-run on that window,
    were offered as evidence of a fix ('lr=0.1x finite through step 12')."""
    model = C.make_tasknet(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    crit = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    n_samples = [24, 24]
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path, factory=FACTORY,
                            factory_kwargs={"tasks": 1}, rewind=4):
            for _ in range(20):
                global_sd = copy.deepcopy(model.state_dict())
                client_sds = []
                for k, n in enumerate(n_samples):
                    model.load_state_dict(global_sd)
                    for _ in range(n // 8):
                        x, y = C.task_batch(g, 0, 8)
                        x = x * (1 + 99 * k)  # client 1's features in raw units
                        opt.zero_grad()
                        crit(model(x, 0), y).backward()
                        opt.step()
                    client_sds.append(copy.deepcopy(model.state_dict()))
                model.load_state_dict(C.fedavg_aggregate(client_sds, n_samples))
    err = info.value
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (12, "forward", "body.2")
    rep = nanreplay_json(err.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (rep["cause"], o["module"], o["op"], o["made"]) == (
        "overflow", "body.2", "aten.addmm", "+inf"), rep
    w = rep["window"]
    assert (w["copy_step"], w["reproduced"]) == (8, False), w
    # step 9: client 1 of the round starts from the global weights the loop loaded
    (note,) = [p for p in rep["problems"] if "is not the run" in p]
    assert note.startswith("from step 9 the window's re-run is not the run") \
        and "load_state_dict" in note, note
    assert w["departed"] == 9
    tried = [t for t in rep["what_if"] if t["finite"] is not None]
    assert tried and all("no evidence of a fix" in t["note"] for t in tried), rep["what_if"]


def test_si_penalty_given_to_the_loss_is_named_as_the_argument_it_came_in(tmp_path):
    """Synaptic Intelligence with ``xi = 0``: task 2's head never moved during task 1, so its
    importance ``omega / (delta^2 + xi)`` is 0/0, and the penalty the loop hands to
    ``loss_fn`` is NaN from task 2's first step. Every op of the loss took that NaN as given:
    the report was 'invalid — the loss is non-finite from finite model outputs: check the
    loss inputs (targets out of range, log of zero probabilities)'."""
    model = C.make_tasknet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    si = C.SI(model, xi=0.0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=C.penalised_ce, out_dir=tmp_path,
                            factory=FACTORY) as rec:
            for task in range(2):
                for _ in range(4):
                    x, y = C.task_batch(g, task)
                    opt.zero_grad()
                    penalty = si.penalty(model, 0.1)
                    rec.loss_fn(model(x, task), y, penalty).backward()
                    si.before_step(model)
                    opt.step()
                    si.after_step(model)
                si.consolidate(model)
    assert torch.isnan(si.big_omega["heads.1.weight"]).all()
    assert torch.isfinite(si.big_omega["body.0.weight"]).all()
    err = info.value
    assert (err.event["step"], err.event["phase"], err.event["micro_batch"]) == (4, "loss", 0)
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["tensor"], o["made"]) == (
        True, None, "<loss>", None, "loss_args[2]", "nan"), rep
    assert "a term the loop computed from the model's weights" in rep["hint"] \
        and "SI's" in rep["hint"], rep["hint"]
    text = invoke_cli(err.bundle_path).stdout
    assert "origin     loss: nan in loss_args[2], made from the weights in the loop" in text

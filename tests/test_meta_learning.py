"""End to end on MAML (an inner loop through ``torch.func.functional_call``, several forwards
and losses per step): the event is the first non-finite value in the order the step ran it,
and a forward that ran with adapted weights is not blamed on the factory."""

from __future__ import annotations

import json

import meta_models as MM
import pytest
import torch
from bundles import invoke_cli

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def train(tmp_path, spoil, inner_lr=lambda it: 0.01):
    model, crit = MM.make_model(), torch.nn.MSELoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="meta_models:make_model"):
            for it in range(6):
                tasks = [MM.task(g) for _ in range(2)]
                spoil(it, tasks)
                MM.meta_step(model, crit, opt, tasks, inner_lr(it))
    err = info.value
    r = invoke_cli(err.bundle_path, "--json")
    return err, json.loads(r.stdout)


def test_a_bad_support_label_is_the_event_not_the_query_forward_it_broke(tmp_path):
    """Step 3's second task has an inf label in its support set (micro-batch 2): its loss is
    inf, the adapted weights NaN, and the query forward (micro-batch 3) NaN. The query's NaN
    ran later; the event is the label."""

    def spoil(it, tasks):
        if it == 3:
            tasks[1][1][3] = float("inf")

    err, rep = train(tmp_path, spoil)
    ev = err.event
    assert (ev["step"], ev["phase"], ev["micro_batch"], ev["tensor"], ev["samples"]) == (
        3, "input", 2, "loss_args[1]", [3]), ev
    assert (rep["origin"]["phase"], rep["cause"], rep["reproduced"]) == ("input", "input", True)


def test_a_forward_with_adapted_weights_is_not_blamed_on_the_factory(tmp_path):
    """An inner learning rate of 1e30 at step 2 makes the adapted weights huge and the first
    query forward (micro-batch 1) overflow. The bundle holds the model's own weights, so that
    forward cannot be re-run as it ran; the report says why (micro-batch 0 re-ran as
    recorded), not that the factory builds another model."""
    err, rep = train(tmp_path, lambda it, tasks: None,
                     inner_lr=lambda it: 1e30 if it == 2 else 0.01)
    assert (err.event["step"], err.event["phase"], err.event["micro_batch"]) == (2, "forward", 1)
    fid = rep["fidelity"]
    assert (fid["matches"], fid["micro_batch"], fid["within_step"]) == (False, 1, True), fid
    assert rep["cause"] is None and rep["reproduced"] is False
    note = " ".join(rep["problems"]) + (rep["hint"] or "")
    assert "a forward of the step ran with other weights than the bundle holds" in note, rep
    assert "factory builds a different model" not in json.dumps(rep)


def train_proto_maml(tmp_path, short_at: int, dist: str = "norm", rewind: int | None = None):
    """Proto-MAML over 5-way 2-shot episodes; at step ``short_at`` class 2 has one support
    sample only (a class the sampler found short of examples)."""
    model, crit = MM.make_proto_head(dist), torch.nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                        factory="meta_models:make_proto_head", factory_kwargs={"dist": dist},
                        rewind=rewind):
        for it in range(6):
            ep = MM.episode(g, [2, 2, 1, 2, 2] if it == short_at else [2] * 5)
            MM.proto_maml_step(model, crit, opt, ep, 0.1)
    return ep


def test_proto_maml_second_order_nan_at_a_single_shot_is_named(tmp_path):
    """The support sample alone in its class is its own prototype: its distance is a norm of
    exactly 0, whose derivative torch masks to 0 (the inner gradient is finite) but whose
    second derivative is 0/0, in the outer backward through the inner gradient. The query
    forward ran with adapted weights and cannot be re-run; the report was 'cause unknown'.
    The replay re-differentiates the support micro-batch and names the node."""
    with pytest.raises(NonFiniteError) as info:
        train_proto_maml(tmp_path, short_at=3)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (3, "backward"), err.event
    ys = MM.episode(torch.Generator().manual_seed(0), [2, 2, 1, 2, 2])[1]
    alone = [i for i, c in enumerate(ys.tolist()) if (ys == c).sum() == 1]  # class 2's only
    rep = json.loads(invoke_cli(err.bundle_path, "--json").stdout)
    o = rep["origin"]
    assert (rep["cause"], rep["reproduced"], o["phase"], o["module"], o["op"],
            o["second_order"], o["micro_batch"], o["samples"]) == (
        "invalid", True, "backward", "", "DivBackward0", "LinalgVectorNormBackward0", 0,
        alone), json.dumps(rep, indent=1)
    assert ".norm(dim=-1)" in rep["source_lines"][o["source"]]
    assert "second derivative" in rep["hint"] and "squared distance" in rep["hint"]
    assert rep["fidelity"]["within_step"] is True


def test_proto_maml_rewind_window_is_not_rerun_with_weights_no_step_ran(tmp_path):
    """With rewind=2, the window re-ran steps 0-3 from its copy with the model's own weights
    where the query forwards had run with adapted ones, found every value finite and said
    'the event did NOT come back'. It is not re-run now, and says why."""
    with pytest.raises(NonFiniteError) as info:
        train_proto_maml(tmp_path, short_at=3, rewind=2)
    rep = json.loads(invoke_cli(info.value.bundle_path, "--json").stdout)
    assert (rep["cause"], rep["origin"]["op"], rep["window"]) == ("invalid", "DivBackward0", None)
    assert any(p.startswith("the rewind window was not re-run: a forward of the event step ran "
                            "with weights the bundle does not hold") for p in rep["problems"])


def test_proto_maml_inner_gradient_nan_is_the_event_of_the_adapted_forward(tmp_path):
    """With sqrt(sum of squares) the single shot's distance of 0 makes the inner gradient
    itself NaN (sqrt's inf derivative times 0): the adapted weights are NaN and the recorder
    sees the query forward's first layer go NaN (micro-batch 1), on weights the bundle does
    not hold. The replay named the backward of micro-batch 0 but said 'NOT reproduced' (exit
    1) with no word of how the two relate, and its hint proposed vector_norm, whose second
    derivative at 0 is the NaN of the test above."""
    with pytest.raises(NonFiniteError) as info:
        train_proto_maml(tmp_path, short_at=3, dist="sqrt")
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["micro_batch"], ev["module"]) == (
        3, "forward", 1, "encoder.0"), ev
    ys = MM.episode(torch.Generator().manual_seed(0), [2, 2, 1, 2, 2])[1]
    alone = [i for i, c in enumerate(ys.tolist()) if (ys == c).sum() == 1]
    r = invoke_cli(info.value.bundle_path, "--json")
    rep = json.loads(r.stdout)
    o = rep["origin"]
    assert (r.exit_code, rep["reproduced"], rep["cause"], o["phase"], o["op"], o["module"],
            o["micro_batch"], o["samples"]) == (
        0, True, "invalid", "backward", "SqrtBackward0", "", 0, alone), json.dumps(rep, indent=1)
    note = " ".join(rep["problems"])
    assert "micro-batch 1's forward" in note and "made from micro-batch 0's gradient" in note
    assert "second derivative" in rep["hint"], rep["hint"]


def test_reptile_meta_update_is_a_step_checked_before_it_applies(tmp_path, caplog):
    """Reptile's meta-update takes its gradients from fast weights trained on a copy: the
    recorded model runs no forward, so no step ever opened. An inf support label at step 3
    made the fast weights NaN, the meta-gradient NaN and the model's weights NaN; training went
    on for two more updates and the recorder raised at the end, an optimizer event of step
    -1. Each such update is now a step of its own: its NaN gradients are a backward event at
    step 3, before the update, and the replay says the loop wrote them; its rewind window
    (nothing it could re-run) is not re-run."""
    model, crit = MM.make_model(), torch.nn.MSELoss()
    meta_opt = torch.optim.SGD(model.parameters(), lr=1.0)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, meta_opt, loss_fn=crit, out_dir=tmp_path,
                            factory="meta_models:make_model", rewind=2):
            for it in range(6):
                xs, ys, _, _ = MM.task(g)
                if it == 3:
                    ys[4] = float("inf")
                MM.reptile_step(model, crit, meta_opt, (xs, ys))
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["micro_batch"]) == (3, "backward", None), ev
    assert ev["params"] == [n for n, _ in model.named_parameters()]
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())  # not applied
    said = [r.getMessage() for r in caplog.records if "no forward of the recorded" in
            r.getMessage()]
    assert len(said) == 1 and "internal error" not in caplog.text, caplog.text  # (once)
    r = invoke_cli(info.value.bundle_path, "--json")
    rep = json.loads(r.stdout)
    assert (r.exit_code, rep["cause"], rep["origin"]["phase"]) == (
        1, "not_reproduced", "backward"), json.dumps(rep, indent=1)
    assert "ran no forward of the recorded model" in " ".join(rep["problems"])
    assert "Reptile's p - fast_p" in rep["hint"]
    assert rep["window"] is None and any(  # (it had said "every value finite")
        p.startswith("the rewind window was not re-run: the event step ran no forward")
        for p in rep["problems"])


def test_a_step_with_no_gradient_before_training_is_no_step(tmp_path, caplog):
    """``optimizer.step()`` once before training, with no gradient (the idiom that silences the
    scheduler's order warning): it changes no weight, so it is no update-only step, no warning
    about a copy of the model, and the training steps keep their numbers."""
    model, crit = MM.make_model(), torch.nn.MSELoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path) as rec:
        opt.step()
        for _ in range(3):
            xs, ys, _, _ = MM.task(g)
            opt.zero_grad()
            crit(model(xs), ys).backward()
            opt.step()
        assert rec.step == 3
    assert "no forward of the recorded" not in caplog.text, caplog.text


def test_prototypes_of_an_earlier_forward_are_learned_not_data(tmp_path):
    """torchmeta's loop: the support set and the query set are two forwards, and one loss
    takes both embeddings. At step 3 task 2's only shot of class 1 is labelled 0: class 1 has
    no support sample and its prototype is 0/0. The replay fed the loss the support forward's
    output detached twice, a tensor its lineage did not know as the model's, so the hint said
    the div computed on the batch's data alone (nothing the model learns) and that an eps
    would train toward a made-up target."""
    model = MM.make_task_encoder()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=MM.prototypical_loss, out_dir=tmp_path,
                            factory="meta_models:make_task_encoder") as rec:
            for it in range(6):
                b = MM.task_batch(g)
                if it == 3:
                    b["train"][1][2, 1] = 0
                opt.zero_grad()
                train_emb, test_emb = model(b["train"][0]), model(b["test"][0])
                rec.loss_fn(train_emb, b["train"][1], test_emb, b["test"][1]).backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"], err.event["micro_batch"]) == (3, "loss", 1)
    y = b["train"][1]
    empty = [t for t in range(y.shape[0]) if len(set(y[t].tolist())) < 5]  # (independently)
    rep = json.loads(invoke_cli(err.bundle_path, "--json").stdout)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["module"], o["micro_batch"],
            o["samples"]) == (True, "invalid", "aten.div", "<loss>", 1, empty), rep
    assert "/ counts.unsqueeze(-1)" in rep["source_lines"][o["source"]]
    assert "data alone" not in rep["hint"] and "add an eps to the denominator" in rep["hint"]


def train_matching(tmp_path, spoil):
    model = MM.make_matching_net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=MM.matching_loss, out_dir=tmp_path,
                            factory="meta_models:make_matching_net") as rec:
            for it in range(6):
                xs, ys, xq, yq = MM.episode(g, [2] * 5)
                if it == 3:
                    spoil(xs, xq)
                opt.zero_grad()
                rec.loss_fn(model(xs, ys, xq), yq).backward()
                opt.step()
    return info.value, xs, xq


def test_matching_net_blank_support_image_names_its_support_row(tmp_path):
    """A blank support image's embedding is 0: its cosine column is 0/0 for every query, so
    every sample of the batch (the queries) is NaN and the report said 'all 15 rows' and no
    more. The support row it comes from is now named."""
    err, xs, xq = train_matching(tmp_path, lambda xs, xq: xs[4].zero_())
    blank = [i for i in range(len(xs)) if not xs[i].any()]
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (3, "forward", "")
    rep = json.loads(invoke_cli(err.bundle_path, "--json").stdout)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["module"], o["samples"]) == (
        True, "invalid", "aten.div", "", list(range(len(xq)))), json.dumps(rep, indent=1)
    assert o["input_rows"] == {"tensor": "args[0]", "rows": blank}
    assert f"rows {blank} of args[0] are where it comes from" in " ".join(rep["problems"])


def test_matching_net_blank_query_is_dropped_not_called_a_graph(tmp_path):
    """A matching network takes the support labels sorted by class, ``[0, 0, 1, 1, ...]``,
    which read as a graph batch's assignment vector: ``--try drop`` of the blank query image
    (its embedding all 0 after the ReLUs, the cosine 0/0) was refused as 'graphs of a batch
    concatenated node by node'. A sorted vector with as many or more entries than the batch
    has samples assigns no nodes to graphs."""
    err, xs, xq = train_matching(tmp_path, lambda xs, xq: xq[7].zero_())  # (a blank image)
    blank = [i for i in range(len(xq)) if not xq[i].any()]
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (3, "forward", "")
    r = invoke_cli(err.bundle_path, "--json", "--try", "auto")
    rep = json.loads(r.stdout)
    o = rep["origin"]
    assert (r.exit_code, rep["cause"], o["op"], o["module"], o["samples"]) == (
        0, "invalid", "aten.div", "", blank), json.dumps(rep, indent=1)
    (tried,) = rep["what_if"]
    assert (tried["try"], tried["finite"]) == (f"drop={blank[0]}", True), tried


def test_nan_in_a_support_image_is_not_blamed_on_a_query_sample(tmp_path):
    """A NaN pixel in support image 4 (of 10; the batch is the 15 queries). The support labels
    sorted by class read as a graph batch's assignment vector, so support row 4 was taken for
    a node of 'graph' 2 (its class), and the event and the report named sample [2], a query
    that holds no NaN (and --try drop=2 removed it). The support set is no graph batch: no
    query sample is named, and the hint names the support rows."""
    def spoil(xs, xq):
        xs[4, 3] = float("nan")

    err, xs, xq = train_matching(tmp_path, spoil)
    bad = [i for i in range(len(xs)) if xs[i].isnan().any()]
    ev = err.event
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == (3, "input", "args[0]", [])
    rep = json.loads(invoke_cli(err.bundle_path, "--json").stdout)
    o = rep["origin"]
    assert (rep["cause"], o["tensor"], o["samples"]) == ("input", "args[0]", []), rep
    assert f"it holds them only in its rows {bad} (of {len(xs)})" in rep["hint"], rep["hint"]


def test_meta_sgd_inner_update_overflow_is_not_called_a_derivative_term(tmp_path):
    """Meta-SGD's inner rates are reset at step 3 from a config that holds the rate (100)
    where the model learns its log: exp(100) is inf in float32 and the adapted first layer
    NaN. That layer's query call is the first recorded non-finite call, so the fidelity check
    passed, and the replay took the inner autograd.grad for a gradient penalty: 'compute the
    derivative term (the gradient penalty, the PDE residual) inside the loss'. It now says
    the forward ran on weights the inner update made, and what to check."""
    model, crit = MM.make_meta_sgd(), torch.nn.MSELoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="meta_models:make_meta_sgd"):
            for it in range(6):
                if it == 3:
                    with torch.no_grad():
                        model.log_lr["net_0_weight"].fill_(100.0)  # the rate, not its log
                MM.meta_sgd_step(model, crit, opt, MM.task(g))
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["micro_batch"]) == (3, "forward", "net.0", 1)
    r = invoke_cli(info.value.bundle_path, "--json")
    rep = json.loads(r.stdout)
    o = rep["origin"]
    assert (r.exit_code, rep["cause"], o["phase"], o["module"], o["micro_batch"]) == (
        1, None, "forward", "net.0", 1), json.dumps(rep, indent=1)
    assert "derivative term" not in rep["hint"] and "Meta-SGD's, whose exp overflows" in \
        rep["hint"], rep["hint"]
    assert any("made within the step from an earlier micro-batch's gradient" in p
               for p in rep["problems"])

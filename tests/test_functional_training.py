"""End to end on training written with ``torch.autograd.functional.jacobian`` (a contractive
autoencoder's penalty in its loss module) and ``hvp``/``vhp`` (a Hutchinson Hessian-trace
penalty), ``torch.utils.checkpoint.checkpoint_sequential``
(inside the model's forward, reentrant or not; and on the recorded Sequential itself) and a
GCN's ``torch.sparse.mm`` over a degree-normalised sparse adjacency
(``functional_training_models``); each planted bug recorded, then replayed with the CLI."""

from __future__ import annotations

import functional_training_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch.autograd.functional import hvp, vhp

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

FACTORY = "functional_training_models:"


def line_of(text: str) -> str:
    return source_line("functional_training_models.py", text)


def trained(loop, model, opt, crit, rec: dict | None, factory: str | None = None) -> None:
    """``loop(loss_fn)`` bare (``crit``) or under a recorder (``rec``'s settings; its wrapped
    loss function), which must have met no internal error."""
    if rec is None:
        loop(crit)
        return
    made = {"factory": FACTORY + factory} if factory else {}
    with FlightRecorder(model, opt, loss_fn=crit, **made, **rec) as r:
        loop(r.loss_fn)
    assert r.health.internal_errors == 0


def run_cae(rec=None, zero_at=None):
    model = M.make_cae()
    crit, losses = M.ContractiveLoss(model.encoder), []
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def loop(loss_fn):
        for x in M.cae_batches(zero_at=zero_at):
            opt.zero_grad()
            loss = loss_fn(model(x), x)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    trained(loop, model, opt, crit, rec, "make_cae")
    return losses


def run_mlp(make, rec=None, blank_at=None, **kwargs):
    model, crit, losses = make(**kwargs), torch.nn.CrossEntropyLoss(), []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loop(_):  # (the loss module called as is: the recorder hooks it)
        for x, y in M.mlp_batches(blank_at=blank_at):
            opt.zero_grad()
            out = model(x) if make is not M.make_deep_mlp else M.checkpointed(model, x)
            loss = crit(out, y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    trained(loop, model, opt, crit, rec)
    return losses


def run_gcn(rec=None, isolated=None):
    model, crit, losses = M.make_gcn(), torch.nn.CrossEntropyLoss(), []
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, adj, y = M.graph(isolated=isolated)

    def loop(_):
        for _ in range(3):
            opt.zero_grad()
            loss = crit(model(x, adj), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    trained(loop, model, opt, crit, rec, "make_gcn")
    return losses


def run_curved(rec=None, zero_at=None, by=hvp):
    model = M.make_curved()
    crit, losses = M.CurvatureReg(model, by=by), []
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(5)  # (the Rademacher draws)

    def loop(loss_fn):
        for x, y in M.curved_batches(zero_at=zero_at):
            opt.zero_grad()
            loss = loss_fn(model(x), y, x)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    trained(loop, model, opt, crit, rec, "make_curved")
    return losses


def ckpt_rec(out_dir, reentrant: bool) -> dict:
    return {"out_dir": out_dir, "factory": FACTORY + "make_checkpointed",
            "factory_kwargs": {"use_reentrant": reentrant}}


def test_healthy_runs_train_bit_identically_and_raise_nothing(tmp_path):
    """The Jacobian penalty (the encoder's hooks run again inside ``jacobian``), both
    checkpoint modes (the segments' hooks run again in the backward's recompute) and the GCN
    on a sparse input: the same losses bit for bit as without the recorder, no bundle."""
    assert run_cae() == run_cae({"out_dir": tmp_path})
    for reentrant in (False, True):
        assert run_mlp(M.make_checkpointed, use_reentrant=reentrant) == run_mlp(
            M.make_checkpointed, ckpt_rec(tmp_path, reentrant), use_reentrant=reentrant)
    assert run_gcn() == run_gcn({"out_dir": tmp_path})
    assert run_curved() == run_curved({"out_dir": tmp_path})
    assert not list(tmp_path.glob("*.nan"))


def test_contractive_penalty_of_a_zero_feature_is_sqrts_derivative_in_the_loss(tmp_path):
    """``sign(x) * sqrt(|x|)`` in the encoder is finite at 0, its slope is not: record 5 of
    step 2 has feature 2 at exactly 0, and the Jacobian the loss takes is 0/0 there. The hint
    said the NaN was then multiplied by 'a mask's 0 (... an ignored target)': that product
    was abs's derivative (``grad * sgn(x)``) run by autograd inside ``jacobian``; and the
    sqrt's line in the encoder was not named (no ``node_source``), only the loss's."""
    step, row = 2, 5
    with pytest.raises(NonFiniteError) as info:
        run_cae({"out_dir": tmp_path}, zero_at=(step, row))
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (step, "loss")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["module"], o["op"], o["node"], o["made"], o["samples"]) == (
        "invalid", "<loss>", "aten.div", "SqrtBackward0", "nan", [row]), rep
    assert o["source"] == line_of("jac = jacobian(lambda v: self.encoder(v).sum(0), x")
    assert o["node_source"] == line_of("return torch.sign(x) * torch.sqrt(x.abs())"), o
    assert "a pole of that derivative" in rep["hint"], rep["hint"]
    assert "mask" not in rep["hint"], rep["hint"]


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_segments_blank_record_is_sqrts_backward_in_l2norm(tmp_path, reentrant):
    """``x / (sqrt(sum(x ** 2)) + eps)`` behind a bias-free layer, in a checkpointed segment:
    record 3 of step 2 is all zeros, the forward is finite, the backward (run on the
    segment's recompute) is NaN."""
    step, row = 2, 3
    with pytest.raises(NonFiniteError) as info:
        run_mlp(M.make_checkpointed, ckpt_rec(tmp_path, reentrant), blank_at=(step, row),
                use_reentrant=reentrant)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (step, "backward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["module"], o["op"], o["param"], o["samples"]) == (
        "invalid", "body.1", "SqrtBackward0", "body.0.weight", [row]), rep
    assert o["source"] == line_of("return x / (torch.sqrt((x ** 2).sum(dim=1")


def test_checkpoint_sequential_of_the_recorded_sequential_says_how_to_record_it(tmp_path,
                                                                                caplog):
    """``checkpoint_sequential(model, 3, x)`` on the recorded Sequential runs its children,
    never the model: no step opens. The recorder's warning at the first update told the user
    to give it "the module whose forward your training step calls", which this loop has none
    of, and the report said to call ``model(x)``, not ``model.forward(x)``, which the loop
    never did; both now name the helper and the fix."""
    with caplog.at_level("WARNING", logger="nanreplay"), pytest.raises(NonFiniteError) as info:
        run_mlp(M.make_deep_mlp, {"out_dir": tmp_path}, blank_at=(2, 3))
    assert info.value.event["phase"] == "optimizer"
    said = [r.getMessage() for r in caplog.records if "no forward of the recorded" in
            r.getMessage()]
    assert len(said) == 1 and "through torch.utils.checkpoint.checkpoint_sequential(model" \
        in said[0] and "checkpoint_sequential(self.body, segments, x)" in said[0], said
    rep = nanreplay_json(info.value.bundle_path, code=1)
    assert rep["cause"] == "not_reproduced"
    assert "the recorded model is an nn.Sequential" in rep["hint"], rep["hint"]
    assert "checkpoint_sequential(self.body, segments, x" in rep["hint"], rep["hint"]
    assert "not model.forward(x)" not in rep["hint"], rep["hint"]


def test_gcn_isolated_node_degree_pow_is_a_pole_on_its_row(tmp_path):
    """Node 4 lost its edges: ``deg.pow(-0.5)`` is +inf on it in conv1, and the product with
    the sparse aggregate's 0 is NaN."""
    node = 4
    with pytest.raises(NonFiniteError) as info:
        run_gcn({"out_dir": tmp_path}, isolated=node)
    err = info.value
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (0, "forward",
                                                                            "conv1")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "invalid", "conv1", "aten.pow", "+inf", [node]), rep
    assert o["source"] == line_of("dinv = deg.pow(-0.5).unsqueeze(1)")
    assert "isolated node" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("by", [hvp, vhp])
def test_hutchinson_hessian_trace_of_a_zero_feature_is_pows_second_derivative(tmp_path, by):
    """``|x| ** 1.5`` has a slope of 0 at 0 and an infinite second derivative: the Hessian-
    vector product the loss takes (``hvp``/``vhp``, create_graph) is +inf, then NaN, for
    record 5 of step 2, whose feature 1 is 0. The replay crashed: the double backward made
    autograd's efficient zeros (``aten._efficientzerotensor``), which the op finder read
    (``aminmax`` raised 'data is not allocated yet'; ``isfinite`` in another watcher crashed
    the process); and the node's line was the ``hvp`` call's, not the forward's ``pow``."""
    step, row = 2, 5
    with pytest.raises(NonFiniteError) as info:
        run_curved({"out_dir": tmp_path}, zero_at=(step, row), by=by)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (step, "loss")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["module"], o["op"], o["node"], o["made"], o["samples"]) == (
        "invalid", "<loss>", "aten.pow", "PowBackward0", "+inf", [row]), rep
    assert o["node_source"] == line_of("return x.abs().pow(1.5)"), o
    assert "of 0 to a negative power" in rep["hint"], rep["hint"]

"""Optimizers of the ``pytorch_optimizer`` package (4.1.0) swapped into a tabular classifier's
loop as its users do (``third_party_optimizers_models``): Lion, Adan, AdaBelief, Prodigy at
lr=1.0, SophiaH with its Hutchinson Hessian from ``backward(create_graph=True)``, Ranger,
Lookahead around AdamW, ``load_optimizer("lion")``, recorded with ``guard_optimizer=True``
until a planted bug fires, then replayed with the CLI.

Before, the replay rebuilt no optimizer outside ``torch.optim`` ("not a torch.optim built-in;
return it from the factory"), so an optimizer event of any of them was not re-run; SophiaH's
update, re-run, failed on gradients without the graph its Hessian-vector product
differentiates ("element 0 of tensors does not require grad")."""

from __future__ import annotations

import contextlib

import pytest
import pytorch_optimizer as po
import third_party_optimizers_models as M
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

DEAD = 5  # the feature column a dead sensor leaves 0 in every record


def _train(out_dir, make_opt, *, make="make_model", epochs: int = 2, record: bool = True,
           create_graph: bool = False, **data):
    """The user's loop: zero_grad, forward with the feature mask, a label-smoothed loss,
    backward (with ``create_graph`` for SophiaH), step. The bundle's path at an event, else
    the model."""
    model = getattr(M, make)()
    opt = make_opt(model)
    crit = M.LabelSmoothed()
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, guard_optimizer=True,
                         factory=f"third_party_optimizers_models:{make}") if record else None
    try:
        with rec if rec is not None else contextlib.nullcontext():
            for _ in range(epochs):
                for x, mask, y in M.loader(**data):
                    opt.zero_grad()
                    crit(model(x, mask), y).backward(create_graph=create_graph)
                    opt.step()
    except NonFiniteError as e:
        return e.bundle_path
    return model


def _optimizer_event(rep, cls: str, op: str, param: str = "inp.weight"):
    o = rep["origin"]
    assert (rep["event"]["step"], rep["cause"], o["phase"], o["op"], o["param"]) == \
        (0, "optimizer", "optimizer", op, param), (rep["cause"], o, rep["problems"])
    assert rep["hint"].startswith(f"{op} in {cls}'s update at step 0"), rep["hint"]
    assert "set eps > 0" in rep["hint"] and f"whole column(s) {DEAD} of inp.weight" in rep["hint"]
    assert not any("built-in" in p or "rebuilt" in p for p in rep["problems"]), rep["problems"]


@pytest.mark.parametrize("name,make_opt,op", [
    # AdaBelief's (g - m)^2 variance is 0 where every gradient was 0: 0 / (0 + eps=0)
    ("AdaBelief", lambda m: po.AdaBelief(m.parameters(), lr=1e-2, eps=0.0), "aten.addcdiv_"),
    # Prodigy at lr=1.0, its d estimate times eps=0 added to sqrt(v) = 0
    ("Prodigy", lambda m: po.Prodigy(m.parameters(), lr=1.0, eps=0.0), "aten.addcdiv_"),
    # Lookahead around AdamW: the inner AdamW's 0/0, its state held by the wrapper's base
    ("Lookahead", lambda m: po.Lookahead(torch.optim.AdamW(m.parameters(), lr=1e-2, eps=0.0)),
     "aten.addcdiv_"),
])
def test_a_zero_eps_update_of_a_dead_feature_is_re_run_in_the_library_s_class(
        out_dir, name, make_opt, op):
    bundle = _train(out_dir, make_opt, dead_feature=DEAD)
    assert bundle.name == "step00000000-rank0.nan"
    _optimizer_event(nanreplay_json(bundle), name, op)


# (SophiaH's users see torch's note on backward(create_graph=True)'s reference cycle)
@pytest.mark.filterwarnings("ignore:Using backward.. with create_graph")
def test_sophia_h_s_hessian_of_0_under_its_division_is_re_run_with_the_gradients_graph(out_dir):
    """SophiaH divides its momentum by the Hutchinson estimate clamped at eps=0: 0/0 where
    the dead feature's gradient (and Hessian) is 0. Its update differentiates the gradients
    again; the re-run now backpropagates with create_graph=True as the loop did."""
    bundle = _train(out_dir, lambda m: po.SophiaH(m.parameters(), lr=1e-2, eps=0.0),
                    create_graph=True, dead_feature=DEAD)
    _optimizer_event(nanreplay_json(bundle), "SophiaH", "aten.div")


def test_lion_with_a_huge_learning_rate_overflows_the_next_forward(out_dir):
    """load_optimizer("lion") at lr=1e38: its sign update moves every weight by 1e38, and the
    next step's first layer overflows float32."""
    bundle = _train(out_dir, lambda m: po.load_optimizer("lion")(m.parameters(), lr=1e38))
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["event"]["step"], rep["cause"], o["module"], o["op"], o["source"]) == \
        (1, "overflow", "inp", "aten.addmm",
         source_line("third_party_optimizers_models.py", "return self.out(self.act(self.inp(")
         ), (rep["cause"], o)
    assert "lower the learning rate" in rep["hint"], rep["hint"]


def test_a_nan_record_under_ranger_is_named_as_input(out_dir):
    """Ranger (Lookahead over RAdam) over a loader whose record 37 (batch 2, row 5) holds a
    NaN feature: the input, its sample and feature."""
    bundle = _train(out_dir, lambda m: po.Ranger(m.parameters(), lr=1e-3), nan_row=37)
    rep = nanreplay_json(bundle)
    assert (rep["event"]["step"], rep["cause"], rep["origin"]["samples"]) == (2, "input", [5])
    assert "sample 5 at feature(s) 3" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("make_opt", [
    lambda m: po.Adan(m.parameters(), lr=1e-3),
    lambda m: po.Lookahead(po.AdamW(m.parameters(), lr=1e-3), k=3),
])
def test_healthy_runs_raise_nothing_and_train_bit_identically(out_dir, make_opt):
    recorded = _train(out_dir, make_opt)
    bare = _train(out_dir, make_opt, record=False)
    assert isinstance(recorded, torch.nn.Module) and not list(out_dir.glob("*.nan"))
    for (n, a), b in zip(recorded.state_dict().items(), bare.state_dict().values()):
        assert torch.equal(a, b), n


def test_sam_given_as_the_optimizer_names_the_base_optimizer_its_loop_steps(out_dir):
    """pytorch_optimizer's SAM given to the recorder, stepped as its README shows
    (``first_step`` / ``second_step``): its own ``step()`` never runs, its base AdamW's does.
    The second pass's forward on the perturbed weights takes sqrt of a scale the ascent pushed
    below 0. The note said "the loop steps another one (created after the recorder?)"; it
    now names the wrapper's ``base_optimizer`` and how to record it."""
    model = M.make_scaled()
    opt = po.SAM(model.parameters(), base_optimizer=torch.optim.AdamW, rho=0.05, lr=1e-3)
    crit = M.LabelSmoothed()
    with pytest.raises(NonFiniteError) as info, \
            FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                           factory="third_party_optimizers_models:make_scaled"):
        for x, mask, y in M.loader():
            crit(model(x, mask), y).backward()
            opt.first_step(zero_grad=True)
            crit(model(x, mask), y).backward()  # at w + e
            opt.second_step(zero_grad=True)
    rep = nanreplay_json(info.value.bundle_path, code=None)
    assert (rep["event"]["step"], rep["event"]["phase"]) == (1, "forward")
    note = next(p for p in rep["problems"] if "never ran its own step()" in p)
    assert note.startswith("SAM, the optimizer given to FlightRecorder") and \
        "the AdamW it holds as base_optimizer" in note and \
        "FlightRecorder(model, opt.base_optimizer, ...)" in note, note


def test_sam_s_second_pass_nan_under_step_closure_is_re_run_on_the_moved_weights(out_dir):
    """SAM stepped with a closure, as pytorch_optimizer documents it: ``step(closure)`` moves
    the weights to w + e and calls the closure, whose forward takes sqrt of a scale the ascent
    pushed below 0, before the move is undone. The bundle holds the moved weights; the replay
    re-ran micro-batch 0 on them, found it differ and said "the factory builds a different
    model", cause unknown. It now compares from the moved forward on and names the sqrt."""
    model = M.make_scaled()
    opt = po.SAM(model.parameters(), base_optimizer=torch.optim.AdamW, rho=0.05, lr=1e-3)
    crit = M.LabelSmoothed()
    with pytest.raises(NonFiniteError) as info, \
            FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, guard_optimizer=True,
                           factory="third_party_optimizers_models:make_scaled"):
        for x, mask, y in M.loader():
            def closure(x=x, mask=mask, y=y):
                loss = crit(model(x, mask), y)
                loss.backward()
                return loss
            opt.zero_grad()
            crit(model(x, mask), y).backward()
            opt.step(closure)
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    # (the origin's micro_batch is the re-run's first forward on the moved weights, 0, where
    # training's was 1: the forward before the move is re-run on them too)
    assert (rep["event"]["step"], rep["event"]["micro_batch"], o["module"], o["op"],
            rep["cause"]) == (0, 1, "", "aten.sqrt", "invalid"), (rep["cause"], o)
    assert o["source"] == source_line("third_party_optimizers_models.py", "torch.sqrt(self.scale)")
    assert "aten.sqrt's input is the parameter scale" in rep["hint"], rep["hint"]
    assert any(p.startswith("micro-batch 0 ran before the weights were moved in place for "
                            "micro-batch 1") for p in rep["problems"]), rep["problems"]

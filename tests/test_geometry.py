"""End to end: embeddings in non-Euclidean and complex spaces (``geometry_models``) — Poincare
embeddings with the arcosh distance (float64 and float32, Riemannian SGD written in the loop,
a geoopt-style ``ManifoldParameter`` with its Riemannian optimizer), a hyperbolic network's
artanh log map, and ComplEx over complex64 embeddings — trained until the recorder raises,
then replayed. acosh's and atanh's hints were acos's (``cos.clamp(-1 + eps, 1 - eps)``) or the
generic ``x.clamp_min(eps)``, which leaves acosh's input below 1; ``guard_optimizer=True``
crashed training on float64 and complex weights; the replay dropped a parameter's subclass,
so a Riemannian optimizer's event was not reproduced."""

from __future__ import annotations

import warnings
from pathlib import Path

import geometry_models as G
import pytest
import torch
from bundles import nanreplay_json

from recorder import FlightRecorder, NonFiniteError

ACOSH_ADVICE = "x.clamp_min(1 + eps)"


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def _origin(rep: dict) -> tuple:
    o = rep["origin"]
    return (rep["event"]["step"], o["phase"], o["module"], o["op"], o["samples"], rep["cause"])


def _resample_self(ids: torch.Tensor) -> torch.Tensor:
    """Negatives equal to their anchor replaced by the next entity (as samplers exclude it)."""
    neg = ids[:, 2:]
    ids[:, 2:] = torch.where(neg == ids[:, :1], (neg + 1) % G.N_ENT, neg)
    return ids


def _train_poincare(out_dir, dtype: str, steps: int, resample: bool):
    """Nickel & Kiela's loop: SGD on the ranking loss, then the projection into the ball."""
    model = G.make_poincare(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    g = torch.Generator().manual_seed(0)
    batches = []
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=G.ranking_loss, out_dir=out_dir,
                            factory="geometry_models:make_poincare",
                            factory_kwargs={"dtype": dtype}) as rec:
            for _ in range(steps):
                ids = G.hierarchy_pairs(g)
                batches.append(_resample_self(ids) if resample else ids)
                opt.zero_grad()
                rec.loss_fn(model(batches[-1])).backward()
                opt.step()
                with torch.no_grad():
                    model.emb.weight.copy_(torch.renorm(model.emb.weight, 2, 0, 1 - G.BALL_EPS))
    return info.value, batches


def test_a_negative_sampled_equal_to_its_anchor_is_acosh_at_1_with_acoshs_own_advice(out_dir):
    """Uniform negatives include the anchor itself: its distance's argument is exactly 1,
    where acosh's derivative is infinite, and the zero gradient of |u - u|^2 times it is NaN.
    The hint was acos's ('its input is exactly +-1 ... cos.clamp(-1 + eps, 1 - eps) ... or use
    atan2 for an angle')."""
    err, batches = _train_poincare(out_dir, "float64", 5, resample=False)
    ids = batches[err.event["step"]]
    rows = (ids[:, 2:] == ids[:, :1]).any(1).nonzero().flatten().tolist()
    assert rows and (err.event["step"], err.event["phase"]) == (0, "backward")
    rep = nanreplay_json(err.bundle_path)
    assert _origin(rep) == (0, "backward", "", "AcoshBackward0", rows, "invalid"), rep["origin"]
    assert "its input is exactly 1, the edge of acosh's domain" in rep["hint"], rep["hint"]
    assert ACOSH_ADVICE in rep["hint"] and "equal to its anchor" in rep["hint"]
    assert "cos.clamp" not in rep["hint"] and "atan2" not in rep["hint"]


def test_float32_points_near_the_origin_round_the_distance_argument_to_1(out_dir):
    """Poincare embeddings initialised within 1e-3 of the origin, in float32: two points a
    few 1e-4 apart make 1 + 2|u-v|^2 / (...) round to exactly 1 (float64 keeps it above)."""
    err, batches = _train_poincare(out_dir, "float32", 5, resample=True)
    step = err.event["step"]
    e = G.make_poincare("float32").emb.weight.detach()[batches[step]]  # (step 0's weights)
    u, v = e[:, :1], e[:, 1:]
    arg = 1 + 2 * ((u - v) ** 2).sum(-1) / ((1 - (u * u).sum(-1)) * (1 - (v * v).sum(-1)))
    rows = (arg == 1).any(1).nonzero().flatten().tolist()
    assert step == 0 and rows
    rep = nanreplay_json(err.bundle_path)
    assert _origin(rep) == (0, "backward", "", "AcoshBackward0", rows, "precision"), \
        rep["origin"]
    assert "rounded to exactly 1, the edge of acosh's domain" in rep["hint"], rep["hint"]
    assert ACOSH_ADVICE in rep["hint"] and "float64" in rep["hint"]


def test_a_lorentz_distance_of_a_point_to_itself_rounds_below_1(out_dir):
    """The Lorentz model in float32: -<x, x>_L = (1 + |v|^2) - |v|^2 rounds below 1 for the
    anchor sampled as its own negative, acosh NaN in the forward (float64 has 1). The hint
    was the generic 'numerically stable formula ... or clamp to the domain'. Where it rounds
    to exactly 1 instead (the CPU's rounding decides: the test computes it as the model does),
    the forward is finite and acosh's infinite derivative there is the backward origin."""
    model = G.make_lorentz()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=G.ranking_loss, out_dir=out_dir,
                            factory="geometry_models:make_lorentz") as rec:
            for _ in range(3):
                ids = G.hierarchy_pairs(g)
                opt.zero_grad()
                rec.loss_fn(model(ids)).backward()
                opt.step()
    v = G.make_lorentz().emb.weight.detach()[ids]  # (step 0's weights)
    x0 = torch.sqrt(1 + (v * v).sum(-1))
    arg = x0[:, :1] * x0[:, 1:] - (v[:, :1] * v[:, 1:]).sum(-1)
    rows = (arg < 1).any(1).nonzero().flatten().tolist()
    assert info.value.event["step"] == 0
    rep = nanreplay_json(info.value.bundle_path)
    if rows:  # (MKL on the AMD EPYC: the point's distance to itself rounds below 1)
        assert _origin(rep) == (0, "forward", "", "aten.acosh", rows, "precision"), \
            rep["origin"]
    else:  # (on this Intel Xeon it rounds to exactly 1: acosh is 0, its derivative infinite)
        at_one = (arg == 1).any(1).nonzero().flatten().tolist()
        assert at_one, arg.min()
        assert _origin(rep) == (0, "backward", "", "AcoshBackward0", at_one, "invalid"), \
            rep["origin"]
    assert ACOSH_ADVICE in rep["hint"] and "Lorentz" in rep["hint"], rep["hint"]


def test_riemannian_sgd_without_the_projection_leaves_the_ball(out_dir):
    """Riemannian SGD written in the loop without its projection (no optimizer given to the
    recorder, ``end_step`` before the update): a large step carries points out of the ball,
    and the next forward's acosh argument is below 1 where one point of a pair is outside.
    The hint was 'x.clamp_min(eps) before log or sqrt', which leaves it below 1."""
    model = G.make_poincare()
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, None, loss_fn=G.ranking_loss, out_dir=out_dir,
                            factory="geometry_models:make_poincare") as rec:
            for _ in range(5):
                ids = _resample_self(G.hierarchy_pairs(g))
                model.emb.weight.grad = None
                rec.loss_fn(model(ids)).backward()
                rec.end_step()  # (the step is checked before the loop's own update)
                G.rsgd_step(model.emb.weight, lr=10.0, project=False)
    err = info.value
    out = model.emb.weight.detach().norm(dim=-1) >= 1  # (the event's weights: not updated)
    rows = (out[ids[:, :1]] ^ out[ids[:, 1:]]).any(1).nonzero().flatten().tolist()
    assert rows and (err.event["step"], err.event["phase"]) == (1, "forward")
    rep = nanreplay_json(err.bundle_path)
    assert _origin(rep) == (1, "forward", "", "aten.acosh", rows, "invalid"), rep["origin"]
    assert rep["hint"].startswith("aten.acosh of a number below 1"), rep["hint"]
    assert ACOSH_ADVICE in rep["hint"] and "left the ball" in rep["hint"]
    assert "clamp_min(eps) before log" not in rep["hint"]


def test_a_hyperbolic_log_map_of_a_point_on_the_boundary_is_atanh_of_1(out_dir):
    """HGCN's layers ported without their cast to float64: the clamp to 1 - 1e-15 is a no-op
    in float32, and a record whose one feature is large maps to tanh(30) = 1.0, a point on the
    ball's boundary; the next log map's artanh(1) is +inf, times a 0 coordinate NaN."""
    model, crit = G.make_hnn(), torch.nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="geometry_models:make_hnn"):
            for step in range(8):
                x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
                if step == 5:
                    x[4] = 0.0
                    x[4, 0] = 30.0
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    rep = nanreplay_json(info.value.bundle_path)
    assert _origin(rep) == (5, "forward", "l1", "aten.atanh", [4], "precision"), rep["origin"]
    assert rep["origin"]["made"] == "+inf"
    # (the code's own clamp named: its bound is 1 in float32; float64 keeps it off the edge)
    assert "its bound 0.999999999999999 is 1 in float32" in rep["hint"], rep["hint"]
    assert "eps of at least 5.96e-08" in rep["hint"] and "in float64" in rep["hint"], rep["hint"]
    assert "cos.clamp" not in rep["hint"]


def test_geoopt_riemannian_sgd_guarded_names_the_expmap_0_over_0(out_dir):
    """A geoopt-style ManifoldParameter (float64) updated by its RiemannianSGD, whose expmap
    divides the Riemannian gradient by its norm without a floor: the rows no pair touched have
    gradient 0, 0/0 at the first update. guard_optimizer=True crashed the training step (a
    float32 norm of float64 weights), and the replay loaded the weights as plain Parameters,
    so the optimizer re-ran a Euclidean update: 'NOT reproduced'."""
    model = G.make_geoopt()["model"]
    opt = G.RiemannianSGD(model.parameters(), lr=0.1)
    g, batches = torch.Generator().manual_seed(0), []
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=G.ranking_loss, out_dir=out_dir,
                            factory="geometry_models:make_geoopt", guard_optimizer=True) as rec:
            for _ in range(3):
                batches.append(_resample_self(G.hierarchy_pairs(g)))
                opt.zero_grad()
                rec.loss_fn(model(batches[-1])).backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"], err.event["params"]) == \
        (0, "optimizer", ["weight"])
    untouched = torch.ones(G.N_ENT, dtype=torch.bool)
    untouched[batches[0]] = False
    assert torch.equal(model.weight.isnan().any(1), untouched)  # 0/0 on the rows no pair had
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["param"], o["op"]) == \
        (True, "optimizer", "weight", "aten.div"), rep["origin"]
    assert "RiemannianSGD's update" in rep["hint"] and "0/0" in rep["hint"], rep["hint"]
    rows = untouched.nonzero().flatten().tolist()  # (the entities no pair had: named)
    assert (o["rows"], o["rows_of"]) == (rows, G.N_ENT), o
    assert "a row whose gradient was all 0 (absent from the batch)" in rep["hint"]


def _complex_batch(g: torch.Generator, factory: str):
    pos = G.triples(g)
    if factory == "make_complex":
        return (pos,), (pos[:, 2],)
    pos[:, 1].clamp_(min=1)
    return (pos, G.corrupt(g, pos)), ()


def _train_complex(factory: str, out_dir, **kw) -> torch.nn.Module:
    model = getattr(G, factory)()
    crit = G.N3Loss() if factory == "make_complex" else G.self_adversarial_loss
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"geometry_models:{factory}", **kw) if kw else None
    loss_fn = rec.attach().loss_fn if rec is not None else crit
    for _ in range(6):
        args, targets = _complex_batch(g, factory)
        opt.zero_grad()
        loss_fn(model(*args), *targets).backward()
        opt.step()
    if rec is not None:
        rec.end_step()
        assert rec.health.internal_errors == 0 and rec.event is None
        rec.detach()
    return model


@pytest.mark.parametrize("factory, kw", [("make_complex", {"guard_optimizer": True}),
                                         ("make_modular_rotate", {"stats": "full"})])
def test_complex_embeddings_train_unchanged_under_the_recorder(out_dir, factory, kw):
    """ComplEx over complex64 embeddings with kbc's N3 regularizer and Adagrad, under
    guard_optimizer=True: the guard's norms refused complex weights and the first
    ``optimizer.step()`` raised RuntimeError in the loop. RotatE with a submodule returning
    complex64 relations, under stats="full": its output's sum and norm are its real view's
    (a float32 sum of the complex tensor warned, which disabled the recorder)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _train_complex(factory, out_dir, **kw)
    want = _train_complex(factory, out_dir)
    assert not list(Path(out_dir).glob("*.nan"))
    for (n, p), q in zip(got.named_parameters(), want.parameters()):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("factory, module", [("make_unit_rotate", ""),
                                             ("make_modular_rotate", "unit")])
def test_a_zero_relation_put_on_the_unit_circle_is_named_at_its_complex_division(
        out_dir, factory, module):
    """RotatE with free complex64 relations normalised by ``r / r.abs()``; a batch padded with
    relation 0 (zero-initialised) divides 0 by 0. The op finder looked at real tensors only:
    it passed the complex div by and blamed the next real op, ``aten.abs`` of the distance,
    'at a pole or outside its domain', on the line after. Done in a submodule, the recorder
    (which measured real outputs only) named the root, and the replay, which now named the
    submodule, said 'NOT reproduced'."""
    model = getattr(G, factory)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=G.self_adversarial_loss, out_dir=out_dir,
                            factory=f"geometry_models:{factory}") as rec:
            for step in range(8):
                pos = G.triples(g)
                pos[:, 1].clamp_(min=1)
                neg = G.corrupt(g, pos)
                if step == 4:  # the epoch's last batch, padded to the batch size
                    pos[-3:, 1] = 0
                opt.zero_grad()
                rec.loss_fn(model(pos, neg)).backward()
                opt.step()
    rows = (pos[:, 1] == 0).nonzero().flatten().tolist()
    assert (info.value.event["module"], info.value.event["samples"]) == (module, rows)
    rep = nanreplay_json(info.value.bundle_path)
    assert rep["reproduced"] is True
    assert _origin(rep) == (4, "forward", module, "aten.div", rows, "invalid"), rep["origin"]
    assert "r / r.abs()" in rep["source_lines"][rep["origin"]["source"]]
    assert "(0/0)" in rep["hint"], rep["hint"]


def test_transe_padded_triples_are_a_sqrt_at_0_with_the_norm_named(out_dir):
    """TransE with its L2 distance written as sqrt(sum((h + r - t)^2)), entities renormed by
    ``nn.Embedding(max_norm=1)`` in the lookup (a write into the weights in every forward),
    and a last batch padded with triples of id 0, zero vectors without ``padding_idx``: the
    distance is 0 there and sqrt's derivative infinite. The hint named no norm that takes 0
    with a finite gradient."""
    model, crit = G.make_transe(2, 1.0), G.MarginLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="geometry_models:make_transe",
                            factory_kwargs={"max_norm": 1.0}) as rec:
            for step in range(8):
                pos = G.triples(g).clamp_(min=1)
                neg = G.corrupt(g, pos).clamp_(min=1)
                if step == 5:
                    pos[-2:], neg[-2:] = 0, 0
                opt.zero_grad()
                rec.loss_fn(model(pos, neg)).backward()
                opt.step()
    rows = (pos == 0).all(1).nonzero().flatten().tolist()
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (5, "backward")
    rep = nanreplay_json(err.bundle_path)
    assert _origin(rep) == (5, "backward", "", "SqrtBackward0", rows, "invalid"), rep["origin"]
    assert "torch.linalg.vector_norm(d, dim=-1)" in rep["hint"], rep["hint"]

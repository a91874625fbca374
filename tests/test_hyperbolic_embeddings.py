"""End to end: hyperbolic representation learning (``hyperbolic_embeddings_models``) —
Poincare embeddings of a tree's transitive closure with hyptorch's distance and Nickel &
Kiela's arcosh distance, negatives that are known ancestors masked to -inf in the logits,
Riemannian SGD written in the loop, and an HGCN-style network with a trained curvature and
hyperbolic MLR — trained until the recorder raises, then replayed. A -inf mask whose sign the
unary minus flipped (``-d.masked_fill(m, -inf)``) was called an intended mask with
``allow_inf`` advice; an arcosh at 1 under such a mask was told to resample the negative,
which the mask was written to exclude, without saying the mask does not act on the
backward."""

from __future__ import annotations

import hyperbolic_embeddings_models as M
import pytest
import torch
from bundles import line_number, nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

MODELS = "hyperbolic_embeddings_models.py"
FACTORY = "hyperbolic_embeddings_models:"


def _origin(rep: dict) -> tuple:
    o = rep["origin"]
    return (rep["event"]["step"], o["phase"], o["module"], o["op"], o["samples"], rep["cause"])


def _train_embeddings(model, out_dir, factory: str, steps: int, record: bool = True,
                      lr: float = 0.3, resample_self: bool = False, loss=M.ranking_loss,
                      eps: float = 1e-5, **kw):
    """Nickel & Kiela's loop: the ranking loss over (child, ancestor, negatives), Riemannian
    SGD written in the loop (the recorder checks the step before it); ``allow_inf`` names the
    root, whose logits hold the known ancestors' -inf. Returns the batches."""
    g, batches = torch.Generator().manual_seed(0), []
    rec = FlightRecorder(model, None, loss_fn=loss, out_dir=out_dir,
                         factory=FACTORY + factory, **kw) if record else None
    loss_fn = rec.attach().loss_fn if rec is not None else loss
    try:
        for _ in range(steps):
            batches.append(M.tree_batch(g, resample_self=resample_self))
            model.emb.weight.grad = None
            loss_fn(model(*batches[-1])).backward()
            if rec is not None:
                rec.end_step()
            M.rsgd_(model.emb.weight, lr, eps)
    finally:
        if rec is not None:
            rec.detach()
    return batches


def test_a_minus_before_the_masked_fill_names_the_flipped_mask_not_allow_inf(out_dir):
    """``-dist(...).masked_fill(known, -inf)``: the minus binds after the call, so the known
    ancestors' logits are +inf and the softmax over them is inf. The report said an intended
    -inf mask reached the output and to record with allow_inf, which only moves the event
    into the loss."""
    model = M.make_poincare(minus_late=True)
    with pytest.raises(NonFiniteError) as info:
        _train_embeddings(model, out_dir, "make_poincare", 3,
                          factory_kwargs={"minus_late": True})
    g = torch.Generator().manual_seed(0)
    known = M.tree_batch(g)[3]
    rows = known.any(1).nonzero().flatten().tolist()
    err = info.value
    assert rows and (err.event["step"], err.event["kind"]) == (0, "+inf")
    rep = nanreplay_json(err.bundle_path)
    assert _origin(rep) == (0, "forward", "", "aten.masked_fill", rows, "invalid"), \
        rep["origin"]
    assert rep["origin"]["source"] == source_line(MODELS, "negs = -dist(eu[:, None]")
    hint = rep["hint"]
    assert "the output holds +inf" in hint and "flipped its sign" in hint, hint
    assert "(-d).masked_fill(m, -inf)" in hint and "record with allow_inf" not in hint
    assert any("as +inf: its sign was flipped" in p for p in rep["problems"]), rep["problems"]


def test_the_flipped_mask_under_allow_inf_is_a_plus_inf_row_not_a_fully_masked_one(out_dir):
    """The same model recorded with allow_inf on the root (the advice the report gave): the
    loss's log_softmax makes NaN of the rows holding +inf. The report said 'a row whose every
    entry is -inf (a fully masked row)' and to keep one key per row; no row was masked."""
    model = M.make_poincare(minus_late=True)
    with pytest.raises(NonFiniteError) as info:
        _train_embeddings(model, out_dir, "make_poincare", 3, allow_inf=[""],
                          factory_kwargs={"minus_late": True})
    known = M.tree_batch(torch.Generator().manual_seed(0))[3]
    rows = known.any(1).nonzero().flatten().tolist()
    assert rows and info.value.event["phase"] == "loss"
    rep = nanreplay_json(info.value.bundle_path)
    assert _origin(rep) == (0, "loss", "<loss>", "aten._log_softmax", rows, "invalid"), \
        rep["origin"]
    hint = rep["hint"]
    assert hint.startswith("aten._log_softmax of a row holding +inf"), hint
    assert "(-d).masked_fill(m, -inf)" in hint and "fully masked" not in hint


def test_distances_returned_at_plus_inf_on_purpose_keep_the_allow_inf_advice(out_dir):
    """The model returns distances, the masked ones +inf on purpose (a -inf score negated),
    and the loss negates them back into logits: its loss is finite, so the +inf is a mask the
    output is meant to hold, not a flipped sign."""
    model = M.make_poincare(distances=True)
    with pytest.raises(NonFiniteError) as info:
        _train_embeddings(model, out_dir, "make_poincare", 3, loss=M.distance_loss,
                          factory_kwargs={"distances": True})
    assert info.value.event["kind"] == "+inf"
    rep = nanreplay_json(info.value.bundle_path)
    assert (rep["origin"]["op"], rep["cause"]) == ("aten.masked_fill", "invalid"), rep["origin"]
    assert "record with allow_inf" in rep["hint"] and "flipped" not in rep["hint"], rep["hint"]


def test_the_anchor_masked_as_its_own_negative_is_acosh_at_1_in_the_backward(out_dir):
    """Nickel & Kiela's arcosh distance in float64, the anchor sampled as its own negative
    and masked to -inf as a known positive: the forward is fine, but AcoshBackward0 at an
    argument of exactly 1 multiplies the mask's 0 gradient by an infinite derivative. The
    hint said to resample the negative, which the mask was meant to do, and not that a mask
    after the op leaves the backward at the pole."""
    model = M.make_nickel_kiela()
    with pytest.raises(NonFiniteError) as info:
        _train_embeddings(model, out_dir, "make_nickel_kiela", 3, allow_inf=[""])
    child, _, neg, _ = M.tree_batch(torch.Generator().manual_seed(0))
    rows = (neg == child[:, None]).any(1).nonzero().flatten().tolist()
    err = info.value
    assert rows and (err.event["step"], err.event["phase"]) == (0, "backward")
    rep = nanreplay_json(err.bundle_path)
    assert _origin(rep) == (0, "backward", "", "AcoshBackward0", rows, "invalid"), \
        rep["origin"]
    assert rep["origin"]["source"] == source_line(MODELS, "return torch.acosh(1 + 2 * sq")
    hint = rep["hint"]
    assert "its input is exactly 1" in hint and "x.clamp_min(1 + eps)" in hint, hint
    assert "the gradient entering AcoshBackward0 is 0 at every entry where it made NaN" in hint
    assert "torch.where(mask, safe, x)" in hint and "not its output" in hint


def test_an_unmasked_arcosh_at_1_keeps_its_own_advice(out_dir):
    """The same anchor as its own negative without the mask (its logit reaches the loss):
    the incoming gradient is not 0, so nothing is said of a mask."""
    model = M.make_nickel_kiela(masked=False)
    with pytest.raises(NonFiniteError) as info:
        _train_embeddings(model, out_dir, "make_nickel_kiela", 3,
                          factory_kwargs={"masked": False})
    rep = nanreplay_json(info.value.bundle_path)
    assert rep["origin"]["op"] == "AcoshBackward0" and rep["cause"] == "invalid", rep["origin"]
    assert "equal to its anchor: resample it" in rep["hint"], rep["hint"]
    assert "the gradient entering" not in rep["hint"]


def test_a_float16_table_rounds_the_artanh_clamp_to_1_under_the_mask(out_dir):
    """The embedding table kept in float16, hyptorch's artanh clamped to 1 - 1e-5, which is 1
    in float16: a known ancestor near the boundary (masked to -inf) makes atanh(1), whose
    backward is NaN under the mask's 0. The hint gave float32's eps, the one the code has.

    The table is loaded with the first batch's child 14 and its masked ancestor 2 on opposite
    sides of the ball, at float16's 0.999 (1023/1024, the loop's projection to 1 - 1e-3), on
    an axis: every value on the way to |(-x) (+) y| is exact or rounded elementwise in one
    way (sums and norms of one nonzero entry), so the clamp's input is 1 on every CPU (exactly
    0.9999995 in float64, under the clamp's 1 - 1e-5: ``precision``). (A run
    of 8 steps at lr=10 that reached the boundary by training gave the pair with AVX2 and
    AVX-512 kernels, and a positive pair at the boundary, a loss event, with the scalar
    ones.)"""
    model = M.make_poincare(dtype="float16")
    child, _, neg, known = _batch_at(0)
    assert child[4] == 14 and neg[4, 7] == 2 and known[4, 7], (child, neg)
    with torch.no_grad():  # (14 is nowhere its own negative: (-x) (+) x would be 0/0)
        model.emb.weight[14] = torch.tensor([-0.999, 0.0])
        model.emb.weight[2] = torch.tensor([0.999, 0.0])
    with pytest.raises(NonFiniteError) as info:
        _train_embeddings(model, out_dir, "make_poincare", 8, lr=10.0, eps=1e-3,
                          allow_inf=[""], factory_kwargs={"dtype": "float16"})
    err = info.value
    assert err.event["step"] == 0, err.event
    u, v, neg, known = _batch_at(err.event["step"])
    w = model.emb.weight.detach()  # (the event's weights: the loop's update did not run)
    at_one = M.mobius_add(-w[u][:, None], w[neg]).norm(dim=-1).clamp(max=1 - 1e-5) == 1
    rows = (at_one & known).any(1).nonzero().flatten().tolist()
    assert rows == [4] and err.event["phase"] == "backward", rows
    rep = nanreplay_json(err.bundle_path)
    assert _origin(rep) == (err.event["step"], "backward", "", "AtanhBackward0", rows,
                            "precision"), rep["origin"]
    hint = rep["hint"]
    # (the clamp's bound 1 - 1e-5 is 1 in float16: replay.rounded_bound says so, with the eps
    # float16 resolves below 1, in place of the generic narrow-type eps of replay.unit_eps)
    assert "its bound 0.99999 is 1 in float16" in hint and "at least 0.000488" in hint, hint
    assert "the gradient entering" in hint, hint


def _batch_at(step: int) -> tuple:
    g = torch.Generator().manual_seed(0)
    return [M.tree_batch(g) for _ in range(step + 1)][-1]


def test_a_curvature_trained_below_zero_names_the_pow_and_the_parameter(out_dir):
    """HGCN's trained curvature in its own Adam group with a larger learning rate: it crosses
    0 at step 5's update, and step 6's sqrt(c) (``c ** 0.5``) is NaN for every record."""
    model, crit = M.make_hypnet(), torch.nn.CrossEntropyLoss()
    rest = [p for n, p in model.named_parameters() if n != "c"]
    opt = torch.optim.Adam([{"params": rest}, {"params": [model.c], "lr": 0.3}], lr=0.05)
    g, cs = torch.Generator().manual_seed(0), []
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory=FACTORY + "make_hypnet"):
            for _ in range(10):
                x, y = M.features(g)
                opt.zero_grad()
                crit(model(x), y).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                cs.append(model.c.item())
    err = info.value
    assert cs[-1] < 0 < cs[-2] and err.event["step"] == len(cs)
    rep = nanreplay_json(err.bundle_path)
    assert _origin(rep) == (len(cs), "forward", "", "aten.pow", list(range(32)), "invalid"), \
        rep["origin"]
    first_use = line_number(MODELS, "def expmap0") + 1  # (its first line: sqrt_c = c ** 0.5)
    assert rep["origin"]["source"] == f"{MODELS}:{first_use}"
    assert f"the parameter c ({cs[-1]:.4g})" in rep["hint"], rep["hint"]
    assert "softplus" in rep["hint"] and "learn its log" in rep["hint"]


@pytest.mark.parametrize("kind", ["poincare", "nickel_kiela", "hypnet"])
def test_healthy_runs_raise_nothing_and_train_the_same(out_dir, kind):
    """hyptorch's distance with the known ancestors (and the anchor itself) masked to -inf,
    allow_inf on the root: its norm of (-u) (+) u = 0 has a gradient of 0 there, no event in
    20 steps; Nickel & Kiela's arcosh with the anchor resampled out of its negatives (the
    ancestors still masked); the hyperbolic network with a fixed curvature under
    clip_grad_norm_ and StepLR. All train bit for bit as without the recorder."""
    if kind != "hypnet":
        make = getattr(M, f"make_{kind}")
        a, b = make(), make()
        for model, record in ((a, True), (b, False)):
            _train_embeddings(model, out_dir, f"make_{kind}", 20, record=record,
                              resample_self=kind == "nickel_kiela", allow_inf=[""])
    else:
        a, b = (_train_hypnet(out_dir, record) for record in (True, False))
    assert not list(out_dir.glob("*.nan"))
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.isfinite(p).all() and torch.equal(p, q), name


def _train_hypnet(out_dir, record: bool) -> torch.nn.Module:
    model, crit = M.make_hypnet(learn_c=False), torch.nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 5, 0.5)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=FACTORY + "make_hypnet") if record else None
    loss_fn = rec.attach().loss_fn if rec is not None else crit
    g = torch.Generator().manual_seed(0)
    for _ in range(12):
        x, y = M.features(g)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    if rec is not None:
        rec.end_step()
        assert rec.event is None and rec.health.internal_errors == 0
        rec.detach()
    return model


def test_lorentz_negatives_padded_with_a_zero_row_name_the_expmaps_0_over_0(out_dir):
    """The Lorentz model with points as tangent vectors at the origin, a DataLoader whose
    collate pads each pair's negatives with entity 0 (``padding_idx``, a row of zeros): the
    exp map's sinh(|v|) v / |v| is 0/0 there, in the third call of its line (the
    negatives'), on the records with padding."""
    model = M.make_lorentz()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(M.ClosureDataset(), batch_size=8, shuffle=True,
                                         collate_fn=M.collate,
                                         generator=torch.Generator().manual_seed(0))
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.ranking_loss, out_dir=out_dir,
                            factory=FACTORY + "make_lorentz") as rec:
            for u, v, neg in loader:
                opt.zero_grad()
                rec.loss_fn(model(u, v, neg)).backward()
                opt.step()
    rows = (neg == 0).any(1).nonzero().flatten().tolist()
    assert rows and len(rows) < len(neg) and info.value.event["step"] == 0
    rep = nanreplay_json(info.value.bundle_path)
    assert _origin(rep) == (0, "forward", "", "aten.div", rows, "invalid"), rep["origin"]
    assert rep["origin"]["source"] == source_line(MODELS, "torch.sinh(n) * v / n")
    assert rep["origin"]["line_run"] == 3, rep["origin"]  # (the negatives' call, of 3)
    assert "0/0" in rep["hint"] and "clamp_min(eps)" in rep["hint"], rep["hint"]


def test_accumulated_micro_batch_with_the_masked_anchor_is_named_with_its_rows(out_dir):
    """Two micro-batches a step, Nickel & Kiela's burn-in (lr / 10 for two steps, LambdaLR)
    and the projection after ``step()``; the sampler stops excluding the anchor in step 3's
    second micro-batch: the event is that micro-batch's AcoshBackward0 under the mask."""
    model = M.make_nickel_kiela()
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.1 if s < 2 else 1.0)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.ranking_loss, out_dir=out_dir,
                            factory=FACTORY + "make_nickel_kiela", allow_inf=[""]) as rec:
            for step in range(5):
                opt.zero_grad()
                for mb in range(2):
                    child, v, neg, known = M.tree_batch(g, resample_self=(step, mb) != (3, 1))
                    (rec.loss_fn(model(child, v, neg, known)) / 2).backward()
                opt.step()
                sched.step()
                with torch.no_grad():
                    model.emb.weight.copy_(torch.renorm(model.emb.weight, 2, 0, 1 - 1e-5))
    rows = (neg == child[:, None]).any(1).nonzero().flatten().tolist()
    assert rows and (step, info.value.event["phase"]) == (3, "backward")
    rep = nanreplay_json(info.value.bundle_path)
    assert _origin(rep) == (3, "backward", "", "AcoshBackward0", rows, "invalid"), \
        rep["origin"]
    assert rep["origin"]["micro_batch"] == 1 and "the gradient entering" in rep["hint"]


def test_the_eps_a_half_type_resolves_below_1_is_named_for_unit_poles_only():
    """Where no clamp of the code's is in sight (replay.rounded_bound names one), a unit pole
    reached by rounding in float16 or bfloat16 gets the spacing below 1 of that type and an
    eps above it; float32 and other nodes get nothing added."""
    from replay.unit_eps import narrow_eps

    half = narrow_eps("AtanhBackward0", torch.float16)
    assert "in float16 the largest number below 1 is 1 - 0.00049" in half, half
    assert "an eps of at least 0.001" in half, half
    assert "1 - 0.0039" in narrow_eps("AcosBackward0", torch.bfloat16)
    assert narrow_eps("AtanhBackward0", torch.float32) == ""
    assert narrow_eps("SqrtBackward0", torch.float16) == ""

"""End to end on active learning (``active_learning_models``): MC-dropout BALD acquisition
over a pool, class-balanced cross-entropy on the growing labelled pool, Yoo & Kweon's
learning-loss module with a pairwise ranking loss, a core-set k-center regulariser over the
batch's pairwise distances, entropy minimisation on an unlabelled pool batch, and a deep
ensemble. Each planted bug of the domain fires under the recorder and is replayed with the
CLI; the healthy versions raise no event and train bit-identically with and without the
recorder."""

from __future__ import annotations

import contextlib

import active_learning_models as M
import pytest
import torch
import torch.nn.functional as F
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader, Subset, TensorDataset

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("active_learning_models.py", text)


def train(make: str, crit, out_dir, batches, record: bool = True, opt=None, steps: int = 12,
          two_calls: bool = False, autocast: bool = False):
    """Adam (or ``opt``) over ``batches`` (a callable giving one epoch's batches), as the
    active-learning repositories retrain each round; ``two_calls``: a labelled and a pool
    batch, the loss given both outputs; ``autocast``: the forward and loss under bfloat16
    autocast. Returns the model."""
    model = getattr(M, make)()
    optimizer = (opt or (lambda p: torch.optim.Adam(p, lr=1e-3)))(model.parameters())
    torch.manual_seed(1)  # (dropout)
    rec = FlightRecorder(model, optimizer, loss_fn=crit, out_dir=out_dir,
                         factory=f"active_learning_models:{make}") if record else None
    n = 0
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        while n < steps:
            for b in batches():
                amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
                with amp:
                    loss = step_loss(model, loss_fn, b, two_calls)
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
                optimizer.step()
                n += 1
                if n >= steps:
                    break
    return model


def step_loss(model, loss_fn, b, two_calls: bool):
    if two_calls:
        (x, y), (xu, _) = b
        return loss_fn(model(x), y, model(xu))
    return loss_fn(model(b[0]), b[1])


def fire(*args, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(*args, **kw)
    return info.value.event, info.value.bundle_path


def labelled_loader(ds, **split):
    lab, _ = M.initial_split(ds, **split)
    return lab, DataLoader(lab, batch_size=16, shuffle=False)


def test_a_corrupt_pool_record_acquired_names_the_input_and_its_row(tmp_path):
    """A pool record whose features are NaN (a failed read) is in the labelled set: an input
    event at its batch (place 37 of the labelled Subset: batch 2, row 5)."""
    ds = M.pool_dataset()
    lab, data = labelled_loader(ds)
    ds.tensors[0][lab.indices[37]] = float("nan")
    ev, bundle = fire("make_mc_net", torch.nn.CrossEntropyLoss(), tmp_path, lambda: data)
    assert (ev["step"], ev["phase"], ev["kind"]) == (2, "input", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["samples"]) == (True, "input", [5]), o
    assert rep["cause"] == "input" and "data pipeline" in rep["hint"], rep["hint"]


def test_class_weights_with_an_unlabelled_class_names_the_loss_weight(tmp_path):
    """Inverse class counts with class 3 not yet labelled: ``1 / 0`` is inf, normalising by
    the sum makes every weight 0 or NaN; ``nll_loss`` takes the NaN weight at the first step.
    The replay says the loss's weight was NaN at index 3 before the step, and to floor the
    counts."""
    ds = M.pool_dataset()
    lab, data = labelled_loader(ds, without=3)
    w = M.class_weights(torch.stack([lab[i][1] for i in range(len(lab))]))
    assert torch.isnan(w[3]) and not w[:3].any()
    ev, bundle = fire("make_mc_net", M.class_balanced_ce(w), tmp_path, lambda: data)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "loss", "<loss>", "nan")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"]) == ("<loss>", "aten.nll_loss_forward", "nan"), o
    assert rep["cause"] == "weights", rep["cause"]
    assert "'weight' holding nan at index 3" in rep["hint"] and "clamp_min(1)" in rep["hint"]


def soft_rank_pairs(at: int):
    """The step-``at`` pairs whose ``z`` overflows exp, computed without the recorder."""
    ds = M.pool_dataset()
    _, data = labelled_loader(ds)
    model = M.make_ll_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    crit = M.LearningLossObjective(M.SoftRankLoss(0.01))
    for step, (x, y) in enumerate(b for _ in range(at + 1) for b in data):
        logits, pred = model(x)
        if step == at:
            t = F.cross_entropy(logits, y, reduction="none")
            z = -torch.sign((t - t.flip(0))[:8]) * (pred - pred.flip(0))[:8] / 0.01
            rows = torch.isinf(torch.exp(z)).nonzero()[:, 0].tolist()
            return sorted(rows + [15 - r for r in rows])
        loss = crit((logits, pred), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        opt.step()


@pytest.mark.parametrize("log1p,line", [
    (True, "return torch.log1p(torch.exp(z)).mean()"),
    (False, "return torch.log(1 + torch.exp(z)).mean()")])
def test_learning_loss_soft_ranking_overflow_names_the_exp_its_pairs_and_softplus(
        tmp_path, log1p, line):
    """The learning-loss module's ranking loss written as ``log1p(exp(z / tau))`` with
    ``tau = 0.01`` (or ``log(1 + exp(...))``): a predicted-loss gap above 0.88 overflows exp at
    step 4. The replay names
    the exp on the ranking line, both samples of each overflowing pair (row ``r`` of
    ``pred - pred.flip(0)`` is samples ``r`` and ``B - 1 - r``), overflow, and softplus."""
    rank = M.SoftRankLoss(0.01, log1p=log1p)
    ev, bundle = fire("make_ll_net", M.LearningLossObjective(rank), tmp_path,
                      lambda: labelled_loader(M.pool_dataset())[1],
                      opt=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (4, "loss", "<loss>", "+inf")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"]) == ("<loss>", "aten.exp", "+inf"), o
    assert o["source"] == line_of(line), o
    pairs = soft_rank_pairs(ev["step"])
    assert pairs and o["samples"] == pairs, (o["samples"], pairs)
    assert rep["cause"] == "overflow", rep["cause"]
    assert "a softplus written by hand" in rep["hint"] and "F.softplus" in rep["hint"], \
        rep["hint"]


def test_entropy_minimisation_on_the_pool_names_the_log_of_the_underflowed_softmax(tmp_path):
    """Entropy minimisation on an unlabelled pool batch written ``p * log(p)``: a pool record
    never standardised (x 1000, place 20 of the pool: its batch 1, row 4) saturates the
    softmax, ``p`` underflows to 0 and ``log`` gives -inf (0 * -inf is NaN). The pool batch is
    the step's second model call (micro-batch 1); the replay names the log, row 4, underflow
    and the out-of-scale record."""
    ds = M.pool_dataset()
    lab, pool = M.initial_split(ds)
    ds.tensors[0][pool.indices[20]] *= 1000
    labelled = DataLoader(lab, batch_size=16, shuffle=False)
    unlabelled = DataLoader(pool, batch_size=16, shuffle=False)
    ev, bundle = fire("make_mc_net", M.SemiSupervisedLoss(), tmp_path,
                      lambda: zip(labelled, unlabelled), two_calls=True)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (1, "loss", "<loss>", "nan")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], o["micro_batch"]) == (
        "<loss>", "aten.log", "-inf", [4], 1), o
    assert o["source"] == line_of("return -(p * torch.log(p)).sum(1).mean()"), o
    assert rep["cause"] == "underflow", rep["cause"]
    assert "out of scale" in rep["hint"], rep["hint"]


def test_k_center_distance_without_eps_names_the_sqrt_backward_on_the_diagonal(tmp_path):
    """The core-set regulariser's pairwise distances as ``sqrt(clamp_min(sq, 0))``: the
    diagonal is 0 (or rounds below it) and, although ``masked_fill`` drops it before the min,
    sqrt's derivative there is inf times a 0 gradient: NaN in backward at the first step, the
    forward finite. The replay names SqrtBackward0 on the distance line, the rows whose
    diagonal is exactly 0, invalid, and the eps of 0."""
    ds = M.pool_dataset()
    _, data = labelled_loader(ds)
    ev, bundle = fire("make_coreset_net", M.KCenterRegularizer(), tmp_path, lambda: data)
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "backward", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"]) == ("backward", "<loss>", "SqrtBackward0"), o
    assert o["source"] == line_of("return torch.sqrt(sq.clamp_min(0) + eps)"), o
    torch.manual_seed(0)
    f = M.make_coreset_net().embed(next(iter(data))[0])
    sq = (f * f).sum(1, keepdim=True) + (f * f).sum(1) - 2 * f @ f.T
    assert o["samples"] == (sq.diagonal() <= 0).nonzero()[:, 0].tolist(), o
    assert rep["cause"] == "invalid" and "exactly 0" in rep["hint"], rep["hint"]


def test_bf16_k_center_distance_without_the_clamp_names_the_rounding_not_the_domain(tmp_path):
    """The same distances with ``eps = 1e-8`` (the fix for the gradient at 0) but no
    ``clamp_min(0)``, under bfloat16 autocast: ``|f|^2 + |f|^2 - 2 f.f`` cancels below 0 on
    the diagonal in bfloat16, sqrt makes NaN there, ``masked_fill`` drops it and sqrt's
    backward takes it. In float64 the diagonal is 0 + eps: the replay says precision (not an
    op outside its domain in exact arithmetic), names the rows whose diagonal went negative,
    and says to clamp or use cdist."""
    ds = M.pool_dataset()
    _, data = labelled_loader(ds)
    with pytest.raises(NonFiniteError) as info:
        train("make_coreset_net", M.KCenterRegularizer(eps=1e-8, clamp=False), tmp_path,
              lambda: data, autocast=True)
    ev, bundle = info.value.event, info.value.bundle_path
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "backward", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"]) == ("backward", "<loss>", "SqrtBackward0"), o
    assert o["source"] == line_of("return torch.sqrt(sq + eps)"), o
    with torch.autocast("cpu", dtype=torch.bfloat16):
        f = M.make_coreset_net().embed(next(iter(data))[0])
        sq = (f * f).sum(1, keepdim=True) + (f * f).sum(1) - 2 * f @ f.T
    assert o["samples"] == (sq.diagonal() + 1e-8 < 0).nonzero()[:, 0].tolist(), o
    assert rep["cause"] == "precision", rep["cause"]
    assert "clamp_min(0)" in rep["hint"] and "cdist" in rep["hint"], rep["hint"]


def test_an_oracle_label_typo_in_an_ensemble_names_its_sample_not_the_members(tmp_path):
    """A regression ensemble (members first: ``(M, B)`` means and log-variances) trained on
    the oracle's labels, one of which was typed in the wrong unit (3.2e21, place 21 of the
    labelled Subset: batch 1, row 5). ``(y - mu) ** 2`` overflows at step 1. With 16 records
    of 16 features the recorder read the batch size off the members (3) and the replay named
    "all 3 rows"; now it names sample 5, and the target's out-of-scale value."""
    ds = M.pool_dataset()
    y = M.oracle_targets(ds)
    lab, _ = M.initial_split(ds)
    y[lab.indices[21]] = 3.2e21
    data = DataLoader(Subset(TensorDataset(ds.tensors[0], y), lab.indices), batch_size=16)
    ev, bundle = fire("make_regression_ensemble", M.gaussian_nll, tmp_path, lambda: data)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (1, "loss", "<loss>", "+inf")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], o["batch_size"]) == (
        "<loss>", "aten.pow", "+inf", [5], 16), o
    assert o["source"] == line_of("return (0.5 * (logvar + (y - mu) ** 2 / logvar.exp()))"), o
    assert rep["cause"] == "overflow", rep["cause"]
    assert "sample(s) 5 of loss_args[1]" in rep["hint"] and "out of scale" in rep["hint"]


def test_weight_imprinting_of_an_unlabelled_class_names_the_head_row_written_between_steps(
        tmp_path):
    """Between rounds the head is imprinted with each class's mean normalised feature; class
    3 has no labelled record yet, its mean is over nothing (NaN). The next step's check of the
    weights fires (step 4, after a round of 4 batches); the replay says weights, names
    head.weight, row 3 only, written by the loop outside the optimizer's update, and the
    empty group's mean (clamp the count, keep the old row)."""
    ds = M.pool_dataset()
    lab, data = labelled_loader(ds, without=3)
    x = torch.stack([lab[i][0] for i in range(len(lab))])
    y = torch.stack([lab[i][1] for i in range(len(lab))])
    model = M.make_mc_net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = torch.nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="active_learning_models:make_mc_net") as rec:
            for _ in range(2):
                for xb, yb in data:
                    loss = rec.loss_fn(model(xb), yb)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                M.imprint_head(model, x, y)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["params"]) == (4, "weights", ["head.weight"]), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"]) == ("weights", "head", "aten.addmm"), o
    assert rep["cause"] == "weights", rep["cause"]
    assert "only row(s) 3 of 4 of head.weight" in rep["hint"], rep["hint"]
    assert "the loop wrote it between that update and step 4" in rep["hint"], rep["hint"]
    assert "clamp the count to at least 1" in rep["hint"], rep["hint"]


HEALTHY = [  # (factory, loss from the class weights, two model calls, bfloat16 autocast)
    ("make_mc_net", lambda w: M.class_balanced_ce(w), False, False),
    ("make_ll_net", lambda w: M.LearningLossObjective(M.LossPredLoss()), False, False),
    ("make_ll_net", lambda w: M.LearningLossObjective(M.SoftRankLoss(0.01, stable=True)),
     False, False),
    ("make_coreset_net", lambda w: M.KCenterRegularizer(eps=1e-8), False, False),
    ("make_coreset_net", lambda w: M.KCenterRegularizer(eps=1e-8), False, True),
    ("make_mc_net", lambda w: M.SemiSupervisedLoss(eps=1e-8), True, False),
    ("make_ensemble", lambda w: M.ensemble_nll, False, False),
]


@pytest.mark.parametrize("make,crit,two_calls,amp", HEALTHY)
def test_healthy_rounds_raise_nothing_and_train_the_same(tmp_path, make, crit, two_calls, amp):
    """Two acquisition rounds: train, score the pool by BALD (and a BatchBALD joint entropy,
    a core-set pick), move the top 16 into the labelled Subset, retrain with floored class
    weights (the core-set regulariser also under bfloat16 autocast); no event and
    bit-identical weights with and without the recorder."""
    results = []
    for record in (True, False):
        ds = M.pool_dataset()
        ds.tensors[0][M.initial_split(ds)[1].indices[20]] *= 1000  # (the eps handles it)
        lab, pool = M.initial_split(ds, without=3)
        for _ in range(2):
            labels = torch.stack([lab[i][1] for i in range(len(lab))])
            w = M.class_weights(labels, floor=1.0)
            labelled = DataLoader(lab, batch_size=16, shuffle=False)
            unlabelled = DataLoader(pool, batch_size=16, shuffle=False)
            batches = (lambda a=labelled, b=unlabelled: zip(a, b)) if two_calls \
                else (lambda a=labelled: a)
            model = train(make, crit(w), tmp_path, batches, record=record, steps=6,
                          two_calls=two_calls, autocast=amp)
            if make == "make_mc_net":
                picked = M.acquire(model, pool)
                probs = M.mc_probs(model, torch.stack([pool[i][0] for i in range(4)]))
                assert torch.isfinite(M.batchbald_joint_entropy(probs, 0, 1))
            else:
                feats = torch.stack([ds[i][0] for i in range(len(ds))])
                picked = [i for i in M.coreset_greedy(feats, lab.indices, 16)
                          if i not in lab.indices]
            lab = Subset(ds, lab.indices + picked)
            pool = Subset(ds, [i for i in pool.indices if i not in picked])
        results.append(model)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(results[0].named_parameters(), results[1].parameters()):
        assert torch.equal(a, b), name

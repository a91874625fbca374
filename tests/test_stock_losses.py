"""torch.nn's stock loss modules given as ``loss_fn=``, in real small training loops (a
DataLoader over synthetic data, SGD; models in ``stock_losses_models``).

Each loss trains once healthy (no event, and the losses bit-identical to the same loop without
the recorder), and where it can make a non-finite value from finite inputs, or where bad
targets reach it, the bug is planted at step K: the event, then ``nanreplay --json``: the loss
rebuilt with its constructor's arguments and tensors, the origin op (checked first with a
TorchDispatchMode over plain PyTorch, :func:`first_bad_op`), the cause, the samples, the hint.
"""

from __future__ import annotations

import math

import pytest
import stock_losses_models as M
import torch
from bundles import nanreplay_json, replay_report, source_line
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle
from replay.losses import rebuild_loss

pytestmark = pytest.mark.usefixtures("in_tests_dir")

B, STEPS, K = 8, 5, 3  # batch, steps, the step a planted bug fires at
N = B * STEPS
CPU = torch.device("cpu")


# ---------------------------------------------------------------------------------------------
# the loop, the data, plain PyTorch's first non-finite op


def train(factory: str, crit, data, step_loss=None, out_dir=None) -> list[torch.Tensor]:
    """``STEPS`` SGD steps of ``stock_losses_models.<factory>()`` over ``data`` in batches of
    ``B``; ``step_loss(out, *rest)`` (default ``crit(out, *rest)``). With ``out_dir``, under a
    FlightRecorder given ``crit`` as ``loss_fn``. The losses, as computed."""
    torch.manual_seed(0)
    model = getattr(M, factory)()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step_loss = step_loss or crit
    losses: list[torch.Tensor] = []

    def loop():
        for x, *rest in DataLoader(TensorDataset(*data), batch_size=B):
            opt.zero_grad()
            loss = step_loss(model(x), *rest)
            loss.backward()
            opt.step()
            losses.append(loss.detach().clone())

    if out_dir is None:
        loop()
    else:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory=f"stock_losses_models:{factory}"):
            loop()
    return losses


def planted(out_dir, factory, crit, data, step_loss=None, step=K) -> NonFiniteError:
    with pytest.raises(NonFiniteError) as info:
        train(factory, crit, data, step_loss, out_dir)
    err = info.value
    assert err.bundle_path is not None and err.event["step"] == step, err.event
    return err


def gen(seed: int = 1) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def feats(g, *shape) -> torch.Tensor:
    return torch.randn(N, *shape, M.F_IN, generator=g)


def row(i: int) -> int:
    """Sample ``i`` of step K's batch, as an index into the data set."""
    return K * B + i


class FirstBad(TorchDispatchMode):
    """The aten ops that made a non-finite float, in order, with their (finite?) inputs."""

    def __init__(self):
        super().__init__()
        self.hits: list[tuple[str, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        bad = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)
               and t.is_floating_point() and not bool(torch.isfinite(t).all())]
        if bad:
            ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
                   and t.is_floating_point()]
            self.hits.append((func.overloadpacket.__name__,
                              all(bool(torch.isfinite(t).all()) for t in ins)))
        return out


def first_bad_op(factory, crit, data, step_loss=None, backward=False):
    """Plain PyTorch, no recorder: K steps of the loop, then step K's loss (or its backward)
    under :class:`FirstBad`. The first op making a non-finite value from finite inputs,
    its name without ``aten.``; the whole list of hits."""
    torch.manual_seed(0)
    model = getattr(M, factory)()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step_loss = step_loss or crit
    for i, (x, *rest) in enumerate(DataLoader(TensorDataset(*data), batch_size=B)):
        opt.zero_grad()
        mode = FirstBad()
        with mode if i == K and not backward else _nothing():
            loss = step_loss(model(x), *rest)
        with mode if i == K and backward else _nothing():
            if i < K or backward:  # (backward=True: the backward's ops alone)
                loss.backward()
        if i == K:
            first = next((op for op, finite_in in mode.hits if finite_in), None)
            return first, mode.hits
        opt.step()
    raise AssertionError("the loop ended before step K")


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def rebuilt(err: NonFiniteError) -> nn.Module:
    """The loss as the replay rebuilds it from the bundle."""
    meta, tensors = read_bundle(err.bundle_path)
    return rebuild_loss(meta["loss"], tensors, CPU)


def origin(rep, *keys):
    return tuple(rep["origin"][k] for k in keys)


def triplets(crit):
    return lambda e: crit(e[:, 0], e[:, 1], e[:, 2])


def mined(crit):
    return lambda e, labels: crit(*M.batch_hard(e, labels))


def pair_labels() -> torch.Tensor:
    """Labels in pairs (0, 0, 1, 1, 2, 2, 3, 3 per batch): every sample has a positive."""
    return torch.arange(N) // 2 % 4


def signs(g, *shape) -> torch.Tensor:
    return (torch.rand(N, *shape, generator=g) < 0.5).float() * 2 - 1


def classes(g) -> torch.Tensor:
    return torch.randint(0, M.C, (N,), generator=g)


def healthy_cases():
    """name -> (factory, loss, data, step_loss): each stock loss on ordinary data."""
    g = gen()
    cases = {}
    crit = nn.TripletMarginLoss(margin=0.5, p=2, swap=True)
    cases["triplet"] = ("make_embedder", crit, (feats(g, 3),), triplets(crit))
    crit = nn.TripletMarginWithDistanceLoss(
        distance_function=lambda a, b: ((a - b) ** 2).sum(-1).sqrt(), margin=0.5)
    cases["triplet_lambda"] = ("make_embedder", crit, (feats(g), pair_labels()), mined(crit))
    crit = nn.TripletMarginWithDistanceLoss(distance_function=M.euclidean, margin=0.5,
                                            swap=True)
    cases["triplet_function"] = ("make_embedder", crit, (feats(g), pair_labels()), mined(crit))
    crit = nn.CosineEmbeddingLoss(margin=0.2)
    cases["cosine"] = ("make_embedder", crit, (feats(g, 2), signs(g)),
                       lambda e, y, crit=crit: crit(e[:, 0], e[:, 1], y))
    crit = nn.MarginRankingLoss(margin=0.1)
    cases["ranking"] = ("make_scorer", crit, (feats(g, 2), signs(g)),
                        lambda s, y, crit=crit: crit(s[:, 0], s[:, 1], y))
    cases["huber"] = ("make_regressor", nn.HuberLoss(delta=0.5), (feats(g), 3 * torch.randn(
        N, 2, generator=g)), None)
    cases["smooth_l1"] = ("make_regressor", nn.SmoothL1Loss(beta=0.0),
                          (feats(g), torch.randn(N, 2, generator=g)), None)
    labels = (torch.rand(N, M.C, generator=g) < 0.4).float()
    cases["multilabel"] = ("make_classifier", nn.MultiLabelSoftMarginLoss(
        weight=torch.tensor([1.0, 0.0, 2.0])), (feats(g), labels), None)
    cases["multimargin"] = ("make_classifier", nn.MultiMarginLoss(
        p=2, margin=0.7, weight=torch.tensor([0.5, 1.0, 2.0])), (feats(g), classes(g)), None)
    cases["soft_margin"] = ("make_scorer", nn.SoftMarginLoss(), (feats(g, 2), signs(g, 2)), None)
    cases["hinge"] = ("make_scorer", nn.HingeEmbeddingLoss(margin=0.5),
                      (feats(g, 2), signs(g, 2)), None)
    pos = labels.sum(0)
    cases["bce_pos_weight"] = ("make_classifier", nn.BCEWithLogitsLoss(
        pos_weight=(N - pos) / pos), (feats(g), labels), None)
    teacher = torch.log_softmax(2 * torch.randn(N, M.C, generator=g), -1)
    cases["kl"] = ("make_log_classifier", nn.KLDivLoss(reduction="batchmean", log_target=True),
                   (feats(g), teacher), None)
    counts = torch.poisson(torch.full((N, 2), 3.0), generator=g)  # (0s and 1s among them)
    cases["poisson"] = ("make_poisson", nn.PoissonNLLLoss(log_input=False, full=True),
                        (feats(g), counts), None)
    crit = nn.GaussianNLLLoss(full=True, eps=1e-4)
    cases["gaussian"] = ("make_gaussian", crit, (feats(g), torch.randn(N, 2, generator=g)),
                         lambda out, y, crit=crit: crit(out[0], y, out[1]))
    y = classes(g)
    y[::3] = 1  # some targets ignored in every batch, never all
    cases["nll"] = ("make_log_classifier", nn.NLLLoss(weight=torch.tensor([1.0, 2.0, 0.5]),
                                                      ignore_index=1), (feats(g), y), None)
    return cases


HEALTHY = healthy_cases()


@pytest.mark.parametrize("name", list(HEALTHY))
def test_healthy_run_no_event_and_identical_losses(name, out_dir):
    factory, crit, data, step_loss = HEALTHY[name]
    plain = train(factory, crit, data, step_loss)
    recorded = train(factory, crit, data, step_loss, out_dir)
    assert len(plain) == len(recorded) == STEPS
    assert all(math.isfinite(v.item()) for v in plain)
    assert all(torch.equal(a, b) for a, b in zip(plain, recorded)), (plain, recorded)
    assert not out_dir.exists() or not any(out_dir.iterdir())


# ---------------------------------------------------------------------------------------------
# planted bugs


def nll_case(weight, ignore_index=-100, bad_class=1):
    g = gen()
    y = classes(g)
    y[row(0):row(B)] = bad_class  # step K's batch: every target of one class
    crit = nn.NLLLoss(weight=weight, ignore_index=ignore_index)
    return "make_log_classifier", crit, (feats(g), y), None


@pytest.mark.parametrize("how", ["all_ignored", "zero_weight_class"])
def test_nll_loss_with_no_target_weight_in_a_batch(how, out_dir):
    """Every target of step K's batch is ignore_index (1), or of class 1 whose weight is 0:
    the mean's total target weight is 0, and nll_loss_forward's own division is 0/0."""
    weight = torch.tensor([1.0, 2.0, 0.5]) if how == "all_ignored" else \
        torch.tensor([1.0, 0.0, 0.5])
    case = nll_case(weight, ignore_index=1 if how == "all_ignored" else -100)
    assert first_bad_op(*case)[0] == "nll_loss_forward"
    err = planted(out_dir, *case)
    assert (err.event["phase"], err.event["module"]) == ("loss", "<loss>")
    crit = rebuilt(err)
    assert type(crit) is nn.NLLLoss and torch.equal(crit.weight, weight)
    assert crit.ignore_index == (1 if how == "all_ignored" else -100)
    rep = nanreplay_json(err.bundle_path)
    assert origin(rep, "phase", "module", "op", "made", "all_samples") == (
        "loss", "<loss>", "aten.nll_loss_forward", "nan", True)  # (every row: no target)
    assert (rep["reproduced"], rep["cause"]) == (True, "invalid")
    hint = rep["hint"]
    assert "total target weight of 0 (0/0)" in hint
    if how == "all_ignored":
        assert "every target of the batch is ignore_index (1)" in hint
    else:
        assert "all of class 1, whose weight is 0" in hint
    assert "reduction='sum'" in hint


def test_triplet_margin_loss_norm_overflows_on_an_out_of_scale_sample(out_dir):
    """Sample 2's features are 1e20 times too large (ReLU keeps the scale): its embeddings'
    squares pass float32's range inside the 2-norm of pairwise_distance."""
    g = gen()
    x = feats(g, 3)
    x[row(2)] *= 1e20
    crit = nn.TripletMarginLoss(margin=0.5, p=2, swap=True)
    case = ("make_embedder", crit, (x,), triplets(crit))
    assert first_bad_op(*case)[0] == "norm"
    err = planted(out_dir, *case)
    assert err.event["phase"] == "loss"
    got = rebuilt(err)
    assert (type(got), got.margin, got.p, got.swap, got.eps) == (
        nn.TripletMarginLoss, 0.5, 2, True, 1e-6)
    rep = nanreplay_json(err.bundle_path)
    assert origin(rep, "phase", "module", "op", "made", "samples") == (
        "loss", "<loss>", "aten.norm", "+inf", [2])
    assert (rep["reproduced"], rep["cause"]) == (True, "overflow")
    assert "--try drop=2" in rep["hint"]


def mined_case(distance):
    """Batch-hard mining over labels in pairs, but in step K's batch sample 7's label is
    alone (and sample 6 joins sample 4's pair): sample 7 is its own farthest positive, so
    the anchor-positive difference is exactly 0, where sqrt's derivative is infinite."""
    g = gen()
    labels = pair_labels()
    labels[row(7)], labels[row(6)] = 9, labels[row(4)]
    crit = nn.TripletMarginWithDistanceLoss(distance_function=distance, margin=0.5, swap=True)
    return "make_embedder", crit, (feats(g), labels), mined(crit)


def test_triplet_with_a_lambda_distance_is_said_not_rebuilt(out_dir):
    """A lambda distance_function cannot be imported: the replay says so, where the lambda
    is, and how to make it replayable, instead of re-running a default distance. The loss
    was never re-run, so the event is reported not re-run (exit 1), not reproduced: what the
    bundle holds stays (the step, the recorded gradient entering the model's output, non-finite
    in sample 7's row: the sample alone in its label class, its own positive)."""
    case = mined_case(lambda a, b: ((a - b) ** 2).sum(-1).sqrt())
    err = planted(out_dir, *case)
    assert err.event["phase"] == "backward"
    rep, code = replay_report(err.bundle_path)
    assert code == 1
    assert rep["reproduced"] is False
    assert "loss cannot be rebuilt" in rep["not_rerun"]
    assert (rep["event"]["step"], rep["event"]["phase"]) == (K, "backward")
    assert origin(rep, "phase", "module", "samples") == ("loss", "<loss>", [7])
    assert rep["cause"] is None and rep["origin"]["op"] is None
    note, = [p for p in rep["problems"] if "distance_function" in p]
    line = source_line("test_stock_losses.py", "case = mined_case(lambda a, b:")
    assert f"distance_function (a lambda at {line})" in note
    assert "so it was not rebuilt" in note
    assert "define that function at module level" in note


def test_soft_margin_loss_exp_overflow_is_an_overflow(out_dir):
    """Sample 4's features are 1e4 times too large: its score has the wrong sign by far more
    than 88.7, and soft_margin_loss's exp(-y * x) (taken as is, no softplus) overflows."""
    g = gen(2)
    x, y = feats(g, 2), signs(g, 2)
    x[row(4)] *= 1e4
    case = ("make_scorer", nn.SoftMarginLoss(), (x, y), None)
    assert first_bad_op(*case)[0] == "soft_margin_loss"
    err = planted(out_dir, *case)
    assert err.event["phase"] == "loss"
    assert type(rebuilt(err)) is nn.SoftMarginLoss
    rep = nanreplay_json(err.bundle_path)
    assert origin(rep, "phase", "module", "op", "made", "samples") == (
        "loss", "<loss>", "aten.soft_margin_loss", "+inf", [4])
    assert (rep["reproduced"], rep["cause"]) == (True, "overflow")
    assert "F.softplus(-y * x).mean()" in rep["hint"] and "--try drop=4" in rep["hint"]
    assert "outside its domain" not in rep["hint"]


def test_kl_div_log_target_minus_inf_is_an_input(out_dir):
    """A teacher's probability of exactly 0 (sample 6), logged for log_target=True: -inf in
    the target, and exp(-inf) * (-inf - input) is 0 * -inf inside kl_div."""
    g = gen()
    probs = torch.softmax(3 * torch.randn(N, M.C, generator=g), -1)
    probs[row(6)] = torch.tensor([1.0, 0.0, 0.0])
    crit = nn.KLDivLoss(reduction="batchmean", log_target=True)
    case = ("make_log_classifier", crit, (feats(g), probs), lambda out, p: crit(out, p.log()))
    _, hits = first_bad_op(*case)
    # the loop's log(0), then kl_div's ops on the -inf: target - input, then 0 * -inf: NaN
    assert [op for op, _ in hits[:3]] == ["log", "sub", "mul"] and not hits[2][1]
    err = planted(out_dir, *case)
    assert err.event["phase"] == "input"  # (the loss's target held the -inf)
    got = rebuilt(err)
    assert (got.reduction, got.log_target) == ("batchmean", True)
    rep = nanreplay_json(err.bundle_path)
    assert origin(rep, "phase", "made", "samples") == ("input", "-inf", [6])
    assert (rep["reproduced"], rep["cause"]) == (True, "input")
    assert "log_target=False" in rep["hint"] and "aten.mul computed 0 * inf" in rep["hint"]


def test_bce_with_logits_pos_weight_of_an_absent_class(out_dir):
    """pos_weight = negatives / positives over the data set, with class 2 never positive:
    1/0 = inf before the first step; with a target of 0 the kernel's 1 + (inf - 1) * 0 is
    NaN for every sample. (Its exp never overflows: the kernel is the stable log-sum-exp
    form; only pos_weight * |x| past float32's range would.)"""
    g = gen()
    labels = (torch.rand(N, M.C, generator=g) < 0.4).float()
    labels[:, 2] = 0
    pos_weight = (N - labels.sum(0)) / labels.sum(0)
    assert pos_weight[2].item() == math.inf
    case = ("make_classifier", nn.BCEWithLogitsLoss(pos_weight=pos_weight), (feats(g), labels),
            None)
    err = planted(out_dir, *case, step=0)
    assert err.event["phase"] == "loss"
    assert torch.equal(rebuilt(err).pos_weight, pos_weight)
    rep = nanreplay_json(err.bundle_path)
    assert origin(rep, "phase", "op", "made", "samples") == (
        "loss", "aten.binary_cross_entropy_with_logits", "nan", list(range(B)))
    assert (rep["reproduced"], rep["cause"]) == (True, "weights")
    assert "'pos_weight' holding inf at index 2" in rep["hint"]
    assert "count.clamp_min(1)" in rep["hint"]


def test_bce_with_logits_stable_for_large_logits():
    """The plain-PyTorch fact the test above relies on: logits of ±100 with pos_weight 3
    give a finite loss (no exp overflow), and only pos_weight * |x| beyond float32 is inf."""
    y = torch.tensor([[1.0, 0.0]])
    crit = nn.BCEWithLogitsLoss(pos_weight=torch.tensor([3.0, 3.0]))
    assert math.isfinite(crit(torch.tensor([[-100.0, 100.0]]), y).item())
    crit = nn.BCEWithLogitsLoss(pos_weight=torch.tensor([1e37, 1.0]))
    assert crit(torch.tensor([[-100.0, 0.0]]), y).item() == math.inf


def test_poisson_nll_of_a_negative_rate(out_dir):
    """PoissonNLLLoss(log_input=False) takes the rate as is, and the model's rate has no
    softplus: sample 1's far input (x100) makes it negative, and log(rate + eps) is NaN. Its
    count is 0 there (a count of 0 is data, not a bound: the log never takes the target),
    and the counts are at least 1 elsewhere. (A rate of exactly 0 is no bug: eps keeps
    log(0 + 1e-8) finite, and full=True's Stirling term is masked below a count of 2.)"""
    g = gen()
    x = feats(g)
    counts = torch.poisson(torch.full((N, 2), 3.0), generator=g).clamp_min(1)
    x[row(1)] *= 100
    counts[row(1), 0] = 0
    crit = nn.PoissonNLLLoss(log_input=False, full=True)
    case = ("make_poisson", crit, (x, counts), None)
    assert first_bad_op(*case)[0] == "log"
    err = planted(out_dir, *case)
    assert err.event["phase"] == "loss"
    got = rebuilt(err)
    assert (got.log_input, got.full, got.eps) == (False, True, 1e-8)
    rep = nanreplay_json(err.bundle_path)
    assert origin(rep, "phase", "module", "op", "made", "samples") == (
        "loss", "<loss>", "aten.log", "nan", [1])
    assert (rep["reproduced"], rep["cause"]) == (True, "invalid")
    hint = rep["hint"]
    assert "The negative values are the model's output, which module lin returned" in hint
    assert "--try drop=1" in hint
    assert "no feasible point" not in hint and "repair the bound" not in hint


def test_gaussian_nll_of_a_relu_variance_with_eps_0(out_dir):
    """GaussianNLLLoss(full=True, eps=0): the clamp of the variance guards nothing, and
    sample 3's ReLU variance head is 0 (its features sum below -20): log(0) is -inf first,
    then (x - y)**2 / 0 and their sum."""
    g = gen()
    x, y = feats(g), torch.randn(N, 2, generator=g)
    x[row(3)] = -10.0
    crit = nn.GaussianNLLLoss(full=True, eps=0.0)
    case = ("make_gaussian", crit, (x, y), lambda out, y: crit(out[0], y, out[1]))
    first, hits = first_bad_op(*case)
    assert first == "log" and [op for op, _ in hits[:3]] == ["log", "div", "add"]
    err = planted(out_dir, *case)
    assert err.event["phase"] == "loss"
    got = rebuilt(err)
    assert (got.full, got.eps) == (True, 0.0)
    rep = nanreplay_json(err.bundle_path)
    assert origin(rep, "phase", "module", "op", "made", "samples") == (
        "loss", "<loss>", "aten.log", "-inf", [3])
    assert (rep["reproduced"], rep["cause"]) == (True, "invalid")
    hint = rep["hint"]
    assert "an eps option set to 0" in hint
    assert "The 0s are the model's output[1]" in hint and "made by aten.relu" in hint
    assert "spread" not in hint and "pearson" not in hint


def test_triplet_with_a_module_level_distance_is_rebuilt(out_dir):
    """The same mining bug with ``stock_losses_models.euclidean``: the loss is rebuilt with
    that function, and its backward's first non-finite value is SqrtBackward0's at 0."""
    case = mined_case(M.euclidean)
    _, hits = first_bad_op(*case, backward=True)
    assert hits[0] == ("div", True)  # SqrtBackward0's grad / (2 * sqrt(0))
    err = planted(out_dir, *case)
    assert err.event["phase"] == "backward"
    got = rebuilt(err)
    assert (got.distance_function, got.margin, got.swap) == (M.euclidean, 0.5, True)
    rep = nanreplay_json(err.bundle_path)
    assert origin(rep, "phase", "module", "op", "made", "samples") == (
        "backward", "<loss>", "SqrtBackward0", "+inf", [7])
    assert rep["origin"]["source"] == source_line("stock_losses_models.py", "# BUG euclid")
    assert rep["reproduced"] is True
    # the positive is the anchor itself: 0 exactly, in float64 as well
    assert rep["cause"] == "invalid", (rep["cause"], rep["hint"])
    # (the remedy of a root of a sum of squares at 0: an eps under the root, or vector_norm)
    hint = rep["hint"]
    assert "sqrt of a sum of squares" in hint, hint
    assert "sqrt(x + eps)" in hint or "torch.sqrt(x + 1e-8)" in hint, hint

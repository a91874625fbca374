"""End to end: differentiable dynamic programming and sorting (``differentiable_dp_models``):
a tree CRF's inside algorithm over partial brackets, Gumbel-Sinkhorn sorting in probability
space, L2X's relaxed top-k, NeuralSort with an annealed temperature; each trained under the
recorder until its planted bug fires, then replayed with the CLI as a user runs it."""

from __future__ import annotations

import differentiable_dp_models as M
import pytest
import torch
import torch.nn.functional as F
from bundles import line_number, nanreplay_json

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> int:
    return line_number("differentiable_dp_models.py", text)


def train(out_dir, factory: str, loss_fn, batches, opt=torch.optim.Adam, lr: float = 1e-2,
          anneal=None, decay: float = 0.9) -> NonFiniteError | None:
    """``factory``'s model trained on ``batches`` (forward arguments, loss arguments) under
    the recorder, with a StepLR schedule (``decay`` every 2 steps); ``anneal(model, step)``
    sets the temperature."""
    model = getattr(M, factory)()
    optimizer = opt(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=decay)
    try:
        with FlightRecorder(model, optimizer, loss_fn=loss_fn, out_dir=out_dir,
                            factory=f"differentiable_dp_models:{factory}") as rec:
            for step, (args, loss_args) in enumerate(batches):
                if anneal is not None:
                    anneal(model, step)
                optimizer.zero_grad()
                loss = rec.loss_fn(model(*args), *loss_args)
                loss.backward()
                optimizer.step()
                sched.step()
    except NonFiniteError as e:
        assert e.bundle_path is not None, e.write_error
        return e
    return None


# -- tree CRF ---------------------------------------------------------------------------------

NESTED = [[(0, 2)], [(1, 4), (2, 4)], [(3, 5)]]  # sentence 1 (4 words) annotated deeper


def parse_batches(nested_at: int | None, steps: int = 5):
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        words, lengths, cross = M.parse_batch(
            g, NESTED if step == nested_at else [[(0, 2)], [(1, 3)], [(2, 4)]])
        yield (words,), (lengths, cross)


def test_inside_chart_cell_no_split_can_build_is_logsumexps_all_minus_inf(tmp_path):
    """Brackets (1, 4) and (2, 4) of sentence 1 forbid spans (0, 2) and (1, 3), so span (0, 3)
    has no allowed split: its logsumexp is over -inf only, finite forward (-inf goes nowhere
    the root needs), NaN backward (exp(-inf - -inf) times a gradient of 0)."""
    err = train(tmp_path, "make_parser", M.PartialBracketLoss(), parse_batches(3), lr=2e-3)
    assert err is not None and (err.event["step"], err.event["phase"]) == (3, "backward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "invalid", "<loss>", "LogsumexpBackward0", "nan", [1]), rep
    assert o["source"] == f"differentiable_dp_models.py:{line_of('lse = torch.logsumexp(splits, -1)')}"
    assert "-inf in every position of a slice" in rep["hint"], rep["hint"]
    assert "large finite negative" in rep["hint"], rep["hint"]


def test_inside_with_dead_cells_kept_out_of_the_logsumexp_raises_nothing(tmp_path):
    assert train(tmp_path, "make_parser", M.PartialBracketLoss(safe=True), parse_batches(3),
                 lr=2e-3) is None


# -- L2X's relaxed top-k ----------------------------------------------------------------------

def l2x_batches(steps: int = 4):
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(16, M.FEATURES, generator=g)
        gumbel = -torch.log(-torch.log(torch.rand(16, M.FEATURES, generator=g)))
        yield (x, gumbel), ((x[:, 0] + x[:, 1] > 0).long(),)


def saturated_rows() -> list[int]:
    """The rows whose softmax the first step rounds to exactly 1 before its last draw."""
    model = M.make_l2x()
    (x, gumbel), _ = next(l2x_batches())
    w, onehot, rows = model.selector(x) + gumbel, torch.zeros(16, M.FEATURES), set()
    for _ in range(M.TOP_K - 1):
        w = w + torch.log(1.0 - onehot)
        onehot = F.softmax(w / model.tau, dim=-1)
        rows |= set((onehot == 1.0).any(-1).nonzero().flatten().tolist())
    return sorted(rows)


def test_relaxed_topk_log_of_one_minus_a_rounded_softmax_is_precision(tmp_path):
    """Without the reference code's clamp, log(1 - onehot) is log(0) once the softmax at
    t = 0.1 rounds a clear winner to 1.0 (float64 too). The forward stays finite (the next
    softmax gives that -inf 0), LogBackward0's gradient 0 / 0 is NaN. The report said
    'invalid ... in float64 too ... torch.where(mask, x, 1)'; a softmax over two or more finite
    entries is below 1 in exact arithmetic, so rounding made that 0: ``precision``, with the
    softmax's stable complement and the clamp."""
    rows = saturated_rows()
    assert rows and len(rows) < 16, rows
    err = train(tmp_path, "make_l2x", F.cross_entropy, l2x_batches())
    assert err is not None and (err.event["step"], err.event["phase"]) == (0, "backward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["made"], o["samples"]) == (
        True, "precision", "LogBackward0", "nan", rows), rep
    assert o["source"] == f"differentiable_dp_models.py:{line_of('w = w + torch.log(mask)')}"
    assert "a softmax over two or more entries" in rep["hint"], rep["hint"]
    assert "logsumexp of w without wᵢ" in rep["hint"] and "clamp_min" in rep["hint"], rep["hint"]
    assert "torch.where(mask, x, 1)" not in rep["hint"], rep["hint"]


def test_relaxed_topk_with_the_clamp_raises_nothing(tmp_path):
    assert train(tmp_path, "make_l2x_clamped", F.cross_entropy, l2x_batches(8)) is None


def first_softmax_at_one(batches) -> tuple[int, list[int]]:
    """The step (and its rows) at which the unlikelihood loss first takes log(1 - p) of a
    class whose softmax is 1.0, in the same training as ``train``'s without a recorder."""
    model = M.make_l2x_clamped()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=1.0)
    for step, (args, (wrong,)) in enumerate(batches):
        optimizer.zero_grad()
        logits = model(*args)
        p = F.softmax(logits.detach(), dim=-1)
        rows = (p == 1).any(-1).nonzero().flatten().tolist()  # (log(1 - p) is -inf there)
        if rows:
            return step, rows
        M.unlikelihood_loss(logits, wrong).backward()
        optimizer.step()
        sched.step()
    raise AssertionError("no softmax rounded to 1")


def test_unlikelihood_of_a_softmax_rounded_to_one_is_precision_not_a_variance(tmp_path):
    """The relaxed top-k selector (clamped) trained with the unlikelihood loss
    -log(1 - softmax(logits)) of the wrong class: at step 20 row 4's right class has p = 1.0
    in float32 (float64 keeps it below 1), log(0) is -inf, and ``* wrong`` makes it NaN
    (log is taken of every class, the mask comes after). The report said
    'precision ... (catastrophic cancellation, as in a variance E[x²] − E[x]²)'; the 0 is
    1 - p of a softmax below 1 in exact arithmetic: its stable complement or the clamp."""
    def batches(steps: int = 26):
        for (x, gumbel), (y,) in l2x_batches(steps):
            yield (x, gumbel), (F.one_hot(1 - y, 2).float(),)
    err = train(tmp_path, "make_l2x_clamped", M.unlikelihood_loss, batches(), lr=0.05,
                decay=1.0)
    # (the step and row where p rounds to 1 are the CPU's: step 20, row 4 on the AMD EPYC;
    # found here by the same training without the recorder)
    step, rows = first_softmax_at_one(batches())
    assert err is not None and (err.event["step"], err.event["phase"]) == (step, "loss")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "precision", "<loss>", "aten.log", "-inf", rows), rep
    assert o["source"] == f"differentiable_dp_models.py:{line_of('torch.log(1 - p) * wrong')}"
    assert "a softmax over two or more entries" in rep["hint"], rep["hint"]
    assert "float64 has" in rep["hint"] and "clamp_min" in rep["hint"], rep["hint"]
    assert "catastrophic cancellation" not in rep["hint"], rep["hint"]
    assert train(tmp_path / "clamped", "make_l2x_clamped", M.unlikelihood_loss_clamped,
                 batches(), lr=0.05, decay=1.0) is None


# -- Gumbel-Sinkhorn and NeuralSort -----------------------------------------------------------

def sort_batches(steps: int = 8):
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.rand(8, M.N_SORT, generator=g)
        yield (x,), (x,)


def test_probability_space_sinkhorn_at_an_annealed_tau_is_exp_overflow(tmp_path):
    """tau annealed by 0.3 a step: at step 5 (tau = 2.4e-3) log_alpha / tau passes 88.7 and
    exp(log_alpha / tau) overflows float32; the row sums are inf and inf / inf is NaN."""
    def anneal(model, step):
        model.tau = max(0.3 ** step, 1e-3)
    err = train(tmp_path, "make_sorter", M.sort_loss, sort_batches(), anneal=anneal)
    assert err is not None and (err.event["step"], err.event["phase"]) == (5, "forward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["made"]) == (
        True, "overflow", "aten.exp", "+inf"), rep
    assert o["source"] == f"differentiable_dp_models.py:{line_of('P = torch.exp(log_alpha')}"
    assert o["samples"] and set(o["samples"]) < set(range(8)), o["samples"]
    assert "float64 holds it" in rep["hint"], rep["hint"]
    assert train(tmp_path / "mild", "make_sorter", M.sort_loss, sort_batches(),
                 anneal=lambda m, s: setattr(m, "tau", max(0.7 ** s, 0.1))) is None


def test_sinkhorn_over_a_padded_list_is_an_exact_0_not_an_underflow(tmp_path):
    """At step 3 list 2 holds 3 items: its padded slots' logits are -inf, so exp gives their
    columns exact 0s and the column normalisation divides 0 by 0. The report said
    'underflow ... compute in log space': the graph of P = exp(...) / sums said positive
    everywhere, though exp had been given -inf there (the op finder knew: partly positive).
    Exact arithmetic makes that 0/0: ``invalid``, skip the rows where the sum is 0."""
    g = torch.Generator().manual_seed(0)
    batches = []
    for step in range(6):
        x, valid = torch.rand(8, M.N_SORT, generator=g), torch.ones(8, M.N_SORT, dtype=bool)
        valid[2, 3:] = step != 3
        batches.append(((x, valid), (x, valid)))
    err = train(tmp_path, "make_sorter", M.padded_sort_loss, batches, lr=1e-2)
    assert err is not None and (err.event["step"], err.event["phase"]) == (3, "forward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["made"], o["samples"]) == (
        True, "invalid", "aten.div", "nan", [2]), rep
    assert o["source"] == f"differentiable_dp_models.py:{line_of('P = P / P.sum(1, ')}"
    assert "0 by 0" in rep["hint"] and "skip the rows where it is 0" in rep["hint"], rep["hint"]
    assert "underflow" not in rep["hint"] and "log space" not in rep["hint"], rep["hint"]


def test_neuralsort_temperature_annealed_to_zero_names_the_setting(tmp_path):
    """tau = 1 - step / 5 reaches exactly 0 at step 5: P_max / 0 is +-inf."""
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(6):
        items = torch.randn(8, M.N_LIST, 4, generator=g)
        batches.append(((items, items[..., 0]), (items[..., 0],)))
    err = train(tmp_path, "make_ranker", M.ranked_loss, batches, opt=torch.optim.SGD, lr=0.1,
                anneal=lambda m, s: setattr(m, "tau", 1.0 - s / 5))
    assert err is not None and (err.event["step"], err.event["phase"]) == (5, "forward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["samples"]) == (
        True, "invalid", "aten.div", list(range(8))), rep
    assert o["source"] == f"differentiable_dp_models.py:{line_of('F.softmax(P_max / tau')}"
    assert "temperature or scale annealed to 0" in rep["hint"], rep["hint"]
    # the same schedule with a floor, as the paper's anneals keep, is a healthy run
    assert train(tmp_path / "floor", "make_ranker", M.ranked_loss, batches,
                 opt=torch.optim.SGD, lr=0.1,
                 anneal=lambda m, s: setattr(m, "tau", max(1.0 - s / 5, 0.05))) is None

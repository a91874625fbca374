"""A report with signal (issue 11, item 5).

- one jump seen through every layer is one precursor line, not one per layer;
- samples that are the whole batch say so ("all 64 rows");
- the text report's origin line, the chain and the JSON agree on the kind of value;
- a stripped bundle's first line says it was not re-run and why, not "NOT reproduced".

End to end through the command line where a user would see it; ``find_precursors`` on
hand-made histories for the grouping rules that a short training run does not reach.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import cause_models as C
import pytest
import replay_models as R
import torch
from click.testing import CliRunner
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from replay.cli import main as cli
from replay.precursors import find_precursors

K = 3


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def train(module, factory: str, make, out_dir: Path, *, loss_fn=None, steps: int = 6,
          at=None) -> NonFiniteError:
    """Train ``module.<factory>()`` until the recorder raises; ``at(model, step)`` runs
    before each step (to plant a bug in the model)."""
    model = getattr(module, factory)()
    if isinstance(model, dict):
        loss_fn, model = model["loss_fn"], model["model"]
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir,
                            factory=f"{module.__name__}:{factory}"):
            for step in range(steps):
                if at is not None:
                    at(model, step)
                x, y = make(step)
                opt.zero_grad()
                loss_fn(model(x), y).backward()
                opt.step()
    return info.value


def cli_run(*args) -> tuple[int, str]:
    res = CliRunner().invoke(cli, [str(a) for a in args])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.output
    return res.exit_code, res.stdout


def report_of(bundle: Path) -> tuple[list[str], dict]:
    code, text = cli_run(bundle)
    code_j, js = cli_run(bundle, "--json")
    assert code == code_j
    return text.splitlines(), json.loads(js)


# ---------------------------------------------------------------------------------------------
# one jump, one line


def scaled_batch(factor: float, n: int = 16, step: int = K):
    def make(s):
        x, y = R.batch(s, n=n)
        if s == step:
            x *= factor
        return x, y

    return make


def test_a_batch_jump_seen_through_every_layer_is_one_precursor_line(tmp_path):
    """A batch 1.3e4 times too large at step K: all 11 layers' absmax jump with it, and the
    last ShiftedLog makes NaN. One line says so, naming the input batch."""
    err = train(C, "make_deep_log_net", scaled_batch(1.3e4), tmp_path)
    lines, rep = report_of(err.bundle_path)
    assert rep["event"]["step"] == K and rep["origin"]["module"] == "11"
    jumps = [p for p in rep["precursors"] if p["kind"] == "absmax_jump"]
    assert len(jumps) == 1 and jumps[0]["step"] == K, rep["precursors"]
    detail = jumps[0]["detail"]
    m = re.fullmatch(r"the input batch's absmax jumped (\S+)x \(seen at 0, the first layer "
                     r"called\); every layer followed \((\d+) layers\)", detail)
    assert m, detail
    assert 3e3 < float(m.group(1)) < 3e4 and int(m.group(2)) >= 10, detail
    at = lines.index("  precursors")
    assert [ln for ln in lines[at + 1:] if "absmax_jump" in ln] == [
        f"    step {K:>6}  absmax_jump     {detail}"]


def _hist(layers, absmax, *, lr=None, grad=None):
    steps = list(range(len(absmax)))
    return {"steps": steps, "loss": [1.0] * len(steps), "grad_norm": grad or [1.0] * len(steps),
            "param_norm": [1.0] * len(steps), "lr": [[v] for v in (lr or [0.1] * len(steps))],
            "layers": layers, "absmax": absmax, "call_order": list(range(len(layers))),
            "event_step": steps[-1], "skipped": [False] * len(steps)}


def test_a_jump_from_a_middle_layer_names_it_and_counts_the_followers():
    hist = _hist(["a", "b", "c", "d"], [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1],
                                        [1, 500, 600, 700]])
    assert find_precursors(hist) == [{
        "step": 3, "kind": "absmax_jump",
        "detail": "absmax of b jumped 500x; 2 layers after it followed (c, d)"}]


def test_a_jump_after_a_learning_rate_spike_is_not_blamed_on_the_batch():
    """The update of step 2 ran with 50x the learning rate: the weights of step 3's forward
    moved, so the first layer's jump is not the batch's."""
    rows = [[1, 1, 1]] * 3 + [[100, 100, 100]]
    lr = [0.1, 0.1, 5.0, 0.1]
    pre = find_precursors(_hist(["a", "b", "c"], rows, lr=lr))
    assert [p["kind"] for p in pre] == ["lr_jump", "absmax_jump"], pre
    assert pre[1]["detail"] == "absmax of a jumped 100x; every layer followed (3 layers)"


def test_a_gradient_jump_of_the_same_step_does_not_hide_the_batch():
    """A batch 100x too large makes that step's own gradient jump too (its backward comes
    after the forward): the forward's jump is still the batch's."""
    rows = [[1, 1, 1]] * 3 + [[100, 100, 100]]
    pre = find_precursors(_hist(["a", "b", "c"], rows, grad=[1.0, 1.0, 1.0, 90.0]))
    assert [p["kind"] for p in pre] == ["absmax_jump", "grad_norm_jump"], pre
    assert pre[0]["detail"].startswith("the input batch's absmax jumped 100x (seen at a")


def test_a_level_held_or_a_runaway_growth_is_one_line():
    """A learning rate set 2000x higher and kept there, and a gradient norm growing 100x a
    step: each is one line at the step it began, saying how long and how far it went."""
    n = 8
    lr = [0.01] * 4 + [20.0] * (n - 4)
    grad = [1.0] * 5 + [100.0 ** k for k in range(1, n - 4)]
    pre = find_precursors(_hist(["a"], [[1]] * n, lr=lr, grad=grad))
    assert [(p["step"], p["kind"]) for p in pre] == [(4, "lr_jump"), (5, "grad_norm_jump")], pre
    assert pre[0]["detail"] == ("learning rate 20 is 2e+03x the median 0.01 of the 4 steps "
                                "before; above it through step 7 (3 more steps)")
    assert pre[1]["detail"].endswith("; above it through step 7 (2 more steps, up to 1e+06x)")


def test_a_jump_while_a_raised_learning_rate_holds_is_not_blamed_on_the_batch():
    """The learning rate went 50x up at step 3 and stayed there (one line): every layer's jump
    at step 5 follows updates made with it, not the batch."""
    rows = [[1, 1, 1]] * 5 + [[100, 100, 100]]
    lr = [0.1] * 3 + [5.0] * 3
    pre = find_precursors(_hist(["a", "b", "c"], rows, lr=lr))
    assert [(p["step"], p["kind"]) for p in pre] == [(3, "lr_jump"), (5, "absmax_jump")], pre
    assert pre[1]["detail"] == "absmax of a jumped 100x; every layer followed (3 layers)"


def test_a_single_layer_jump_keeps_its_own_line():
    pre = find_precursors(_hist(["a", "b"], [[1, 1], [1, 1], [1, 1], [1, 80]]))
    assert pre == [{"step": 3, "kind": "absmax_jump",
                    "detail": "absmax of b 80 is 80x the median 1 of the 3 steps before"}]


# ---------------------------------------------------------------------------------------------
# the whole batch


def test_samples_that_are_the_whole_batch_say_so(tmp_path):
    """Every row of a 64-row batch zeroed: RowShare's 0/0 in all of them."""

    def make(s):
        x, y = R.batch(s, n=64)
        if s == K:
            x[:] = 0.0
        return x, y

    err = train(C, "make_share_net", make, tmp_path)
    lines, rep = report_of(err.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], rep["cause"]) == ("share", "aten.div", "invalid")
    assert o["samples"] == list(range(64)) and o["all_samples"] is True
    assert o["batch_size"] == 64
    assert "  samples    all 64 rows" in lines, lines
    page = tmp_path / "r.html"
    cli_run(err.bundle_path, "--html", page)
    assert "<th>samples</th><td><code>all 64 rows</code></td>" in page.read_text()


def test_samples_that_are_some_rows_are_listed(tmp_path):
    def make(s):
        x, y = R.batch(s, n=64)
        if s == K:
            x[[7, 40]] = 0.0
        return x, y

    err = train(C, "make_share_net", make, tmp_path)
    lines, rep = report_of(err.bundle_path)
    assert rep["origin"]["samples"] == [7, 40] and rep["origin"]["all_samples"] is False
    assert "  samples    [7, 40]" in lines, lines


def test_rows_of_a_tensor_that_is_not_batched_are_not_samples(tmp_path):
    """Row 2 of a weight-normed 16x4 weight is zeroed (its ``g`` and ``v``) between steps: the
    parametrization makes that row 0/0 in the forward, and every sample of the 4-row batch
    meets it. The samples are the batch's 4 rows, not the weight's row 2."""
    def zero_row(model, step):
        if step == K:
            wn = model[0].parametrizations.weight
            with torch.no_grad():
                wn.original0[2] = 0.0
                wn.original1[2] = 0.0

    err = train(C, "make_weight_norm_net", R.batch, tmp_path, at=zero_row)
    assert err.event["step"] == K
    lines, rep = report_of(err.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], rep["cause"]) == \
        ("0.parametrizations.weight.0", "aten._weight_norm_interface", "invalid")
    assert o["batch_size"] == R.BATCH and o["samples"] == list(range(R.BATCH))
    assert f"  samples    all {R.BATCH} rows" in lines, lines


def test_rows_of_a_tensor_made_from_weights_alone_are_not_samples(tmp_path):
    """A learned per-class temperature, ``exp(log_scale)``, over as many classes as the batch has
    samples: class 5's temperature overflows, and column 5 of every sample's logits is +inf.
    The samples are all the batch's rows, not row 5 of the temperature (a class)."""
    def runaway(model, step):
        if step == K:
            with torch.no_grad():
                model.log_scale[5] = 120.0

    err = train(R, "make_class_scale_net", lambda s: R.batch(s, n_classes=R.BATCH), tmp_path,
                at=runaway)
    lines, rep = report_of(err.bundle_path)
    o = rep["origin"]
    assert (err.event["step"], o["module"], o["op"], rep["cause"]) == \
        (K, "", "aten.exp", "overflow")
    assert o["samples"] == list(range(R.BATCH)) and o["all_samples"] is True
    assert f"  samples    all {R.BATCH} rows" in lines, lines


# ---------------------------------------------------------------------------------------------
# the kind of value


def test_text_json_and_chain_agree_on_the_kind_of_value(tmp_path):
    """-log(softmax(x)[y]) with a probability that underflows: aten.log makes -inf (the loss
    is +inf after the minus sign); every part of the report says aten.log made -inf."""
    def make(s):
        x, y = R.batch(s)
        if s == K:
            x[2] *= 1000.0
        return x, y

    err = train(R, "make_mlp_naive_nll", make, tmp_path)
    lines, rep = report_of(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["op"], o["made"]) == ("loss", "aten.log", "-inf")
    assert [(c["op"], c["made"]) for c in o["chain"]] == [("aten.log", "-inf")]
    assert "  origin     loss: -inf made by aten.log in <loss>" in lines, lines
    assert not any("+inf" in ln for ln in lines if ln.startswith("  origin")), lines


def test_an_inf_that_becomes_nan_is_named_as_the_inf_its_op_made(tmp_path):
    """rsqrt(0) = +inf, then x * inf = NaN (0 * inf) in the same module: the origin line says
    +inf made by aten.rsqrt, the chain goes on to the NaN, the HTML verdict says Inf."""
    def make(s):
        x, y = R.batch(s)
        if s == K:
            x[4] = 0.0
        return x, y

    err = train(C, "make_rms_net", make, tmp_path)
    lines, rep = report_of(err.bundle_path)
    assert rep["origin"]["made"] == "+inf"
    assert "  origin     forward: +inf made by aten.rsqrt in norm, call 0, inputs finite" \
        in lines, lines
    chain = next(ln for ln in lines if ln.startswith("  chain"))
    assert re.fullmatch(r"  chain      aten\.rsqrt made \+inf \(\S+\) -> aten\.mul made nan "
                        r"\(\S+\)", chain), chain
    page = tmp_path / "r.html"
    cli_run(err.bundle_path, "--html", page)
    assert "Inf first made by <code>aten.rsqrt</code>" in page.read_text()


# ---------------------------------------------------------------------------------------------
# a stripped bundle


def test_a_stripped_bundle_says_not_re_run_and_why(tmp_path):
    err = train(C, "make_share_net", lambda s: _zero_row(s, 3), tmp_path)
    share = tmp_path / "share.nan"
    code, _ = cli_run(err.bundle_path, "--strip", "batch", "--strip", "weights", "-o", share)
    assert code == 0
    code, text = cli_run(share)
    assert code == 1
    assert text.splitlines()[0] == ("nanreplay: step 3, forward event — not re-run (batch and "
                                    "weights stripped)"), text
    assert "NOT reproduced" not in text
    _, js = cli_run(share, "--json")
    rep = json.loads(js)
    assert (rep["not_rerun"], rep["reproduced"], rep["cause"]) == (
        "batch and weights stripped", False, None)
    page = tmp_path / "s.html"
    cli_run(share, "--html", page)
    assert "<b>not re-run</b> (batch and weights stripped)" in page.read_text()
    _, full = cli_run(err.bundle_path, "--json")
    assert json.loads(full)["not_rerun"] is None


def _zero_row(s: int, row: int):
    x, y = R.batch(s)
    if s == K:
        x[row] = 0.0
    return x, y

"""Statistical and tabular models trained as their communities write them (values missing as
NaN imputed in the model under ``allow_nan``, categorical embeddings, real DataLoaders,
hand-written survival and quantile losses), with a planted bug: the recorder fires at the
planted step and ``nanreplay --json`` names the tensor or module, op, samples and cause."""

from __future__ import annotations

import json

import pytest
import tabular_models as T
import torch
from bundles import nanreplay_json
from click.testing import CliRunner
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError
from replay.cli import main as cli

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def test_targets_standardised_by_a_zero_batch_std_are_named_not_the_missing_values(tmp_path):
    """Quantile regression on a table with missing values (``allow_nan``, imputed in the
    model); the loop standardises each batch's targets, ``(y - y.mean()) / y.std()``, and
    batch 2 holds only capped readings (all 4.0): std 0, every target NaN. The recorder names
    the loss target; the replay named the model input instead (its missing values, which the
    model imputes), with their rows, and said a NaN of it got past the imputation."""
    num, cat, g = T.table()
    y = torch.nan_to_num(num[:, 0]) + 0.1 * torch.randn(len(num), generator=g)
    y[64:96] = 4.0
    model = T.make_quantiles()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = nn.MSELoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path, allow_nan=["args[0]"],
                            factory="tabular_models:make_quantiles"):
            for n, c, yy in DataLoader(TensorDataset(num, cat, y), batch_size=32):
                yy = (yy - yy.mean()) / yy.std()
                opt.zero_grad()
                crit(model(n, c)[:, 1], yy).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["tensor"]) == (2, "input", "loss_args[1]"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["tensor"], o["samples"], rep["cause"]) == \
        ("input", "loss_args[1]", list(range(32)), "input"), json.dumps(rep, indent=1)
    assert "allow_nan" not in rep["hint"] and "y.std()" in rep["hint"], rep["hint"]


def test_log_of_one_minus_a_hazard_the_model_rounded_to_1_is_precision(tmp_path):
    """DeepHit-style discrete hazards: the model's last op is a sigmoid per time bin, and the
    hand-written likelihood takes log(1 - h) for the bins a sample survived. An unnormalised
    record (readings of 3e4) drives its logits past 40, where sigmoid is 1.0 in float64 too:
    1 - h is 0 and log(0) is -inf. Exact arithmetic keeps 1 - sigmoid(z) above 0, so the
    cause is rounding (``precision``, log(1 - sigmoid(z)) = logsigmoid(-z)); it was called
    ``invalid``, 'which exact arithmetic makes too', because the sigmoid ran in the model,
    before the loss the op finder watched, and only a 1 - y of a sigmoid it saw run counted."""
    ds = T.survival_data(bad=70)
    model = T.make_hazards()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = T.HazardNLL()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path, allow_nan=["args[0]"],
                            factory="tabular_models:make_hazards"):
            for n, c, t_bin, event in DataLoader(ds, batch_size=32):
                opt.zero_grad()
                crit(model(n, c), t_bin, event).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (2, "loss", "<loss>"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("loss", "<loss>", "aten.log", [70 - 64], "precision"), json.dumps(rep, indent=1)
    assert "logsigmoid(−z)" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("pick", ["column", "expanded"])
def test_drop_re_runs_a_loss_on_one_quantile_column_of_the_output(tmp_path, pick):
    """A quantile head's output is (B, 3); the loss takes its median column, ``out[:, 1]``
    (a view of stride 3 at offset 1; or that column expanded beside a second target copy).
    A target NaN in row 6 is an input event; ``--try drop=6`` crashed re-making that view on
    the 31-row output with the recorded 32-row strides ('setStorage: ... out of bounds'). It
    now re-makes the column on the smaller output and the step's loss is the one without row
    6; dropping another row leaves the NaN."""
    num, cat, g = T.table()
    y = torch.nan_to_num(num[:, 0]) + 0.1 * torch.randn(len(num), generator=g)
    y[70] = float("nan")
    model = T.make_quantiles()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = nn.MSELoss()

    def median(out, yy):
        if pick == "column":
            return out[:, 1], yy
        return out[:, None, 1].expand(-1, 2), yy[:, None].expand(-1, 2)

    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path, allow_nan=["args[0]"],
                            factory="tabular_models:make_quantiles"):
            for n, c, yy in DataLoader(TensorDataset(num, cat, y), batch_size=32):
                opt.zero_grad()
                crit(*median(model(n, c), yy)).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["tensor"], ev["samples"]) == (2, "loss_args[1]", [6]), ev
    rep = nanreplay_json(info.value.bundle_path, "--try", "drop=6", "--try", "drop=5")
    tries = {t["try"]: t for t in rep["what_if"]}
    assert tries["drop=6"]["finite"] is True and tries["drop=5"]["finite"] is False, tries
    keep = [i for i in range(64, 96) if i != 70]
    with torch.no_grad():  # (the weights the step ran with: the loop stopped before its update)
        want = crit(*median(model(num[keep], cat[keep]), y[keep]))
    assert tries["drop=6"]["loss"] == pytest.approx(float(want), rel=1e-5), tries


def test_a_cox_loss_over_an_all_censored_batch_says_the_event_count_is_0(tmp_path):
    """A Cox partial likelihood averaged over the batch's events, ``.div(events.sum())``: a
    batch whose every sample is censored has 0 events, and 0/0 is NaN. The op and cause were
    right, but the hint said to add an eps 'or skip the rows where it is 0': the divisor is
    one 0-d count for the whole batch, no row holds it; the hint now says so and gives
    ``count.clamp_min(1)`` or skipping such batches."""
    num, cat, g = T.table()
    durations = torch.rand(len(num), generator=g) * 10
    events = (torch.rand(len(num), generator=g) < 0.4).float()
    events[32:64] = 0.0  # batch 1: every subject censored
    model = T.make_risk_score()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=T.cox_ph_loss, out_dir=tmp_path,
                            allow_nan=["args[0]"],
                            factory="tabular_models:make_risk_score") as rec:
            for n, c, d, e in DataLoader(TensorDataset(num, cat, durations, events),
                                         batch_size=32):
                opt.zero_grad()
                rec.loss_fn(model(n, c), d, e).backward()  # (a function: called through it)
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (1, "loss", "<loss>"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("loss", "<loss>", "aten.div", [], "invalid"), json.dumps(rep, indent=1)
    hint = rep["hint"]
    assert "clamp_min(1)" in hint and "skip the rows" not in hint, hint


def test_an_allow_nan_input_event_the_rebuilt_model_imputes_is_not_reproduced(tmp_path):
    """A mixture density network whose temperature the run set after building it (a hard
    assignment, 0), before attaching the recorder: softmax(logits / 0) is NaN, which the
    recorder sees leave the model while args[0] holds missing values (``allow_nan``) and
    calls an input event. The factory builds temperature 1, so the re-run is finite; the
    replay still said 'reproduced', cause 'input', a NaN that got past the imputation. It now
    re-runs the step, says the event did not come back, and names the attribute."""
    num, cat, g = T.table()
    y = torch.nan_to_num(num[:, 0]) + 0.1 * torch.randn(len(num), generator=g)
    model = T.make_mixture_density()
    model.temperature = 0.0  # from the run's configuration
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = T.MixtureNLL()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path, allow_nan=["args[0]"],
                            factory="tabular_models:make_mixture_density"):
            for n, c, yy in DataLoader(TensorDataset(num, cat, y), batch_size=32):
                opt.zero_grad()
                crit(model(n, c), yy).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["tensor"]) == (0, "input", "args[0]"), ev
    res = CliRunner().invoke(cli, [str(info.value.bundle_path), "--json"])
    assert res.exit_code == 1, res.output
    rep = json.loads(res.stdout)
    assert (rep["reproduced"], rep["cause"]) == (False, "not_reproduced"), rep
    assert "<root>.temperature = 1.0 (the run had 0.0)" in rep["hint"], rep["hint"]

"""End to end: metric-learning and multi-task loops as their projects write them (a dict of
task outputs, learned uncertainty weighting, gradient surgery writing ``p.grad`` by hand),
recorded with a planted bug and replayed through the command line."""

from __future__ import annotations

from pathlib import Path

import metric_models as MM
import pytest
import torch
import torch.nn.functional as F
from bundles import nanreplay_json

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle

HERE = Path(__file__).parent
K = 3  # the step the planted bugs fire at


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def test_drop_keeps_the_features_of_a_batch_as_wide_as_it_is_long(tmp_path):
    """Kendall uncertainty weighting over a classification and a regression head; at step K
    sample 5's regression target is in the wrong unit (3e19) and the squared error overflows.
    The batch is 16 samples of 16 features: ``--try drop=5`` cut sample 5's row and also
    feature 5 (a square input was taken for a graph's adjacency), and the user read 'mat1
    and mat2 shapes cannot be multiplied (15x15 and 16x32)' from their own model."""
    model, crit = MM.make_multitask(), MM.UncertaintyWeighting()
    opt = torch.optim.Adam([*model.parameters(), *crit.parameters()], lr=1e-2)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="metric_models:make_multitask"):
            for step in range(6):
                x, y, r = MM.batch(step)
                if step == K:
                    r[5] = 3e19
                opt.zero_grad()
                crit(model(x), y, r).backward()
                opt.step()
    rep = nanreplay_json(info.value.bundle_path, "--try", "drop=5", code=None)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], rep["cause"]) == (
        K, "loss", "<loss>", "aten.mse_loss", "overflow")
    assert "sample(s) 5 of loss_args[2]" in rep["hint"], rep["hint"]
    (dropped,) = rep["what_if"]
    assert "error" not in dropped, dropped
    assert dropped["finite"] is True, dropped


def test_gradient_surgery_writing_a_non_finite_grad_is_named_as_the_loops(tmp_path):
    """GradNorm-style unit task gradients: ``torch.autograd.grad`` of each task's loss over the
    shared trunk, each divided by its norm, summed and written to ``p.grad`` by hand. At step K
    the regression task is already solved (zero loss, zero gradient: 0/0). The gradients that
    reached the model's output were finite and the re-run's backward makes finite ones, so the
    NaN came from the loop's own code; before, the report said only 'not reproduced: state
    outside the model ... or transient'."""
    model = MM.make_multitask()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    shared = list(model.trunk.parameters())
    heads = [p for n, p in model.named_parameters() if not n.startswith("trunk")]
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=tmp_path, factory="metric_models:make_multitask"):
            for step in range(6):
                x, y, r = MM.batch(step)
                if step == K:
                    with torch.no_grad():
                        r = model(x)["reg"]
                opt.zero_grad()
                out = model(x)
                losses = [F.cross_entropy(out["cls"], y), F.mse_loss(out["reg"], r)]
                units = []
                for loss in losses:
                    g = torch.cat([t.flatten() for t in torch.autograd.grad(
                        loss, shared, retain_graph=True)])
                    units.append(g / g.norm())
                merged, i = sum(units), 0
                for p in shared:
                    p.grad = merged[i:i + p.numel()].view_as(p).clone()
                    i += p.numel()
                for p, g in zip(heads, torch.autograd.grad(sum(losses), heads)):
                    p.grad = g
                opt.step()
    rep = nanreplay_json(info.value.bundle_path, code=None)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["param"], rep["cause"]) == (
        K, "backward", "trunk.0.weight", "not_reproduced")
    assert rep["event"]["params"] == ["trunk.0.weight", "trunk.0.bias"]
    assert "written by the loop's own code" in rep["hint"], rep["hint"]
    assert "p.grad = ..." in rep["hint"], rep["hint"]


def test_a_loss_parameter_element_driven_out_of_the_log_domain_is_named(tmp_path):
    """Uncertainty weighting with sigma itself learned (``log(self.sigma[i])``): a regression
    task with a small loss and SGD at lr 1.5 steps sigma[1] from 1 to -0.35 in one update,
    and the loss's log is NaN at step 1. The hint names the loss's parameter the log took an
    element of and says to learn its log instead; before, it said only to clamp the op's
    input (an element of a parameter was not matched, nor were the loss's parameters)."""
    model, crit = MM.make_multitask(), MM.SigmaWeighting()
    opt = torch.optim.SGD([*model.parameters(), *crit.parameters()], lr=1.5)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="metric_models:make_multitask"):
            for step in range(4):
                x, y, r = MM.batch(step)
                opt.zero_grad()
                crit(model(x), y, r * 0.1).backward()
                opt.step()
    rep = nanreplay_json(info.value.bundle_path, code=None)
    o = rep["origin"]
    lines = (HERE / "metric_models.py").read_text().splitlines()
    bug = next(i + 1 for i, t in enumerate(lines) if "# BUG log" in t)
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], o["source"],
            rep["cause"]) == (1, "loss", "<loss>", "aten.log", f"metric_models.py:{bug}",
                              "invalid")
    assert "aten.log's input is the parameter <loss>.sigma (-0.3" in rep["hint"], rep["hint"]
    assert "learn its log and use .exp()" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("how", ["backward", "autograd.grad"])
def test_an_earlier_tasks_nan_gradient_into_a_shared_output_is_kept(tmp_path, how):
    """Two task losses over slices of one output, computed in the loop and backpropagated one
    after the other (``reg.backward(retain_graph=True); cls.backward()``, or
    ``autograd.grad`` per task summed into ``p.grad``); at step K sample 6's regression target
    is NaN. The gradient the recorder kept at the output was the last pass's alone (the
    finite classification one), so the replay fed a finite gradient and said 'NOT
    reproduced'; it is now summed over the passes, as ``p.grad`` is, and the NaN entering the
    output is named with its sample."""
    model = MM.make_shared_output()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    params = list(model.parameters())
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=tmp_path,
                            factory="metric_models:make_shared_output"):
            for step in range(6):
                x, y, r = MM.batch(step)
                if step == K:
                    r[6] = float("nan")
                opt.zero_grad()
                out = model(x)
                losses = [F.mse_loss(out[:, 5], r), F.cross_entropy(out[:, :5], y)]
                if how == "backward":
                    losses[0].backward(retain_graph=True)
                    losses[1].backward()
                else:
                    grads = [torch.autograd.grad(loss, params, retain_graph=True)
                             for loss in losses]
                    for p, *gs in zip(params, *grads):
                        p.grad = sum(gs)
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (K, "backward"), ev
    rep = nanreplay_json(info.value.bundle_path, code=None)
    o = rep["origin"]
    assert rep["reproduced"] is True, rep
    assert (o["phase"], o["module"], o["tensor"], o["samples"]) == (
        "loss", "<loss>", "grad of the model output", [6]), o


def test_a_pair_losss_backward_origin_names_the_samples_of_its_pair(tmp_path):
    """Every pair of a 16-sample batch (16 features each) goes to a contrastive loss as
    ``(120, 2)`` row indices; rows 2 and 5 of the batch at step K are the same record, so
    their distance is 0 and sqrt's derivative there is NaN. The recorder took the batch for
    one of 120 (the square input was not counted, the loss's pair tensors outvoted the
    output's 16 rows) and the replay named 'samples [31]', the pair's index; the batch is 16
    and the samples are the pair's rows, 2 and 5."""
    g = torch.Generator().manual_seed(0)
    xs, ys = torch.randn(96, 16, generator=g), torch.randint(0, 4, (96,), generator=g)
    xs[16 * K + 5], ys[16 * K + 5] = xs[16 * K + 2], ys[16 * K + 2]  # a duplicated record
    loader = torch.utils.data.DataLoader(list(zip(xs, ys)), batch_size=16,
                                         collate_fn=MM.all_pairs)
    model, crit = MM.make_embedder(), MM.PairContrastive()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="metric_models:make_embedder"):
            for x, _, pairs, same in loader:
                opt.zero_grad()
                crit(model(x), pairs, same).backward()
                opt.step()
    meta, _ = read_bundle(info.value.bundle_path)
    assert meta["micro_batches"][0]["samples"]["size"] == 16
    rep = nanreplay_json(info.value.bundle_path, "--try", "drop=5", "--try", "drop=7", code=None)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], o["samples"],
            rep["cause"]) == (K, "backward", "<loss>", "SqrtBackward0", [2, 5], "invalid")
    # --try drop= removes the pairs that hold the sample and renumbers the rest (before, the
    # pairs still named row 15 of 15: 'IndexError: index 15 is out of bounds' in the loss)
    dropped, other = rep["what_if"]
    assert dropped["finite"] is True, dropped
    assert other["finite"] is False and "error" not in other, other


def test_a_loss_wrapper_holding_the_recorded_model_is_named_in_the_hint(tmp_path):
    """The recorder was given the model, while the loop calls ``LossWrapper(model)(batch)``,
    which computes the task losses; sample 6's regression target is NaN at step K. The NaN
    enters the model's output from a loss the recorder never saw: the hint names the wrapper
    holding the model and says to give it to the recorder (before, only to pass loss_fn=,
    which a loss computed inside a wrapper cannot be)."""
    model = MM.make_multitask()
    wrapper = MM.LossWrapper(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=tmp_path, factory="metric_models:make_multitask"):
            for step in range(6):
                x, y, r = MM.batch(step)
                if step == K:
                    r[6] = float("nan")
                opt.zero_grad()
                sum(wrapper({"x": x, "y": y, "r": r}).values()).backward()
                opt.step()
    rep = nanreplay_json(info.value.bundle_path, code=None)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["tensor"], o["samples"]) == (
        K, "loss", 'grad of the model output 1 (out["reg"])', [6]), o
    assert "LossWrapper (metric_models:LossWrapper) holds the model as .model" in rep["hint"]
    assert "give it to FlightRecorder" in rep["hint"], rep["hint"]

"""End to end: sparse activations and differentiable trees (``sparse_activations_models``:
TabNet's sparsemax attentive transformer with prior scales and sparsity regulariser, a soft
decision tree whose routing is sharpened by an annealed inverse temperature, straight-through
gumbel-softmax with an annealed temperature), trained from a DataLoader of tabular batches
under the recorder until a planted bug fires, then replayed with the CLI."""

from __future__ import annotations

import pytest
import sparse_activations_models as M
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")
MODELS = "sparse_activations_models.py"


def train_tabnet(out_dir, factory: str, mask_rows=(), epochs: int = 2, partial: bool = False):
    """Adam under OneCycleLR, as pytorch-tabnet's fit; the loss adds lambda_sparse * M_loss."""
    model = getattr(M, factory)()
    opt = torch.optim.Adam(model.parameters(), lr=2e-2)
    dl = M.loader(mask_rows=mask_rows, partial=partial)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-2, total_steps=epochs * len(dl))
    with FlightRecorder(model, opt, loss_fn=M.tabnet_loss, out_dir=out_dir,
                        factory=f"sparse_activations_models:{factory}") as rec:
        for _ in range(epochs):
            for num, cat, avail, y in dl:
                loss = rec.loss_fn(model(num, cat, avail), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()


def train_tree(out_dir, betas=None, epochs: int = 2):
    """AdamW; the loop sets the tree's inverse temperature from a schedule each step."""
    model = M.make_soft_tree()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    crit = torch.nn.NLLLoss()
    step = 0
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                        factory="sparse_activations_models:make_soft_tree") as rec:
        for _ in range(epochs):
            for num, cat, _avail, y in M.loader():
                if betas:
                    model.beta = betas[step]
                step += 1
                loss = rec.loss_fn(model(num, cat), y)
                opt.zero_grad()
                loss.backward()
                opt.step()


def train_node(out_dir):
    """NODE-style trees whose feature choice is entmax15 (deep-spin/entmax's Function)."""
    model = M.make_node()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    crit = torch.nn.CrossEntropyLoss()
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                        factory="sparse_activations_models:make_node") as rec:
        for _ in range(2):
            for num, cat, avail, y in M.loader(partial=True):
                loss = rec.loss_fn(model(num, cat, avail), y)
                opt.zero_grad()
                loss.backward()
                opt.step()


def failing(train, *args, **kwargs) -> NonFiniteError:
    with pytest.raises(NonFiniteError) as info:
        train(*args, **kwargs)
    return info.value


def test_healthy_tabnet_and_soft_tree_runs_raise_no_event(tmp_path):
    # sparsemax's exact zeros under log(M + 1e-15), -inf for unavailable features in rows that
    # keep others, a tree's small path probabilities, and entmax15's forward, whose (X ** 2)
    # cumsum is inf - inf (NaN) past the masked entries of a row though its output is finite,
    # are all ordinary training
    train_tabnet(tmp_path, "make_tabnet", partial=True)
    train_tree(tmp_path)
    train_node(tmp_path)
    assert not list(tmp_path.glob("*.nan"))


def test_tabnet_sparsity_loss_with_eps_0_names_the_log_and_the_zero_eps(tmp_path):
    # sparsemax gives exact zeros, so -M * log(M + 0) is 0 * -inf at every unselected feature
    err = failing(train_tabnet, tmp_path, "make_tabnet_eps0")
    assert (err.event["step"], err.event["phase"]) == (0, "forward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"]) == (
        True, "invalid", "", "aten.log", "-inf"), rep
    assert o["samples"] == list(range(16)), o["samples"]
    assert o["source"] == source_line(MODELS, "torch.log(M + self.eps)")
    assert "eps added to that input is exactly 0" in rep["hint"], rep["hint"]


def test_sparsemax_of_a_record_with_every_feature_masked_says_the_row_is_fully_masked(tmp_path):
    # record 37 (batch 2, row 5) has no available feature: its row is all -inf, the support
    # size k is 0, tau = cumsum / k is -inf, and z - tau is -inf - -inf
    err = failing(train_tabnet, tmp_path, "make_tabnet", mask_rows=(37,))
    assert (err.event["step"], err.event["phase"]) == (2, "forward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "invalid", "att.0", "aten.sub", "nan", [5]), rep
    assert o["source"] == source_line(MODELS, "torch.clamp(z - tau, min=0)")
    # (was: "both were masked entries ... or mask with torch.finfo(dtype).min": a finite fill
    # makes a sparsemax's cumsum overflow to -inf, the same NaN)
    assert "every entry is masked" in rep["hint"], rep["hint"]
    assert "support size k = 0" in rep["hint"], rep["hint"]
    assert "keep at least one unmasked entry per row" in rep["hint"], rep["hint"]
    assert "both were masked entries" not in rep["hint"], rep["hint"]


def test_soft_tree_beta_set_from_an_int_schedule_is_restored_and_reproduces(tmp_path):
    # beta = 16 (an int from the schedule, where the factory builds 1.0): 1 - sigmoid(16 z)
    # rounds to exactly 0 on deep paths, log(mu) is -inf that logsumexp hides, and
    # LogBackward0 divides the gradient by mu = 0
    err = failing(train_tree, tmp_path, betas=[1, 2, 4, 8, 16, 32, 64, 128])
    assert (err.event["step"], err.event["phase"]) == (4, "backward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    # (was: not reproduced, "the factory builds a different model": the int 16 was not set
    # on the float attribute)
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"]) == (
        True, "invalid", "", "LogBackward0"), rep
    assert o["source"] == source_line(MODELS, "torch.log(mu)")
    assert o["samples"] and 6 not in o["samples"], o["samples"]
    assert any("<root>.beta = 16.0 (the factory built 1.0)" in p for p in rep["problems"]), rep


def test_gumbel_softmax_temperature_annealed_to_0_names_the_division_and_the_setting(tmp_path):
    model = M.make_gumbel()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    crit = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(1)
    step = 0
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="sparse_activations_models:make_gumbel") as rec:
            for _ in range(2):
                for num, cat, _avail, y in M.loader():
                    model.tau = max(0.0, 1.0 - step / 5)  # linear annealing, floored at 0
                    loss = rec.loss_fn(model(num, cat, M.gumbel_noise(g, len(y))), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    step += 1
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (5, "forward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"]) == (
        True, "invalid", "", "aten.div", "+inf"), rep
    assert o["samples"] == list(range(16)), o["samples"]
    assert o["source"] == source_line(MODELS, "/ self.tau")
    assert "temperature or scale annealed to 0" in rep["hint"], rep["hint"]

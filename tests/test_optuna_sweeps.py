"""End to end on optuna hyperparameter sweeps (``optuna_sweeps_models``): an ``objective(trial)``
builds one trial's network and optimizer from ``trial.suggest_*``, trains a few epochs under a
recorder of its own (``out_dir`` per trial number, ``factory_kwargs=trial.params``), reports and
prunes, and turns the recorder's ``NonFiniteError`` into a pruned trial so that
``study.optimize`` goes on. The planted failures are the suggestions a search space really
reaches: a learning rate at the log scale's top, an exp link, a batch size that leaves a last
batch of 1 under a correlation loss, Adam's eps of 0, a dropout rate of 1.0, a distillation
temperature of 0, a group lasso on rows still at 0."""

from __future__ import annotations

import optuna
import optuna_sweeps_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from optuna.trial import TrialState
from torch import nn
from torch.utils.data import DataLoader

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

optuna.logging.set_verbosity(optuna.logging.WARNING)

# a trial that trains well; each test overrides what its planted failure needs
HEALTHY = dict(lr=1e-3, optimizer="Adam", weight_decay=1e-5, eps=1e-8, batch_size=32,
               n_layers=2, width=16, dropout=0.0, activation="relu")
DATA = {"pearson": M.regression_data, "mse": M.regression_data, "bn": M.regression_data,
        "lasso": M.regression_data,
        "count": M.count_data, "distill": M.class_data, "bce": M.binary_data}


def line_of(text: str) -> str:
    return source_line("optuna_sweeps_models.py", text)


def suggest(trial: optuna.Trial, task: str) -> dict:
    """The search space, as a sweep writes it (``lr`` on a log scale up to diverging values)."""
    trial.suggest_float("lr", 1e-4, 10.0, log=True)
    trial.suggest_categorical("optimizer", ["Adam", "AdamW", "SGD"])
    trial.suggest_float("weight_decay", 1e-6, 1e-1, log=True)
    trial.suggest_categorical("eps", [1e-8, 0.0])
    trial.suggest_categorical("batch_size", [16, 32, 95])
    trial.suggest_int("n_layers", 1, 3)
    trial.suggest_int("width", 8, 32, step=8)
    trial.suggest_float("dropout", 0.0, 1.0, step=0.25)
    trial.suggest_categorical("activation", ["relu", "tanh", "silu"])
    if task == "count":
        trial.suggest_categorical("link", ["identity", "exp"])
    if task == "distill":
        trial.suggest_float("temperature", 0.0, 4.0, step=0.5)
    if task == "lasso":
        trial.suggest_float("group_lasso", 1e-4, 1e-1, log=True)
    if task == "bce":
        trial.suggest_categorical("precision", ["fp32", "bf16"])
    if task == "bn":
        trial.suggest_categorical("norm", ["none", "batchnorm"])
    # (the settings the search does not vary, which the factory needs as well)
    return {**trial.params, "n_out": 3 if task == "distill" else 1}


def build(params: dict, task: str):
    model = M.make_model(**params)
    opt_cls = getattr(torch.optim, params["optimizer"])
    extra = {"momentum": 0.9} if params["optimizer"] == "SGD" else {"eps": params["eps"]}
    optimizer = opt_cls(model.parameters(), lr=params["lr"],
                        weight_decay=params["weight_decay"], **extra)
    loss_fn = {"pearson": lambda: M.PearsonLoss(), "mse": lambda: nn.MSELoss(),
               "bn": lambda: nn.MSELoss(),
               "count": lambda: nn.PoissonNLLLoss(log_input=False),
               "bce": lambda: M.BinaryCrossEntropy(),
               "distill": lambda: M.DistillLoss(M.make_teacher(), params.get("temperature")),
               "lasso": lambda: M.GroupLassoLoss(nn.MSELoss(), model,
                                                 params.get("group_lasso"))}[task]()
    return model, optimizer, loss_fn


def train(model, optimizer, loss_fn, params, task, epochs, trial=None):
    """The trial's loop: the last batch's loss, or a reported value per epoch."""
    loader = DataLoader(DATA[task](), batch_size=params["batch_size"], shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    losses, bf16 = [], params.get("precision") == "bf16"
    for epoch in range(epochs):
        model.train()
        for x, c, y in loader:
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                out = model(x, c)
            loss = loss_fn(out, x, c, y) if task == "distill" else loss_fn(out, y)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        if trial is not None:
            trial.report(loss.item(), epoch)
            if trial.should_prune():
                raise optuna.TrialPruned()
    return losses


def objective_for(task: str, out_root, epochs: int = 3, models: list | None = None,
                  **rec_kw):
    def objective(trial: optuna.Trial) -> float:
        params = suggest(trial, task)
        torch.manual_seed(trial.number)
        model, optimizer, loss_fn = build(params, task)
        if models is not None:
            models.append(model)
        try:
            with FlightRecorder(model, optimizer, loss_fn=loss_fn,
                                out_dir=out_root / f"trial{trial.number}",
                                factory="optuna_sweeps_models:make_model",
                                factory_kwargs=params, **rec_kw) as rec:
                losses = train(model, optimizer, rec.loss_fn, params, task, epochs, trial)
        except NonFiniteError as e:
            trial.set_user_attr("bundle", str(e.bundle_path))
            trial.set_user_attr("event", {k: e.event[k] for k in ("step", "phase", "module")})
            raise optuna.TrialPruned(f"non-finite at step {e.event['step']}") from None
        return float(losses[-1])
    return objective


def sweep(tmp_path, task: str, *overrides: dict, models: list | None = None, **rec_kw):
    """A study whose first trials are ``overrides`` of HEALTHY (enqueued, as a sweep seeds its
    search with known points), run in this process."""
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0))
    for o in overrides:
        study.enqueue_trial({**HEALTHY, **o})
    study.optimize(objective_for(task, tmp_path, models=models, **rec_kw),
                   n_trials=len(overrides))
    return study


def failed(tmp_path, task: str, override: dict, code: int = 0, **rec_kw) -> tuple[dict, dict]:
    """The one trial of ``override``: its event and its bundle's ``--json`` report."""
    t = sweep(tmp_path, task, override, **rec_kw).trials[0]
    assert t.state == TrialState.PRUNED and "bundle" in t.user_attrs, (t.state, t.user_attrs)
    return t.user_attrs["event"], nanreplay_json(t.user_attrs["bundle"], code=code)


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
               + len(getattr(m, "_backward_pre_hooks", {})) for m in model.modules()) + sum(
        len(p._backward_hooks or {}) + len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
        for p in model.parameters())


def test_sweep_goes_on_past_a_failed_trial_whose_bundle_replays_as_that_trial(tmp_path):
    """Three trials in one process: a healthy one, a deeper and wider one whose dropout rate
    is the search space's top (1.0: the hand-written inverted dropout's ``mask / (1 - p)``
    is 0/0), and a healthy one after it. The failure prunes only its trial; its bundle,
    recorded with ``factory_kwargs=trial.params``, replays that trial's network (3 layers of
    24), not the factory's defaults; no recorder leaves a hook on its trial's model."""
    models: list[nn.Module] = []
    study = sweep(tmp_path, "pearson", {}, {"n_layers": 3, "width": 24, "dropout": 1.0},
                  {"activation": "tanh"}, models=models)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.PRUNED,
                                               TrialState.COMPLETE]
    assert all("bundle" not in t.user_attrs for t in (study.trials[0], study.trials[2]))
    assert [_hooks(m) for m in models] == [0, 0, 0]
    assert not torch.nn.modules.module._global_forward_hooks
    assert not torch.nn.modules.module._global_forward_pre_hooks
    t = study.trials[1]
    assert t.user_attrs["event"] == {"step": 0, "phase": "forward", "module": "body.2"}
    assert t.user_attrs["bundle"].startswith(str(tmp_path / "trial1"))
    rep = nanreplay_json(t.user_attrs["bundle"])
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"]) == (
        True, "invalid", "body.2", "aten.div", "nan"), rep
    assert o["samples"] == list(range(32)), o["samples"]
    assert o["source"] == line_of("return x * mask / (1 - self.p)")
    assert rep["fidelity"]["matches"] is True, rep["fidelity"]
    assert "a drop probability of 1 leaves keep_prob = 1 - p = 0" in rep["hint"], rep["hint"]


def test_healthy_trial_raises_no_event_and_trains_bit_identically(tmp_path):
    """The same trial with and without the recorder: no event, and every loss and weight equal
    to the bit."""
    params = {**HEALTHY, "dropout": 0.25, "n_out": 1}  # (dropout draws: the RNG untouched)
    runs = []
    for recorded in (False, True):
        torch.manual_seed(0)
        model, optimizer, loss_fn = build(params, "pearson")
        if recorded:
            with FlightRecorder(model, optimizer, loss_fn=loss_fn, out_dir=tmp_path,
                                factory="optuna_sweeps_models:make_model",
                                factory_kwargs=params) as rec:
                losses = train(model, optimizer, rec.loss_fn, params, "pearson", 3)
        else:
            losses = train(model, optimizer, loss_fn, params, "pearson", 3)
        runs.append((torch.stack(losses), model.state_dict()))
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])
    assert not list(tmp_path.glob("*.nan"))


def test_last_batch_of_one_under_a_correlation_loss_says_drop_last(tmp_path):
    """batch_size=95 over 96 records: the epoch's last batch holds one sample, whose unbiased
    ``std()`` divides by n - 1 = 0 in the Pearson loss."""
    with pytest.warns(UserWarning, match="degrees of freedom"):  # torch's, in training...
        t = sweep(tmp_path, "pearson", {"batch_size": 95}).trials[0]
    assert t.state == TrialState.PRUNED, t.state
    ev = t.user_attrs["event"]
    with pytest.warns(UserWarning, match="degrees of freedom"):  # ...and in the re-runs
        rep = nanreplay_json(t.user_attrs["bundle"])
    assert ev == {"step": 1, "phase": "loss", "module": "<loss>"}
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"]) == (
        True, "invalid", "<loss>", "aten.std", "nan"), rep
    assert o["batch_size"] == 1
    assert o["source"] == line_of("p = (pred - pred.mean()) / pred.std()")
    assert "DataLoader(..., drop_last=True)" in rep["hint"], rep["hint"]


def test_adam_eps_of_zero_names_the_embedding_padding_row(tmp_path):
    """AdamW with ``eps=0``: the categorical embedding's padding row (``padding_idx=0``) never
    gets a gradient, so its m = v = 0 and the update is 0/0. The hint named the row as one
    'absent from the batch', which category 0 is not (it is in every batch of 32). (The
    bundle holds the weights after the update: not re-run, exit 1, as without
    guard_optimizer.)"""
    ev, rep = failed(tmp_path, "pearson", {"optimizer": "AdamW", "eps": 0.0,
                                           "weight_decay": 0.05}, code=1)
    assert ev == {"step": 0, "phase": "optimizer", "module": None}
    o = rep["origin"]
    assert (rep["cause"], o["phase"], o["param"]) == ("optimizer", "optimizer", "embed.weight")
    assert "with eps=0 an element whose gradients have all been exactly 0" in rep["hint"]
    assert "it made only row(s) 0 of 5 of embed.weight non-finite" in rep["hint"], rep["hint"]
    assert "embed's padding row, padding_idx=0, which Embedding never gives a gradient" in \
        rep["hint"], rep["hint"]
    assert "absent from the batch" not in rep["hint"], rep["hint"]
    # recorded with guard_optimizer=True, the update is re-run: the same row, named the same
    ev, rep = failed(tmp_path / "guard", "pearson", {"optimizer": "AdamW", "eps": 0.0,
                                                     "weight_decay": 0.05}, guard_optimizer=True)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["param"], o["op"]) == (
        True, "optimizer", "embed.weight", "aten.addcdiv_"), rep
    assert "embed's padding row, padding_idx=0, which Embedding never gives a gradient" in \
        rep["hint"] and "absent from the batch" not in rep["hint"], rep["hint"]


def test_distillation_temperature_of_zero_replays_the_teacher_and_names_the_attribute(tmp_path):
    """``student / T`` with a suggested temperature of 0. The loss holds a teacher network
    shallower than its class's defaults (1 layer of 8): the replay rebuilt it on top of the
    default construction and ran the defaults' extra layers (a bare shape error). The
    ``* T * T`` after the NaN is the same setting, not a mask's 0; the hint names the
    attribute the function copied to ``T``."""
    ev, rep = failed(tmp_path, "distill", {"temperature": 0.0})
    assert ev == {"step": 0, "phase": "loss", "module": "<loss>"}
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"]) == (
        True, "invalid", "<loss>", "aten.div", "+inf"), rep
    assert o["samples"] == list(range(32)), o["samples"]
    assert o["source"] == line_of("soft = F.kl_div(F.log_softmax(student_logits / T")
    assert "the loss's attribute temperature (read as T) is 0" in rep["hint"], rep["hint"]
    assert "mask's 0" not in rep["hint"], rep["hint"]


def test_exp_link_overflows_at_step_one(tmp_path):
    """A Poisson head's exp link with SGD at lr=0.5 on an unscaled duration column: one update
    and ``exp(out)`` overflows float32 in some samples."""
    ev, rep = failed(tmp_path, "count", {"link": "exp", "lr": 0.5, "optimizer": "SGD"})
    assert ev == {"step": 1, "phase": "forward", "module": ""}
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"]) == (
        True, "overflow", "", "aten.exp", "+inf"), rep
    assert o["samples"] == [2, 4, 6, 11, 12, 13, 14, 15, 16, 23, 25, 29, 31], o["samples"]
    assert o["source"] == line_of("return torch.exp(out)")
    assert "bound a learned exponent" in rep["hint"], rep["hint"]


def test_learning_rate_at_the_top_of_the_log_scale_diverges(tmp_path):
    """SGD at lr=9 on an MSE: the weights grow each step until the first layer's product
    overflows at step 4; the precursors show the jump and the hint says to lower the rate."""
    ev, rep = failed(tmp_path, "mse", {"lr": 9.0, "optimizer": "SGD"})
    assert ev == {"step": 4, "phase": "forward", "module": "body.0"}
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"]) == (
        True, "overflow", "body.0", "aten.addmm", "+inf"), rep
    assert "the run was diverging" in rep["hint"] and "lower the learning rate" in rep["hint"]


def test_group_lasso_on_a_zero_row_is_a_backward_only_nan(tmp_path):
    """A hand-written group lasso ``sqrt(sum(w ** 2))`` per embedding row: the padding row is
    0, its forward is 0 and finite, its derivative infinite, and ``2 w * inf`` NaN."""
    ev, rep = failed(tmp_path, "lasso", {"group_lasso": 0.01})
    assert ev == {"step": 0, "phase": "backward", "module": None}
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"]) == (
        True, "invalid", "<loss>", "SqrtBackward0", "+inf"), rep
    assert o["source"] == line_of("norms = self.model.embed.weight.pow(2)")
    assert "torch.linalg.vector_norm(d, dim=-1)" in rep["hint"], rep["hint"]


def test_bf16_trial_rounds_a_probability_to_one_under_a_hand_written_bce(tmp_path):
    """The trial that picked bf16 autocast: the logits come out in bfloat16, their sigmoid
    rounds to 1 in sample 18 at step 4 (float64 keeps it below 1), and ``log(1 - p)`` is
    -inf, times a label of 0 NaN: precision, with the logits form as the fix."""
    ev, rep = failed(tmp_path, "bce", {"lr": 0.2, "precision": "bf16"})
    assert ev == {"step": 4, "phase": "loss", "module": "<loss>"}
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "precision", "<loss>", "aten.log", "-inf", [18]), rep
    assert o["source"] == line_of("torch.log(1 - p)).mean()")
    assert "rounded to 1 in bfloat16" in rep["hint"], rep["hint"]
    assert "binary_cross_entropy_with_logits" in rep["hint"], rep["hint"]
    # the same trial in float32 trains through
    study = sweep(tmp_path / "fp32", "bce", {"lr": 0.2, "precision": "fp32"})
    assert study.trials[0].state == TrialState.COMPLETE


def test_trial_params_given_to_a_factory_of_the_model_settings_alone(tmp_path):
    """``factory_kwargs=trial.params`` with a factory that takes only the model's settings
    (no ``**kwargs``): the replay called it with the optimizer's and the loop's keys too and
    failed (exit 2, 'unexpected keyword argument lr'); now those keys are left out, a note
    names them, and the trial's network (3 layers) is rebuilt."""
    params = {**HEALTHY, "n_layers": 3, "dropout": 1.0}
    torch.manual_seed(0)
    model, optimizer, loss_fn = build({**params, "n_out": 1}, "pearson")
    with pytest.raises(NonFiniteError) as e:
        with FlightRecorder(model, optimizer, loss_fn=loss_fn, out_dir=tmp_path,
                            factory="optuna_sweeps_models:make_strict", factory_kwargs=params):
            train(model, optimizer, loss_fn, params, "pearson", 1)
    rep = nanreplay_json(e.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"]) == (
        True, "invalid", "body.2", "aten.div"), rep
    assert rep["fidelity"]["matches"] is True, rep["fidelity"]
    assert any("factory_kwargs lr, optimizer, weight_decay, eps, batch_size are no parameters "
               "of the factory optuna_sweeps_models:make_strict" in p
               for p in rep["problems"]), rep["problems"]


def test_trial_the_pruner_stops_inside_the_recorder_leaves_no_bundle_and_no_hooks(tmp_path):
    """``raise optuna.TrialPruned()`` from ``trial.should_prune()`` inside the recorder's
    ``with`` (a MedianPruner stopping a trial at lr=3, worse than the first after its first
    epoch, before it overflows): no event, no bundle, no hook left on that trial's model; the
    next trial trains and completes."""
    models: list[nn.Module] = []
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0),
                                pruner=optuna.pruners.MedianPruner(n_startup_trials=1))
    for o in ({}, {"lr": 3.0, "optimizer": "SGD"}, {"activation": "silu"}):
        study.enqueue_trial({**HEALTHY, **o})
    study.optimize(objective_for("mse", tmp_path, models=models), n_trials=3)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.PRUNED,
                                               TrialState.COMPLETE]
    assert study.trials[1].last_step == 0 and "bundle" not in study.trials[1].user_attrs
    assert not list(tmp_path.rglob("*.nan"))
    assert [_hooks(m) for m in models] == [0, 0, 0]


def test_batchnorm_trial_with_a_last_batch_of_one_fails_without_an_event(tmp_path):
    """BatchNorm1d refuses a training batch of one sample itself (a ValueError, no NaN): the
    study's ``catch=(ValueError,)`` marks that trial failed; the recorder wrote nothing and
    left no hook, and the next trial completes."""
    models: list[nn.Module] = []
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0))
    for o in ({"batch_size": 95, "norm": "batchnorm"}, {"norm": "none"}):
        study.enqueue_trial({**HEALTHY, **o})
    study.optimize(objective_for("bn", tmp_path, models=models), n_trials=2,
                   catch=(ValueError,))
    assert [t.state for t in study.trials] == [TrialState.FAIL, TrialState.COMPLETE]
    assert not list(tmp_path.rglob("*.nan"))
    assert [_hooks(m) for m in models] == [0, 0]

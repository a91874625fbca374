"""End to end on evolution strategies written in torch (``evolution_strategies_models``):
OpenAI-ES's antithetic Gaussian perturbations of the flattened parameter vector
(``parameters_to_vector`` / ``vector_to_parameters``), each scored by a vectorised episode under
``torch.no_grad``, the fitness shaped by ``(f - mean) / std`` or centred ranks, the estimate
written into ``p.grad`` and applied by Adam with a cosine schedule; OpenAI-ES's observation
normaliser kept as buffers and refit by the loop. Each planted bug of the domain fires under
the recorder and is replayed with the CLI; the healthy versions raise no event and train
bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import evolution_strategies_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

MODELS = "evolution_strategies_models.py"


def train_es(out_dir, make: str = "make_policy", steps: int = 4, record: bool = True,
             flat_at: int | None = None, fixed_start_at: int | None = None,
             shaping: str = "std", eps: float | None = 1e-8, missing_at: int | None = None):
    """OpenAI-ES on the reaching task. ``flat_at``: from that generation the fitness is the
    sparse success rate (0 for every perturbation of a policy that never reaches its goal);
    ``fixed_start_at``: from that generation every episode resets to the origin (the
    normaliser refit on identical start positions); ``missing_at``: that generation's episode
    5 has a NaN goal. Returns the policy."""
    policy = getattr(M, make)()
    opt = torch.optim.Adam(policy.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(policy, opt, out_dir=out_dir,
                         factory=f"evolution_strategies_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        for step in range(steps):
            start, goal = M.episodes(g, missing=5 if step == missing_at else None)
            if fixed_start_at is not None and step >= fixed_start_at:
                start = torch.zeros_like(start)
            if isinstance(policy, M.NormalisedPolicy):
                policy.obs_norm.refit(M.first_obs(start, goal))
            sparse = flat_at is not None and step >= flat_at

            def fitness(pol, start=start, goal=goal, sparse=sparse):
                if sparse:
                    return M.success_rate(pol, start, goal)
                return M.rollout(pol, start, goal).mean()

            opt.zero_grad()
            M.es_gradient(policy, fitness, g, shaping=shaping, eps=eps)
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            opt.step()
            sched.step()
    return policy


def fire(tmp_path, **kw):
    with pytest.raises(NonFiniteError) as info:
        train_es(tmp_path, **kw)
    return info.value.event, info.value.bundle_path


def test_flat_fitness_std_of_zero_names_the_shared_normaliser(tmp_path):
    """Every perturbation of a policy that never reaches its goal scores 0 on the sparse
    reward: (f - mean) / std is 0/0 for every one, so every entry of the estimate written into
    p.grad is NaN. The update is stopped at that generation; the replay cannot re-run the
    loop's code, and says the gradients came from it and that one shared NaN factor made all
    of them: the fitness shaping's std of 0, fixed by an eps or centred ranks."""
    event, bundle = fire(tmp_path, flat_at=3, eps=None)
    assert (event["step"], event["phase"], event["kind"]) == (3, "backward", "nan")
    names = [n for n, _ in M.make_policy().named_parameters()]
    assert event["params"] == names
    rep = nanreplay_json(bundle, code=None)
    assert rep["origin"]["phase"] == "backward" and rep["origin"]["params"] == names
    assert rep["cause"] == "not_reproduced"
    assert "every element of every parameter's gradient was NaN" in rep["hint"]
    assert "(f - f.mean()) / f.std()" in rep["hint"] and "centred ranks" in rep["hint"]
    assert "with gradients on" in " ".join(rep["problems"])  # (its forwards ran under no_grad)


def test_flat_fitness_with_eps_or_ranks_trains_on(tmp_path):
    """The same flat generation with the eps, or with centred ranks: no event, and training
    is bit-identical with and without the recorder."""
    for kw in ({"eps": 1e-8}, {"shaping": "rank"}):
        recorded = train_es(tmp_path, flat_at=3, **kw).state_dict()
        bare = train_es(tmp_path, flat_at=3, record=False, **kw).state_dict()
        assert all(torch.equal(recorded[k], bare[k]) for k in bare)
    assert not list(tmp_path.glob("*.nan"))


def test_observation_normaliser_without_floor_on_identical_resets(tmp_path):
    """Every episode of generation 2 resets to the origin: the normaliser refit on those
    observations has a std of exactly 0 in the position features, and its (obs - mean) / std
    is 0/0 there in the first perturbation's evaluation (a forward under no_grad, with the
    perturbed weights in place). The replay names the division, its line, both columns of
    every episode, and the eps/floor fix."""
    event, bundle = fire(tmp_path, make="make_normalised_policy", fixed_start_at=2)
    assert (event["step"], event["phase"], event["module"]) == (2, "forward", "obs_norm")
    assert event.get("evaluation") is True
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert rep["reproduced"] is True
    assert (o["module"], o["op"], o["made"]) == ("obs_norm", "aten.div", "nan")
    assert o["source"] == source_line(MODELS, "return (obs - mean) / std")
    assert o["samples"] == list(range(8)) and o["all_samples"]
    assert rep["cause"] == "invalid"
    # (the normaliser's own statistic, floored where it is fitted: OpenAI-ES clips it at 1e-2)
    assert "column(s) [0, 1]" in rep["hint"] and "floor that statistic" in rep["hint"], rep["hint"]
    assert "clamp_min(eps)" in rep["hint"], rep["hint"]


def test_floored_normaliser_trains_bit_identically(tmp_path):
    """OpenAI-ES's clip of the std at 1e-2: no event on the identical resets, and the
    recorder (hooks on every evaluation under no_grad, weights swapped by
    vector_to_parameters) leaves training bit-identical."""
    recorded = train_es(tmp_path, make="make_floored_policy", fixed_start_at=2).state_dict()
    bare = train_es(tmp_path, make="make_floored_policy", fixed_start_at=2,
                    record=False).state_dict()
    assert all(torch.equal(recorded[k], bare[k]) for k in bare)
    assert not list(tmp_path.glob("*.nan"))


def test_nan_goal_in_one_episode_is_named_as_input(tmp_path):
    """Episode 5 of generation 2 draws a goal with a missing coordinate: its observation is
    NaN, so every perturbation's return (and with it the whole shaped estimate) would be. The
    recorder stops the first evaluation, before any update; the replay names the input and
    that one episode."""
    event, bundle = fire(tmp_path, missing_at=2)
    assert (event["step"], event["phase"], event["samples"]) == (2, "input", [5])
    rep = nanreplay_json(bundle)
    assert rep["cause"] == "input" and rep["origin"]["samples"] == [5]
    # (a goal coordinate missing in one record: named where it is, as a missing value)
    assert rep["origin"]["phase"] == "input" and "missing values" in rep["hint"], rep["hint"]
    assert "sample 5 at feature(s)" in rep["hint"], rep["hint"]


def train_tempered(out_dir, steps: int = 4, outer_lr: float = 100.0, floor: float | None = None,
                   record: bool = True):
    """A hybrid: the policy trained by backprop on behaviour cloning (MSELoss, AdamW,
    clip_grad_norm_), its log-temperature (an extra forward argument, one per episode) tuned
    by an OpenAI-ES outer loop every third step; ``floor``: the loop bounds it from below."""
    policy = M.make_tempered_policy()
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    crit = torch.nn.MSELoss()
    g = torch.Generator().manual_seed(0)
    log_tau = 0.0
    rec = FlightRecorder(policy, opt, loss_fn=crit, out_dir=out_dir,
                         factory="evolution_strategies_models:make_tempered_policy") \
        if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step in range(steps):
            start, goal = M.episodes(g)
            obs, target = M.first_obs(start, goal), M.expert(start, goal)
            if step % 3 == 2:
                log_tau = M.outer_es(policy, log_tau, obs, target, g, lr=outer_lr)
                log_tau = log_tau if floor is None else max(log_tau, floor)
            loss = loss_fn(policy(obs, torch.full((obs.shape[0],), log_tau)), target)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            opt.step()
    return policy


def test_log_temperature_tuned_by_es_underflows_to_zero(tmp_path):
    """The outer ES step at step 2 moves the log-temperature to about -212: its exp is 0 in
    float32, so every head output over it is ±inf, tanh saturates, and the division's
    backward is 0 * inf = NaN. The temperature is an extra forward argument no gradient
    reaches (off the autograd graph): the replay still finds that the divisor came from exp,
    so the cause is the underflow (finite in float64), not rounding onto the pole."""
    with pytest.raises(NonFiniteError) as info:
        train_tempered(tmp_path)
    event = info.value.event
    assert (event["step"], event["phase"], event["kind"]) == (2, "backward", "nan")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert rep["reproduced"] is True
    assert (o["phase"], o["op"], o["module"]) == ("backward", "DivBackward0", "")
    assert o["source"] == source_line(MODELS, "torch.tanh(self.head(self.body(obs)) / tau)")
    assert o["samples"] == list(range(8))
    assert rep["cause"] == "underflow"
    assert "underflowed to 0" in rep["hint"] and "clamp the value away from 0" in rep["hint"]


def test_log_temperature_with_a_floor_trains_bit_identically(tmp_path):
    """The same outer loop bounding the log-temperature at -20: no event, and the recorder
    leaves training bit-identical."""
    recorded = train_tempered(tmp_path, floor=-20.0).state_dict()
    bare = train_tempered(tmp_path, floor=-20.0, record=False).state_dict()
    assert all(torch.equal(recorded[k], bare[k]) for k in bare)
    assert not list(tmp_path.glob("*.nan"))


def train_cma(out_dir, active: bool, steps: int = 3, record: bool = True):
    """CMA-ES-style generations (Cholesky of C, rank-mu update) with Adam on the mean."""
    policy = M.make_policy()
    opt = torch.optim.Adam(policy.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    C = torch.eye(sum(p.numel() for p in policy.parameters()))
    rec = FlightRecorder(policy, opt, out_dir=out_dir,
                         factory="evolution_strategies_models:make_policy") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        for _ in range(steps):
            start, goal = M.episodes(g)
            opt.zero_grad()
            C = M.cma_step(policy, C, lambda pol, s=start, t=goal: M.rollout(pol, s, t).mean(),
                           g, active=active)
            opt.step()
    return policy, C


def test_active_cma_covariance_losing_definiteness_reaches_the_loop_unchanged(tmp_path):
    """Active CMA's negative rank-mu weights, unbounded, leave C indefinite after the first
    generation: the loop's own cholesky (outside the model and the loss: nothing to replay)
    raises LinAlgError, which reaches the loop as torch raised it, with no bundle written;
    without the negative weights the run is healthy and bit-identical under the recorder."""
    with pytest.raises(torch.linalg.LinAlgError, match="not positive-definite"):
        train_cma(tmp_path, active=True)
    assert not list(tmp_path.glob("*.nan"))
    recorded, c_rec = train_cma(tmp_path, active=False)
    bare, c_bare = train_cma(tmp_path, active=False, record=False)
    assert torch.equal(c_rec, c_bare) and all(
        torch.equal(a, b) for a, b in zip(recorded.state_dict().values(),
                                          bare.state_dict().values()))
    assert not list(tmp_path.glob("*.nan"))

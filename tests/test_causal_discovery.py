"""End to end on differentiable causal discovery (``causal_discovery_models``): NOTEARS'
augmented Lagrangian (``matrix_exp`` acyclicity, ``rho`` and ``alpha`` on the loss module, the
outer loop between DataLoader epochs), DAGMA's log-det acyclicity with its ``s`` lowered by the
loop, GOLEM-NV's per-node log-likelihood from the empty graph, and ENCO's Gumbel-sigmoid edge
masks with a ``-inf`` diagonal and an annealed temperature. Each planted failure of
the domain fires under the recorder and is replayed with the CLI; the healthy versions raise no
event and train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib
import functools

import causal_discovery_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("causal_discovery_models.py", text)


def train_notears(make: str, out_dir, steps: int = 60, rho_max: float = float("inf"),
                  record: bool = True, data: dict | None = None, sgd: float | None = None):
    """NOTEARS' augmented Lagrangian with Adam as the inner solver (one epoch over a
    DataLoader per outer iteration): ``rho *= 10`` while ``h`` has not dropped below a quarter
    of its last value, up to ``rho_max``, then ``alpha += rho * h``."""
    model = getattr(M, make)()
    crit = M.AugLagLoss()
    opt = torch.optim.SGD(model.parameters(), lr=sgd) if sgd else \
        torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(M.SEMData(**(data or {})), batch_size=64, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"causal_discovery_models:{make}") if record else None
    h_prev, step = float("inf"), 0
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        while step < steps:
            for x in loader:
                recon, h, l1 = model(x)
                loss = loss_fn(recon, h, l1, x)
                opt.zero_grad()
                loss.backward()
                opt.step()
                step += 1
            with torch.no_grad():
                h_new = model.acyclicity().item()
            if h_new > 0.25 * h_prev and crit.rho < rho_max:
                crit.rho *= 10
            crit.alpha += crit.rho * h_new
            h_prev = h_new
    return model, step


def dagma_loss(recon, h, l1, x, mu: float = 1.0, lambda1: float = 0.02):
    """DAGMA's objective on the central path: ``mu (score + lambda1 |W|_1) + h(W)``."""
    score = 0.5 / x.shape[0] * ((x - recon) ** 2).sum()
    return mu * (score + lambda1 * l1) + h


# each run's own loss (DAGMA's mu is the loop's to lower)
LOSSES = {"make_dagma": lambda: functools.partial(dagma_loss, mu=1.0),
          "make_golem": lambda: M.golem_nv_loss, "make_enco": torch.nn.MSELoss}


def train(make: str, out_dir, steps: int = 8, lr: float = 1e-2, record: bool = True,
          data: dict | None = None, clip: float | None = None, s_at: dict | None = None,
          tau_at: dict | None = None):
    """One Adam step per batch of a shuffled DataLoader, as DAGMA, GOLEM and ENCO's torch
    ports fit; ENCO's MLPs regress each node on its sampled parents (the targets are the
    batch itself). ``s_at``: DAGMA's outer loop, the log-det's ``s`` lowered at those steps
    (with ``mu`` divided by 10), without the reference code's check that ``W`` is still inside
    the M-matrix domain of the new ``s``; ``tau_at``: ENCO's Gumbel-sigmoid temperature
    annealed at those steps. Returns the model."""
    model = getattr(M, make)()
    crit = LOSSES[make]()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    loader = torch.utils.data.DataLoader(M.SEMData(**(data or {})), batch_size=32, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)  # (ENCO's logistic noise)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"causal_discovery_models:{make}") if record else None
    step = 0
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        while step < steps:
            for x in loader:
                if s_at and step in s_at:
                    model.s, crit.keywords["mu"] = s_at[step], crit.keywords["mu"] / 10
                if tau_at and step in tau_at:
                    model.tau = tau_at[step]
                out = model(x)
                targets = () if make == "make_golem" else (x,)  # (GOLEM's terms are all W's)
                loss = loss_fn(*out, *targets) if isinstance(out, tuple) else loss_fn(out, x)
                opt.zero_grad()
                loss.backward()
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                opt.step()
                step += 1
    return model


def fire(fn, *args, **kw):
    with pytest.raises(NonFiniteError) as info:
        fn(*args, **kw)
    return info.value.event, info.value.bundle_path


def test_rho_grown_without_a_cap_overflows_adams_state_first_and_names_rho(tmp_path):
    """NOTEARS' outer loop without ``rho_max``: ``h`` never drops to a quarter of its last
    value under two Adam steps per round, so ``rho`` gains a factor 10 every epoch. At step 56
    (rho 1e27) the gradient of ``0.5 * rho * h * h`` reaches 5.6e21, and Adam's exp_avg_sq of
    its square is +inf: W trains no more (every later update 0), silently, until the loss
    itself overflowed at step 80, the event before the optimizer's state was checked. The
    update of step 56 is the event now, and its hint names the loss's attribute ``rho``."""
    ev, bundle = fire(train_notears, "make_notears", tmp_path, steps=200)
    assert (ev["step"], ev["phase"], ev["state"]) == (56, "optimizer", {"W": ["exp_avg_sq"]}), ev
    rep = nanreplay_json(bundle, code=None)
    assert rep["cause"] == "overflow" and rep["origin"]["param"] == "W", rep["origin"]
    assert "the loss's attribute rho is 1e+27" in rep["hint"] and "rho_max" in rep["hint"], \
        rep["hint"]


def test_a_penalty_grown_past_float32_names_the_product_and_the_attribute(tmp_path):
    """The same loop under a plain SGD so slow that W stays put (the gradients never reach an
    optimizer's state): ``alpha += rho * h`` passes float32's 3.4e38 at step 74 while Python
    still holds it; ``self.alpha * h`` is +inf in the loss. The replay names that product and,
    rather than a mask constant written for float32 or the learning rate the gradient-norm
    jumps suggest, the loss's attribute and its cap."""
    ev, bundle = fire(train_notears, "make_notears", tmp_path, steps=200, sgd=1e-30)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (74, "loss", "<loss>",
                                                                   "+inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"]) == (
        True, "<loss>", "aten.mul", "+inf"), o
    assert o["source"] == line_of("0.5 * self.rho * h * h"), o
    assert rep["cause"] == "overflow", rep
    hint = rep["hint"]
    assert hint.startswith("the loss's attribute alpha is 3.67e+50") and "rho_max" in hint, hint
    assert "learning rate" not in hint.replace("rather than change the learning rate", ""), hint


def test_capped_rho_raises_nothing_and_trains_the_same(tmp_path):
    """The same loop with NOTEARS' ``rho_max = 1e16``: no event over 100 steps (rho at the cap,
    alpha growing), and bit-identical weights with and without the recorder."""
    recorded, n = train_notears("make_notears", tmp_path, steps=100, rho_max=1e16)
    plain, _ = train_notears("make_notears", tmp_path, steps=100, rho_max=1e16, record=False)
    assert n == 100 and not list(tmp_path.glob("*.nan"))
    assert torch.equal(recorded.W, plain.W)


def test_golem_constant_node_names_the_log_of_its_zero_residual(tmp_path):
    """A node the sensor logged as a constant is all 0 once centred; GOLEM starts from the
    empty graph, so that node's residual sum of squares is exactly 0 and ``0.5 log(rss)`` is
    -inf at the first step: a loss event, named at the log on its line, a pole (invalid)."""
    ev, bundle = fire(train, "make_golem", tmp_path, data={"constant": 2})
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "loss", "<loss>",
                                                                   "-inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"]) == (
        True, "<loss>", "aten.log", "-inf"), o
    assert o["source"] == line_of("0.5 * torch.log(rss).sum() - logdet"), o
    assert rep["cause"] == "invalid" and "log of 0" in rep["hint"], rep["hint"]


def test_golem_healthy_data_raises_nothing_and_trains_the_same(tmp_path):
    """The same GOLEM-NV fit on data without the constant node: no event, same weights."""
    recorded = train("make_golem", tmp_path)
    plain = train("make_golem", tmp_path, record=False)
    assert not list(tmp_path.glob("*.nan"))
    assert torch.equal(recorded.W, plain.W)


def test_enco_minus_inf_diagonal_raises_nothing_and_trains_the_same(tmp_path):
    """ENCO's ``gamma.masked_fill(eye, -inf)``: every self-loop's sigmoid of -inf is 0 and the
    -inf stays inside the forward, under logistic noise from ``torch.rand``: no event, and the
    recorder changes nothing the step computes (the noise draws included)."""
    recorded = train("make_enco", tmp_path, clip=1.0)
    plain = train("make_enco", tmp_path, clip=1.0, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_dagma_s_lowered_below_the_spectral_radius_names_the_logdet_and_the_domain(tmp_path):
    """DAGMA's outer loop lowers ``s`` to 0.2 at step 160 without checking that ``W`` is
    still inside the new domain: ``0.2 I - W * W`` is no longer an M-matrix, its determinant is
    negative and ``torch.logdet`` is NaN in the model's acyclicity. The replay names the logdet
    on its line, the recorded ``s``, and advises DAGMA's check on the iterate, not slogdet's
    log-absolute value (which would train on a meaningless h)."""
    ev, bundle = fire(train, "make_dagma", tmp_path, lr=0.05, steps=200, s_at={160: 0.2})
    assert (ev["step"], ev["phase"], ev["module"], ev["call"], ev["kind"]) == (
        160, "forward", "", 0, "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "", "aten.logdet", "nan", []), o
    assert o["source"] == line_of("return -torch.logdet(m) + d * math.log(self.s)"), o
    assert rep["cause"] == "invalid", rep
    assert "no longer an M-matrix" in rep["hint"] and "restore the last W" in rep["hint"], rep
    assert any("<root>.s = 0.2" in p for p in rep["problems"]), rep["problems"]


def test_dagma_s_kept_inside_raises_nothing_and_trains_the_same(tmp_path):
    """The same schedule lowering ``s`` only to 0.9 (DAGMA's default first steps): the
    iterate stays an M-matrix, no event, bit-identical weights with and without the recorder."""
    kw = {"lr": 0.05, "steps": 200, "s_at": {160: 0.9}}
    recorded = train("make_dagma", tmp_path, **kw)
    plain = train("make_dagma", tmp_path, record=False, **kw)
    assert not list(tmp_path.glob("*.nan"))
    assert torch.equal(recorded.W, plain.W)


def test_standardised_constant_node_names_the_column_of_the_data(tmp_path):
    """The dataset standardises each centred column by its std, and a node logged as a
    constant has std 0: 0/0 in every row of that column before the model sees it. An input
    event on the batch; the replay names every sample and column 2, the per-feature step of the
    pipeline (a zero std), not a bad record."""
    data = {"constant": 2, "standardise": True}
    ev, bundle = fire(train_notears, "make_notears", tmp_path, steps=10, data=data)
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "input", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["cause"], o["all_samples"], o["batch_size"]) == ("input", True, 64), rep
    assert "column(s) 2" in rep["hint"] and "zero std" in rep["hint"], rep["hint"]


def test_matrix_exp_of_a_diverged_w_is_an_overflow_of_the_diverging_run(tmp_path):
    """A node logged in millimetres among metres (x1000) and plain SGD: the first update throws
    ``W`` to ~1e3, ``W * W`` to ~1e6, and NOTEARS' ``matrix_exp`` overflows at step 1. The
    replay names the matrix exponential on its line, an overflow (no pole: it was reported as
    invalid math at a pole before), the weights' jump in the update before, and the batch's
    column 1 at 1000x the others' scale, to standardise (not only a lower learning rate)."""
    ev, bundle = fire(train_notears, "make_notears", tmp_path, steps=40, sgd=1e-3,
                      data={"scale": {1: 1000.0}})
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (1, "forward", "", "+inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["op"], o["made"], o["samples"]) == (
        True, "aten.linalg_matrix_exp", "+inf", []), o
    assert o["source"] == line_of("torch.trace(torch.linalg.matrix_exp(self.W * self.W)) - d"), o
    assert rep["cause"] == "overflow", rep
    assert "too large for float32 and for float64" in rep["hint"], rep["hint"]
    assert "weights had jumped in the update before step 1" in rep["hint"], rep["hint"]
    assert "column(s) 1 of batch reach" in rep["hint"] and "standardise" in rep["hint"], rep


def test_enco_temperature_annealed_to_zero_names_the_division_backward(tmp_path):
    """ENCO's Gumbel-sigmoid temperature annealed to 0 (``tau`` 0.5 at step 4, 0 at 6): the
    forward's ``sigmoid(+-inf)`` is a hard 0/1 mask and stays finite, but the division's
    backward is ``inf * 0``: NaN gradients of ``gamma`` in every sample. The replay names
    ``DivBackward0`` on the mask's line, ``gamma``, the recorded ``tau = 0.0``, and a scalar
    set to 0 as the cause."""
    ev, bundle = fire(train, "make_enco", tmp_path, clip=1.0, tau_at={4: 0.5, 6: 0.0})
    assert (ev["step"], ev["phase"], ev["kind"]) == (6, "backward", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["op"], o["param"], o["all_samples"]) == (
        True, "DivBackward0", "gamma", True), o
    assert o["source"] == line_of("mask = torch.sigmoid((gamma + logistic) / self.tau)"), o
    assert rep["cause"] == "invalid" and "temperature" in rep["hint"], rep["hint"]
    assert "constant exactly 0" in rep["hint"], rep["hint"]
    assert any("<root>.tau = 0.0" in p for p in rep["problems"]), rep["problems"]

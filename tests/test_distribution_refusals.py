"""End to end: a ``torch.distributions`` check refusing a value made on the model's own lines
(``refusal_models``: a set VAE pooling its posterior heads by a mask in ``forward``), trained
under the recorder: the ``constraint`` event writes the bundle (before, the ``ValueError``
went to the loop with nothing written), and the replay names the op that made the value and
why (was: "replay failed (ValueError: ...)")."""

from __future__ import annotations

from pathlib import Path

import pytest
import refusal_models as M
import torch
from bundles import line_number, nanreplay_json

from recorder import FlightRecorder

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> int:
    return line_number("refusal_models.py", text)


def train(out_dir, scale: str = "softplus", steps: int = 5, at: int = 3, **bad):
    """Train until the distribution refuses; returns the ValueError the loop got."""
    model = M.make_set_vae(scale)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError) as info:
        with FlightRecorder(model, opt, loss_fn=M.set_vae_loss, out_dir=out_dir,
                            factory="refusal_models:make_set_vae",
                            factory_kwargs={"scale": scale}) as rec:
            for step in range(steps):
                x, m, target = M.batch(g, **(bad if step == at else {}))
                loss = rec.loss_fn(model(x, m), target)
                opt.zero_grad()
                loss.backward()
                opt.step()
    return info.value


def bundle_of(err: ValueError) -> Path:
    notes = "\n".join(getattr(err, "__notes__", []))
    assert "refused its parameter" in notes, notes  # the recorder's note on the loop's error
    return Path(notes.split("Bundle: ")[1].split(";")[0])


def test_an_empty_set_pooled_0_by_0_is_named_at_the_roots_own_line(tmp_path):
    err = train(tmp_path, empty=6)
    assert "Expected parameter loc" in str(err)
    rep = nanreplay_json(bundle_of(err))
    o = rep["origin"]
    assert rep["event"]["step"] == 3
    assert "Normal refused its parameter loc" in rep["event"]["detail"], rep["event"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "invalid", "", "aten.div", "nan", [6]), rep
    assert o["source"] == f"refusal_models.py:{line_of('mu = (self.mu(h) * w)')}"
    assert "refused its parameter loc (constraint Real())" in " ".join(rep["problems"])


def test_a_raw_linear_output_as_a_scale_is_invalid_and_named_by_its_maker(tmp_path):
    err = train(tmp_path, scale="raw", at=0)
    rep = nanreplay_json(bundle_of(err))
    o = rep["origin"]
    assert (rep["event"]["step"], rep["cause"], o["phase"], o["op"]) == (
        0, "invalid", "forward", "aten.div"), rep
    assert o["source"] == f"refusal_models.py:{line_of('s = (self.s(h) * w)')}"
    assert float(o["made"]) < 0 and o["samples"], rep
    assert "in float64 too" in rep["hint"] and "softplus or exp" in rep["hint"], rep["hint"]


def test_a_softplus_rounded_to_0_is_underflow(tmp_path):
    # one set out of scale drives its pooled pre-activation far below 0: softplus of it is
    # 0 in float32, positive in float64
    err = train(tmp_path, scale_of={2: -3e3})
    rep = nanreplay_json(bundle_of(err))
    o = rep["origin"]
    assert (rep["event"]["step"], rep["cause"], o["op"], o["made"]) == (
        3, "underflow", "aten.softplus", "0"), rep
    assert o["source"] == f"refusal_models.py:{line_of('F.softplus(s)')}"
    assert 2 in o["samples"], rep
    assert "float64 keeps them above 0" in rep["hint"] and "floor" in rep["hint"], rep["hint"]
    assert "out of scale" in rep["hint"] and "--try drop=2" in rep["hint"], rep["hint"]


def test_healthy_sets_train_without_an_event(tmp_path):
    model = M.make_set_vae()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with FlightRecorder(model, opt, loss_fn=M.set_vae_loss, out_dir=tmp_path) as rec:
        for _ in range(5):
            x, m, target = M.batch(g)
            loss = rec.loss_fn(model(x, m), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert not list(tmp_path.glob("*.nan"))


def test_a_refusal_in_a_no_grad_rollout_is_an_evaluation_event(tmp_path):
    """A policy's rollout under ``torch.no_grad()`` (an evaluation forward between steps) meets
    an agent with no available action: every logit masked to -inf, ``Categorical`` refuses
    the NaN its normalisation made. Before, the ValueError reached the loop with no bundle
    (the evaluation's statistics were finite, and only a non-finite one fired there)."""
    policy = M.make_policy()
    opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError) as info:
        with FlightRecorder(policy, opt, out_dir=tmp_path, factory="refusal_models:make_policy"):
            for step in range(4):
                obs, avail = torch.randn(8, 6, generator=g), torch.ones(8, 4)
                if step == 2:
                    avail[5] = 0  # a dead agent: no action left
                with torch.no_grad():
                    actions = policy(obs, avail).probs.argmax(-1)
                loss = -policy(obs, torch.ones(8, 4)).log_prob(actions).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    rep = nanreplay_json(bundle_of(info.value))
    o = rep["origin"]
    assert (rep["event"]["step"], rep["event"]["evaluation"]) == (2, True), rep["event"]
    assert (rep["reproduced"], rep["cause"], o["phase"], o["op"], o["samples"]) == (
        True, "invalid", "forward", "aten.sub", [5]), rep
    assert o["source"] == f"refusal_models.py:{line_of('return Categorical(logits=logits)')}"

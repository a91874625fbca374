"""Diffusion and flow models as their community writes them (``diffusion_models``), end to
end: the recorder on the training loop, then ``nanreplay --json`` on its bundle. The noise and
the timesteps are drawn inside the step, so the replay must draw the same ones, and name the
samples whose timestep was at the edge of the schedule."""

from __future__ import annotations

import json
from pathlib import Path

import diffusion_models as D
import pytest
import torch
from bundles import invoke_cli

from recorder import FlightRecorder, NonFiniteError

HERE = Path(__file__).parent
BATCH = 16


@pytest.fixture(autouse=True)
def _from_tests_dir(monkeypatch):
    monkeypatch.chdir(HERE)  # diffusion_models.py is trusted here


def report(bundle) -> dict:
    r = invoke_cli(bundle, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def train_diffusion(out_dir: Path, steps: int = 12, **kw) -> NonFiniteError:
    torch.manual_seed(0)
    model = D.make_diffusion(**kw)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4)
    data = torch.randn(64, 1, 8, 8)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True)
    with pytest.raises(NonFiniteError) as info, \
            FlightRecorder(model, opt, out_dir=out_dir, factory="diffusion_models:make_diffusion",
                           factory_kwargs=kw):
        for _ in range(steps // len(loader)):
            for x0 in loader:
                opt.zero_grad()
                model(x0).backward()
                opt.step()
    return info.value


def first_terminal_timesteps(seed: int) -> tuple[int, list[int]]:
    """The first step whose timesteps, drawn from a generator seeded ``seed`` as the model
    draws them, hold the last one, and the samples that drew it."""
    g = torch.Generator().manual_seed(seed)
    for step in range(100):
        t = torch.randint(0, D.T, (BATCH,), generator=g)
        torch.randn(BATCH, 1, 8, 8, generator=g)
        if (t == D.T - 1).any():
            return step, (t == D.T - 1).nonzero().flatten().tolist()
    raise AssertionError("no terminal timestep drawn")


def test_noise_drawn_from_the_models_own_generator_is_drawn_again(tmp_path):
    """``torch.randint(..., generator=self.gen)`` in the forward: the replay's factory made a
    generator freshly seeded, so without the recorded state it drew other timesteps, ran
    finite and called the step nondeterministic."""
    step, samples = first_terminal_timesteps(1234)
    err = train_diffusion(tmp_path, seed=1234)
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (step, "forward", "")
    rep = report(err.bundle_path)
    assert rep["reproduced"] is True, json.dumps(rep, indent=1)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("", "aten.div", samples, "invalid"), json.dumps(rep, indent=1)

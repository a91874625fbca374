"""The replay checks that the factory rebuilt the model that trained.

``fidelity_models.make_scaled_net`` reads a global that the training script sets from its
command line (``--scale 0.5``). Recorded in one process and replayed in another, as users do
(``python -m replay BUNDLE --json`` in a fresh interpreter), the factory builds the default
model: the replay says the rebuilt model differs (first at module ``scale``), falls back to what
the recorder saw and guesses no cause. ``factory_kwargs`` recorded with the run, or
``--factory-kwargs`` on the command line, give the factory the setting back.

Each test's first replay runs in a fresh interpreter; the ones after it (the setting handed
back, the text report) run in this process with ``CONFIG`` put back at its defaults, which is
what a fresh interpreter sees, without paying for another one.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import fidelity_models as FM
import pytest
import replay_models as R
import torch
from bundles import invoke_cli, nanreplay_json, one_error_line, source_line
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle

HERE = Path(__file__).parent
K = 3


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def train(out_dir: Path, monkeypatch, factory: str = "make_scaled_net",
          flag=("scale", 0.5), **rec_kwargs) -> Path:
    """The training script run with ``--scale 0.5`` (``flag``); sample 5 of step K is scaled
    up, so the log in ``act`` gets a negative input."""
    monkeypatch.setitem(FM.CONFIG, *flag)  # what argparse would have set
    model = getattr(FM, factory)()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory=f"fidelity_models:{factory}", **rec_kwargs):
            for step in range(6):
                x, y = R.batch(step)
                if step == K:
                    x[5] *= 100.0
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (K, "forward", "act", [5])
    return info.value.bundle_path


def nanreplay(bundle: Path, *args: str) -> subprocess.CompletedProcess:
    """``nanreplay`` in a fresh interpreter, from the project root (this directory)."""
    return subprocess.run([sys.executable, "-m", "replay", str(bundle), *args], cwd=HERE,
                          capture_output=True, text=True, timeout=300)


def in_fresh_config(monkeypatch) -> None:
    """``FM.CONFIG`` at its defaults, as a fresh interpreter has it: the replays after a test's
    first (which runs in a fresh interpreter) run in this process and see what it would."""
    for key, value in {"scale": 1.0, "sqrt_features": True, "hidden": R.HIDDEN}.items():
        monkeypatch.setitem(FM.CONFIG, key, value)


def as_json(proc: subprocess.CompletedProcess) -> dict:
    assert proc.stderr == "", proc.stderr
    return json.loads(proc.stdout)


def log_line() -> str:
    lines, start = __import__("inspect").getsourcelines(R.ShiftedLog)
    return f"replay_models.py:{start + next(i for i, t in enumerate(lines) if 'torch.log' in t)}"


def test_a_factory_building_another_model_is_caught_and_factory_kwargs_fix_it(tmp_path,
                                                                              monkeypatch):
    bundle = train(tmp_path, monkeypatch)
    proc = nanreplay(bundle, "--json")
    rep = as_json(proc)
    fid = rep["fidelity"]
    assert (fid["matches"], fid["module"], fid["call"], fid["micro_batch"], fid["difference"]) \
        == (False, "scale", 0, 0, "values differ")
    # the re-run's scale is the default 1.0: twice the recorded values
    assert math.isclose(fid["rerun"]["min"], 2 * fid["recorded"]["min"], rel_tol=1e-5)
    assert math.isclose(fid["rerun"]["max"], 2 * fid["recorded"]["max"], rel_tol=1e-5)
    o = rep["origin"]  # what the recorder saw, not a confident origin from another model
    assert (o["phase"], o["module"], o["call"], o["samples"], o["op"], o["source"]) == (
        "forward", "act", 0, [5], None, None)
    assert (rep["reproduced"], rep["cause"], proc.returncode) == (False, None, 1)
    in_fresh_config(monkeypatch)
    text = invoke_cli(bundle)
    assert text.exit_code == 1
    [line] = [s for s in text.stdout.splitlines() if s.startswith("  fidelity")]
    assert line.startswith("  fidelity   'scale' (call 0, micro-batch 0) gave [")
    assert "the factory builds a different model than the one recorded" in line
    assert "it builds scale.value = 1.0 (the run had 0.5)" in line
    assert "factory_kwargs" in line and "--factory-kwargs" in line
    # the setting handed back on the command line: the same model, the op named
    rep = nanreplay_json(bundle, "--factory-kwargs", '{"scale": 0.5}', code=0)
    assert rep["fidelity"]["matches"] is True and rep["fidelity"]["calls"] > 0
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], o["source"]) == (
        "forward", "act", "aten.log", [5], log_line())
    assert (rep["reproduced"], rep["cause"]) == (True, "invalid")


def test_code_that_never_ran_in_training_is_not_blamed(tmp_path, monkeypatch):
    """Trained with ``--no-sqrt-features``; the factory's default adds a sqrt before ``act``,
    which the re-run would blame (NaN of a negative feature) although it never ran."""
    bundle = train(tmp_path, monkeypatch, "make_optional_sqrt_net", ("sqrt_features", False))
    rep = as_json(nanreplay(bundle, "--json"))
    fid = rep["fidelity"]
    assert (fid["matches"], fid["module"], fid["difference"], fid["recorded"]) == (
        False, "sqrt", "did not run in training", None)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["reproduced"], rep["cause"]) == (
        "act", None, [5], False, None)
    in_fresh_config(monkeypatch)
    rep = nanreplay_json(bundle, "--factory-kwargs", '{"sqrt_features": false}', code=None)
    assert rep["fidelity"]["matches"] is True
    assert (rep["origin"]["module"], rep["origin"]["op"], rep["cause"]) == (
        "act", "aten.log", "invalid")


def test_recorded_factory_kwargs_round_trip(tmp_path, monkeypatch):
    bundle = train(tmp_path, monkeypatch, factory_kwargs={"scale": 0.5})
    meta, _ = read_bundle(bundle)
    assert meta["factory_kwargs"] == {"scale": 0.5}
    info = invoke_cli("--info", bundle)
    assert 'factory fidelity_models:make_scaled_net {"scale": 0.5}' in info.stdout
    proc = nanreplay(bundle, "--json")
    rep = as_json(proc)
    assert rep["fidelity"]["matches"] is True
    assert (rep["origin"]["module"], rep["origin"]["op"], rep["cause"], proc.returncode) == (
        "act", "aten.log", "invalid", 0)
    # --factory-kwargs overrides the recorded ones: the default model again
    in_fresh_config(monkeypatch)
    rep = nanreplay_json(bundle, "--factory-kwargs", '{"scale": 1.0}', code=None)
    assert (rep["fidelity"]["matches"], rep["fidelity"]["module"]) == (False, "scale")


def test_bad_factory_kwargs_are_one_line_errors(tmp_path, monkeypatch):
    model = FM.make_scaled_net()
    with pytest.raises(TypeError, match="FlightRecorder: factory_kwargs must hold JSON values"):
        FlightRecorder(model, out_dir=tmp_path, factory_kwargs={"scale": object()})
    with pytest.raises(TypeError, match="factory_kwargs must be a dict of keyword arguments"):
        FlightRecorder(model, out_dir=tmp_path, factory_kwargs={"not a name": 1})
    bundle = train(tmp_path, monkeypatch)
    line = one_error_line(invoke_cli(bundle, "--factory-kwargs", "{scale: 1}"))
    assert line.startswith("nanreplay: --factory-kwargs '{scale: 1}' is not JSON (")
    line = one_error_line(invoke_cli(bundle, "--factory-kwargs", "[0.5]"))
    assert line.startswith("nanreplay: --factory-kwargs must be a dict of keyword arguments")
    line = one_error_line(invoke_cli(bundle, "--factory-kwargs", '{"depth": 3}'))
    assert "factory 'fidelity_models:make_scaled_net' failed with factory_kwargs" in line


def test_an_evaluation_event_is_checked_against_the_modules_training_called(tmp_path,
                                                                             monkeypatch):
    """An evaluation forward is not in the ring, so its values cannot be compared: the modules
    the recorded training steps called can. Trained with ``--no-sqrt-features``, the factory's
    default model calls ``sqrt``, which no training step did."""
    monkeypatch.setitem(FM.CONFIG, "sqrt_features", False)
    model = FM.make_optional_sqrt_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="fidelity_models:make_optional_sqrt_net"):
            for step in range(4):
                x, y = R.batch(step)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
                model.eval()
                with torch.no_grad():
                    vx, _ = R.batch(100 + step)
                    if step == 2:
                        vx[3] *= 100.0
                    model(vx)
                model.train()
    ev = info.value.event
    assert (ev["evaluation"], ev["module"], ev["samples"]) == (True, "act", [3])
    rep = as_json(nanreplay(info.value.bundle_path, "--json"))
    fid = rep["fidelity"]
    assert (fid["matches"], fid["module"], fid["difference"], fid["basis"]) == (
        False, "sqrt", "did not run in training", "earlier steps")
    assert (rep["origin"]["module"], rep["origin"]["op"], rep["cause"]) == ("act", None, None)
    in_fresh_config(monkeypatch)
    rep = nanreplay_json(info.value.bundle_path, "--factory-kwargs", '{"sqrt_features": false}',
                         code=None)
    assert (rep["fidelity"]["matches"], rep["fidelity"]["basis"]) == (True, "earlier steps")
    assert (rep["origin"]["module"], rep["origin"]["op"], rep["reproduced"]) == (
        "act", "aten.log", True)


def test_a_model_sized_by_a_flag_says_which_run_and_how_to_hand_the_size_back(
        tmp_path, monkeypatch):
    """Trained with ``train.py --hidden 32`` while the factory's default is 8: the weights do
    not fit, which is one line naming the run's command line and --factory-kwargs (it said
    only 'pass --factory MOD:FN', as if another function were needed); with the size handed
    back the replay names the planted log."""
    monkeypatch.setattr(sys, "argv", ["train.py", "--hidden", "32"])
    bundle = train(tmp_path, monkeypatch, factory="make_wide_net", flag=("hidden", 32))
    proc = nanreplay(bundle)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.splitlines() == [
        "nanreplay: weights/lin.weight has shape [32, 4] in the bundle but [8, 4] in the model "
        "from the factory; the factory builds a different model: it cannot see the run's "
        "configuration (command-line flags, config files); the run's command line was "
        "'train.py --hidden 32'. Pass --factory-kwargs '{...}' with the settings that built the "
        "trained model (record them with FlightRecorder(..., factory_kwargs={...})), or "
        "--factory MOD:FN building it"]
    in_fresh_config(monkeypatch)
    rep = nanreplay_json(bundle, "--factory-kwargs", '{"hidden": 32}', code=None)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == ("act", "aten.log", [5],
                                                                   "invalid")


@pytest.mark.parametrize("factory_spectral, message", [
    (False, "the run's model had a parametrization on '0.weight' (spectral_norm, weight_norm, "
            "orthogonal) that the factory's model lacks: the training script added it after the "
            "factory built the model; add it in the factory"),
    (True, "the factory's model has a parametrization on '0.weight' that the run's model did "
           "not (the training script removed it, remove_parametrizations): build the model as "
           "it was trained in the factory")])
def test_a_parametrization_the_factory_lacks_is_named(tmp_path, factory_spectral, message):
    """A GAN script builds the critic with the factory and applies spectral_norm itself (or
    removes the factory's with remove_parametrizations): the bundle's weights are
    ``0.parametrizations.weight.original`` where the factory's are ``0.weight`` (or the other
    way round). The error said the factory could not see the run's configuration and asked for
    --factory-kwargs, which cannot help."""
    model = FM.make_critic(spectral=factory_spectral)
    for layer in (model[0], model[2]):
        if factory_spectral:
            nn.utils.parametrize.remove_parametrizations(layer, "weight")
        else:
            nn.utils.parametrizations.spectral_norm(layer)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=nn.MSELoss(), out_dir=tmp_path,
                            factory="fidelity_models:make_critic",
                            factory_kwargs={"spectral": factory_spectral}):
            for step in range(K + 1):
                x = torch.randn(16, 10)
                x[3, 2] = math.inf if step == K else x[3, 2]
                opt.zero_grad()
                nn.MSELoss()(model(x), torch.zeros(16, 1)).backward()
                opt.step()
    line = one_error_line(invoke_cli(info.value.bundle_path))
    assert line.endswith(message), line


def test_a_sum_rounded_by_the_training_thread_count_is_replayed_with_it(tmp_path):
    """Training ran with one intra-op thread (torchrun's default, ``OMP_NUM_THREADS=1``); the
    replay runs in a shell with four. A CPU sum of 262,144 values is split by threads, so its
    last bit is the thread count's: the count the loss compares it with matches one thread's sum
    exactly (1/0 = inf) and four threads' not. The replay ran with the shell's threads and said
    the event did not come back; it now re-runs with the recorded count and names the
    reciprocal, and puts the shell's count back after."""
    d = torch.rand(1, 512, 512, generator=torch.Generator().manual_seed(0))
    model = FM.make_density_map()
    count = (d * model.gain).sum().detach()  # (conftest: one thread, as the run had)
    torch.set_num_threads(4)
    try:
        assert (d * model.gain).sum() != count  # (the premise: four threads round otherwise)
    finally:
        torch.set_num_threads(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=FM.inverse_count_error, out_dir=tmp_path,
                            factory="fidelity_models:make_density_map") as rec:
            opt.zero_grad()
            rec.loss_fn(model(d), count).backward()
            opt.step()
    torch.set_num_threads(4)
    try:
        rep = nanreplay_json(info.value.bundle_path)
        assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(1)
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["op"], rep["cause"]) == (
        True, "loss", "aten.reciprocal", "precision"), (o, rep["cause"])
    assert o["source"] == source_line("fidelity_models.py",
                                      "return (pred.sum() - count).reciprocal()"), o

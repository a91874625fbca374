"""Two ranks under torchrun that do not do the same thing every step (tests/dist/asym_train.py):
a range test on rank 0 alone, paused; a training metric from a model call with gradients on, on
rank 0 alone; an uneven last batch under a Join entered before the recorder; each rank training
a model of its own for a different number of steps, then gathering the results."""

import json
import re
import sys

import pytest
from bundles import invoke_cli
from test_torchrun import HERE, _launch_modes

MODES = ("lr0-bare", "lr0", "lr0-nan", "metric0", "join-bare", "joininner", "solo-bare", "solo",
         "solo-late")


@pytest.fixture(scope="module")
def asym(tmp_path_factory):
    return _launch_modes(tmp_path_factory, "asym_train.py", *MODES)


@pytest.fixture
def nanreplay(monkeypatch):
    """``nanreplay ARGS`` in this process, from tests/dist, where the bundles' factory lives."""
    monkeypatch.chdir(HERE)
    monkeypatch.setattr(sys, "path", list(sys.path))
    return invoke_cli


def _trained(run) -> dict[str, str]:
    return dict(re.findall(r"rank (\d) no event (trained=\d+(?: weights=\S+)?)", run.stdout))


def test_asymmetric_healthy_runs_train_as_without_the_recorder(asym):
    assert _trained(asym["lr0"]) == _trained(asym["lr0-bare"]), asym["lr0"].stdout
    assert set(_trained(asym["metric0"])) == {"0", "1"}, asym["metric0"].stdout
    for mode in MODES:
        if not mode.endswith(("-nan", "-late")):
            assert not asym[mode].out.exists() or not list(asym[mode].out.iterdir()), mode


def test_a_recorder_inside_join_lets_the_rank_with_fewer_batches_join(asym):
    """``with Join([ddp]), FlightRecorder(ddp):``, rank 1 one batch short. Its recorder's exit
    read met rank 0's Join all-reduce of its last step: the run hung (gloo's 30 min timeout);
    now the Join built before the recorder shadows it too."""
    assert _trained(asym["joininner"]) == _trained(asym["join-bare"]), asym["joininner"].stdout
    assert "trained=5" in _trained(asym["joininner"])["1"]


def test_a_rank_whose_training_ends_first_does_not_hang_the_other(asym):
    """Each rank trains its own model (6 and 4 steps), then all_gather_object. Rank 1's
    detach met rank 0's step exchanges and its gather met rank 0's next: the run hung (gloo's
    30 min timeout); now rank 0 is told at rank 1's detach and checks its steps alone."""
    bare, solo = asym["solo-bare"], asym["solo"]
    gathered = re.findall(r"rank \d gathered (.*)", solo.stdout)
    assert gathered == re.findall(r"rank \d gathered (.*)", bare.stdout) and len(gathered) == 2
    assert "recorder of rank(s) 1 detached while this rank (rank 0) records on" in solo.stderr
    # a NaN on rank 0 after rank 1's recorder detached: found alone, at its step, no wait
    late = asym["solo-late"]
    assert re.findall(r"rank 0 event (step=\d+ phase=\w+)", late.stdout) == ["step=5 phase=input"]
    assert len(re.findall(r"rank \d gathered", late.stdout)) == 2, late.stdout
    assert "did not say their bundle" not in late.stderr


def test_nan_after_a_range_test_on_rank_0_alone_is_found_on_rank_1(asym, nanreplay):
    run = asym["lr0-nan"]
    events = dict(re.findall(r"rank (\d) event (step=\d+ phase=\w+ first=\[[\d, ]*\])",
                             run.stdout))
    assert events == {"0": "step=4 phase=backward first=[1]",
                      "1": "step=4 phase=input first=[1]"}, run.stdout
    rep = nanreplay("--json", run.out / "step00000004-rank0.nan")
    report = json.loads(rep.stdout)
    assert report["bundle"]["rank"] == 1 and report["event"]["step"] == 4, rep.stdout[-2000:]
    assert report["cause"] == "input" and report["origin"]["samples"] == [2]
    assert report["reproduced"] is True

"""A replay with the code edited since the run (recorder.code_identity, replay.edited_code):
the user adds an eps after the NaN, renames or adds a module, or edits something else, then
replays the bundle with `factory="mymodel:make_model"` importing the edited file. An eps that
removes the NaN is a what-if, not nondeterminism; a changed structure is the code's change,
with the run's commit to check out; an unrelated edit changes nothing."""

import importlib
import subprocess
import sys
import uuid

import pytest
import torch
from edited_source import MODEL
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from replay import ReplayError, replay
from replay.report import to_text

BAD_ROW, BAD_STEP = 2, 3  # the constant row the data plants (0/0 in Norm), and its step


EPS = MODEL.replace("/ std", "/ (std + 1e-5)")
RENAMED = MODEL.replace("self.norm", "self.normalize")
ADDED = MODEL.replace("self.fc2 = nn.Linear(16, 3)",
                      "self.fc2 = nn.Linear(16, 3)\n        self.ln = nn.LayerNorm(16)")
UNRELATED = (MODEL.replace("        mean = x.mean", "        # the row's mean\n        mean = x.mean")
             + "\n\ndef evaluate(model, x):\n    return model(x).argmax(dim=1)\n")


def _git(cwd, *args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """The run: the model's file committed in a git repository, trained until the planted row
    makes 0/0 in Norm, its bundle; the module's name, its file and the run's commit."""
    root = tmp_path_factory.mktemp("run")
    mod = f"mymodel_{uuid.uuid4().hex[:8]}"
    (root / f"{mod}.py").write_text(MODEL)
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "commit", "-q", "-m", "run")
    commit = _git(root, "rev-parse", "HEAD")
    mp = pytest.MonkeyPatch()
    mp.chdir(root)
    mp.syspath_prepend(str(root))
    mp.setattr(sys, "dont_write_bytecode", True)
    model = importlib.import_module(mod).make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    with pytest.raises(NonFiniteError) as e, FlightRecorder(
            model, opt, loss_fn=nn.CrossEntropyLoss(), out_dir=root / "b",
            factory=f"{mod}:make_model") as rec:
        for step in range(BAD_STEP + 2):
            x, y = torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)
            if step == BAD_STEP:
                x[BAD_ROW] = 1.5
            opt.zero_grad()
            rec.loss_fn(model(x), y).backward()
            opt.step()
    yield mod, root / f"{mod}.py", commit, e.value.bundle_path
    sys.modules.pop(mod, None)
    mp.undo()


def _replay_with(recorded, source: str):
    mod, path, _, bundle = recorded
    path.write_text(source)
    sys.modules.pop(mod, None)
    importlib.invalidate_caches()
    return replay(bundle)


def test_an_eps_added_since_the_run_is_a_what_if_not_nondeterminism(recorded):
    mod, path, commit, _ = recorded
    r = _replay_with(recorded, EPS)
    assert not r["reproduced"] and r["cause"] == "not_reproduced"
    assert r["edited_code"] == [f"{mod}.Norm edited ({path.name})"]
    o = r["origin"]  # (what the recorder saw, with the run's code)
    assert (o["module"], o["samples"], o["made"]) == ("norm", [BAD_ROW], "nan")
    assert "removes the NaN at this step" in r["hint"] and "random generator" not in r["hint"]
    text = to_text(r)
    assert text.splitlines()[0] == (f"nanreplay: step {BAD_STEP}, forward event — not made "
                                    "again by the edited code")
    assert f"git checkout {commit[:12]}" in text


def test_a_renamed_module_is_said_to_be_the_code_not_the_factory_arguments(recorded):
    mod, path, commit, _ = recorded
    r = _replay_with(recorded, RENAMED)
    assert not r["reproduced"] and r["fidelity"]["code_edited"] == [f"{mod}.Net edited "
                                                                    f"({path.name})"]
    text = to_text(r)
    assert "'normalize' (call 0, micro-batch 0) ran in the re-run but is not in the recorded " \
           "model: the model's code was edited since the run" in text
    assert "factory_kwargs" not in text and f"git checkout {commit[:12]}" in text


def test_an_added_layer_is_one_line_naming_the_edit_and_the_commit(recorded):
    mod, path, commit, _ = recorded
    with pytest.raises(ReplayError) as e:
        _replay_with(recorded, ADDED)
    msg = str(e.value)
    assert "\n" not in msg and "--factory-kwargs" not in msg
    assert f"{mod}.Net edited ({path.name})" in msg and f"git checkout {commit[:12]}" in msg


def test_an_unrelated_edit_replays_as_the_run_with_no_warning(recorded):
    r = _replay_with(recorded, UNRELATED)
    o = r["origin"]
    assert r["reproduced"] and r["cause"] == "invalid" and not r.get("edited_code")
    assert (o["module"], o["op"], o["samples"]) == ("norm", "aten.div", [BAD_ROW])
    assert not any("code differs" in p for p in r["problems"])

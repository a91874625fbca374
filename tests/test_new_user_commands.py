"""The commands a first-time user is told to run work as written.

A beginner's script beside its model module, started from the directory above it (``python
proj/train.py``, ``factory="models:make_model"``, models.py beside the script): the event's
message said ``run `nanreplay runs/...nan```, which from there re-ran nothing ('factory not
imported'), and that report's note said ``pass --factory models:make_model``, which failed to
import just the same. A model recorded without ``factory=`` whose class takes arguments it keeps
nowhere (``Net(hidden)``) was told the bare ``nanreplay PATH`` as well, which re-ran nothing.
The training script given to ``nanreplay`` instead of its bundle was 'no zstd frame'.
"""

from __future__ import annotations

import sys
import textwrap
import uuid

import pytest
import torch
from bundles import invoke_cli, nanreplay_json
from torch import nn

from recorder import FlightRecorder, NonFiniteError

BLANK = 2  # the batch row the plant zeroes: x / x.norm() is 0/0 there
BAD_STEP = 3


def _models() -> str:
    return textwrap.dedent("""\
        import torch
        from torch import nn


        class Net(nn.Module):
            def __init__(self, hidden=8):
                super().__init__()
                self.fc1 = nn.Linear(6, hidden)
                self.fc2 = nn.Linear(hidden, 1)

            def forward(self, x):
                return self.fc2(torch.relu(self.fc1(x / x.norm(dim=1, keepdim=True))))


        def make_model(hidden=8):
            return Net(hidden)
        """)


def _train(model, out_dir, **kw):
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = nn.MSELoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, **kw):
            for step in range(6):
                x, y = torch.randn(4, 6), torch.randn(4, 1)
                if step == BAD_STEP:
                    x[BLANK] = 0.0
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    return info.value


@pytest.fixture
def script_run(tmp_path, monkeypatch):
    """The bundle of ``python proj/train.py`` run in ``tmp_path``: sys.path[0] and argv[0] as
    Python sets them for a script, the factory module beside it."""
    name = f"nu_models_{uuid.uuid4().hex[:10]}"
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / f"{name}.py").write_text(_models())
    monkeypatch.chdir(tmp_path)
    saved = list(sys.path), sys.argv
    sys.path.insert(0, str(proj))
    sys.argv = ["proj/train.py"]
    try:
        mod = __import__(name)
        err = _train(mod.make_model(hidden=5), "runs", factory=f"{name}:make_model",
                     factory_kwargs={"hidden": 5})
    finally:  # (a fresh nanreplay process has neither)
        sys.path[:], sys.argv = saved
        sys.modules.pop(name, None)
    yield name, err


def test_script_beside_its_model_module_is_told_the_cd_that_replays_it(script_run, tmp_path,
                                                                         monkeypatch):
    name, err = script_run
    bundle = f"runs/step{BAD_STEP:08d}-rank0.nan"
    cmd = f"cd proj && nanreplay ../{bundle}"
    assert f"run `{cmd}` (nanreplay imports the factory's module {name} only" in str(err)
    # Where the user is, the bare command re-runs nothing: its note gives the same command.
    r = invoke_cli(bundle)
    assert r.exit_code == 1, r.stdout + r.stderr
    assert f"the run imported {name} from {(tmp_path / 'proj').resolve()}: " in r.stdout, r.stdout
    assert f"run `{cmd}`, or pass --factory proj.{name}:make_model to trust it" in r.stdout
    # Doing either thing it says names the op, the step and the blank row.
    try:
        for where, args in ((tmp_path, [bundle, "--factory", f"proj.{name}:make_model"]),
                            (tmp_path / "proj", [f"../{bundle}"])):
            monkeypatch.chdir(where)
            rep = nanreplay_json(*args)
            assert (rep["event"]["step"], rep["origin"]["op"], rep["origin"]["samples"],
                    rep["cause"]) == (BAD_STEP, "aten.div", [BLANK], "invalid")
    finally:
        sys.modules.pop(f"proj.{name}", None)
        sys.modules.pop("proj", None)


class Net(nn.Module):
    """A beginner's model: its size an argument it keeps nowhere."""

    def __init__(self, hidden):
        super().__init__()
        self.fc1 = nn.Linear(6, hidden)
        self.fc2 = nn.Linear(hidden, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x / x.norm(dim=1, keepdim=True))))


def make_net():
    return Net(5)


def test_model_without_factory_that_needs_arguments_is_told_to_pass_one(tmp_path,
                                                                        monkeypatch):
    monkeypatch.chdir(tmp_path)
    err = _train(Net(5), "nan-bundles")
    bundle = f"nan-bundles/step{BAD_STEP:08d}-rank0.nan"
    assert f"run `nanreplay {bundle} --factory MOD:FN`, MOD:FN a function returning the " \
        "model (Net's constructor takes arguments the bundle does not hold" in str(err)
    rep = nanreplay_json(bundle, "--factory", f"{__name__}:make_net")
    assert (rep["event"]["step"], rep["origin"]["op"], rep["origin"]["samples"]) == \
        (BAD_STEP, "aten.div", [BLANK])


@pytest.mark.parametrize(("file", "kind"), [("train.py", "a Python script"),
                                            ("explore.ipynb", "a notebook")])
def test_training_code_given_instead_of_the_bundle_is_one_line(tmp_path, monkeypatch, file,
                                                               kind):
    monkeypatch.chdir(tmp_path)
    (tmp_path / file).write_text("import torch\n")
    r = invoke_cli(file)
    assert r.exit_code == 2
    assert r.stderr == (f"nanreplay: {file}: {kind}, not a nanreplay bundle; pass the .nan file "
                        "the recorder wrote in its out_dir (nan-bundles/ unless the run gave "
                        "another)\n")


def test_input_event_without_factory_keeps_the_bare_command(tmp_path, monkeypatch):
    """A NaN in the batch is shown from the bundle alone: no factory to ask for."""
    monkeypatch.chdir(tmp_path)
    model = Net(5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 6)
    x[BLANK, 0] = float("nan")
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=nn.MSELoss(), out_dir="nan-bundles"):
            nn.MSELoss()(model(x), torch.randn(4, 1)).backward()
            opt.step()
    assert info.value.event["phase"] == "input"
    assert "run `nanreplay nan-bundles/step00000000-rank0.nan` to find" in str(info.value)
    rep = nanreplay_json("nan-bundles/step00000000-rank0.nan")
    assert (rep["origin"]["phase"], rep["origin"]["samples"]) == ("input", [BLANK])

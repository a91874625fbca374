"""nanreplay used the way notebook users use it: cells typed into a real IPython shell
(``InteractiveShell.run_cell``), the model's class defined in a cell (``__main__``, no file, no
import reaches it), training cells run, re-run and edited, the replay called from the notebook
with ``replay.replay(path, factory=Net)``.

The planted bug: ``Net.forward`` takes ``torch.log`` of the batch's first feature, which is 0
in sample ``BAD_ROW`` of the batch of step ``BAD_STEP`` (a missing value filled with 0): the
log makes -inf there, in the root module, from a finite input, which is the batch's own data.
"""

from __future__ import annotations

import json
import linecache
import re
import subprocess
import sys

import pytest
import torch

IPython = pytest.importorskip("IPython")
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402
from traitlets.config import Config  # noqa: E402

BAD_STEP, BAD_ROW, STEPS = 3, 5, 5

IMPORTS = """\
import torch
from torch import nn
import replay
from recorder import FlightRecorder, NonFiniteError
"""

# line 7 of this cell is the planted bug
NET = """\
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        first = torch.log(x[:, :1])  # the bug: a feature that is 0 in one record
        return self.fc(torch.cat([first, x[:, 1:]], dim=1))
"""
NET_LINE = 7

# the edited class: the log moved to line 8, behind a scale
NET_EDITED = """\
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        scaled = 2.0 * x[:, :1]
        first = torch.log(scaled)  # still no guard against a 0
        return self.fc(torch.cat([first, x[:, 1:]], dim=1))
"""
NET_EDITED_LINE = 8

DATA = f"""\
torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
crit = nn.CrossEntropyLoss()
g = torch.Generator().manual_seed(0)
batches = []
for step in range({STEPS}):
    x = torch.rand(8, 4, generator=g) + 0.5
    if step == {BAD_STEP}:
        x[{BAD_ROW}, 0] = 0.0
    batches.append((x, torch.randint(0, 3, (8,), generator=g)))
"""

LOOP = """\
for x, y in batches:
    opt.zero_grad()
    loss = crit(model(x), y)
    loss.backward()
    opt.step()
"""

TRAIN_WITH = ("with FlightRecorder(model, opt, loss_fn=crit, out_dir=OUT):\n"
              + "".join("    " + line + "\n" for line in LOOP.splitlines()))


@pytest.fixture
def shell(tmp_path, monkeypatch):
    """An in-process IPython shell (history in memory), its cwd ``tmp_path``, a fresh
    namespace, ``OUT`` the bundle directory."""
    monkeypatch.chdir(tmp_path)
    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    for name in ("displayhook", "excepthook"):  # (the shell sets its own; put back after)
        monkeypatch.setattr(sys, name, getattr(sys, name))
    main = sys.modules["__main__"]
    sh = InteractiveShell.instance(config=config)
    sh.reset(new_session=False)
    # a notebook's __main__ is the shell's namespace, with no file (the shell's first start
    # put it there; other tests in this process get pytest's back)
    sys.modules["__main__"] = main
    monkeypatch.setitem(sys.modules, "__main__", sh.user_module)
    sh.user_ns["OUT"] = str(tmp_path / "bundles")
    yield sh
    sh.reset(new_session=False)


def run(shell, code: str, ok: bool = True):
    result = shell.run_cell(code, store_history=True)
    assert result.success is ok, result.error_in_exec or result.error_before_exec
    return result


def cell_name(shell, code: str) -> str:
    """Run ``code`` as a cell and return the name linecache knows it by."""
    number = shell.execution_count
    run(shell, code)
    [name] = [f for f in linecache.cache if f.startswith(f"<ipython-input-{number}-")]
    return name


def hooks(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Every module, parameter and optimizer hook on ``model`` and ``opt``."""
    n = sum(len(d) for m in model.modules() for d in (
        m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks))
    n += sum(len(p._backward_hooks or {}) + len(getattr(p, "_post_accumulate_grad_hooks", None)
                                              or {}) for p in model.parameters())
    return n + len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks)


def assert_planted(rep: dict, source: str, line: int, code: str) -> None:
    o = rep["origin"]
    assert (rep["reproduced"], rep["not_rerun"], rep["event"]["step"]) == (True, None, BAD_STEP)
    assert (o["phase"], o["module"], o["op"], o["samples"], o["made"]) == (
        "forward", "", "aten.log", [BAD_ROW], "-inf"), o
    assert o["input_range"][0] == 0.0 and o["inputs_finite"], o
    assert rep["cause"] == "invalid", rep["cause"]
    assert o["source"] == f"{source}:{line}", o["source"]
    assert rep["source_lines"][o["source"]] == code.splitlines()[line - 1], rep["source_lines"]


def test_a_class_defined_in_a_cell_is_replayed_from_the_notebook(shell, tmp_path):
    run(shell, IMPORTS)
    net_cell = cell_name(shell, NET)
    run(shell, DATA)
    result = run(shell, TRAIN_WITH, ok=False)
    err = result.error_in_exec
    assert type(err).__name__ == "NonFiniteError" and err.event["step"] == BAD_STEP, err
    bundle = err.bundle_path
    assert bundle.parent == tmp_path / "bundles"
    shell.user_ns["bundle"] = str(bundle)
    run(shell, "rep = replay.replay(bundle, factory=Net)")
    assert_planted(shell.user_ns["rep"], net_cell, NET_LINE, NET)
    from replay.report import to_text

    [source] = [line for line in to_text(shell.user_ns["rep"]).splitlines()
                if line.startswith("  source ")]  # the cell's own line, as the user typed it
    assert source.split() == ["source", f"{net_cell}:{NET_LINE}",
                              *NET.splitlines()[NET_LINE - 1].split()], source

    # the command line, from the notebook's directory, cannot import the notebook's class
    cli = subprocess.run([sys.executable, "-m", "replay", "--json", str(bundle)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert cli.returncode == 1, cli.stderr
    rep = json.loads(cli.stdout)
    assert rep["not_rerun"] == "factory not imported"
    [note] = [p for p in rep["problems"] if "no model factory" in p]
    assert "\n" not in note and note.endswith("replay.replay(path, factory=Net)"), note


def test_the_error_in_the_notebook_says_to_replay_from_the_notebook(shell):
    """The NonFiniteError's message points at what works for a class defined in a cell:
    ``replay.replay(path, factory=Net)`` here, not the command line, which cannot import it."""
    for code in (IMPORTS, NET, DATA):
        run(shell, code)
    err = run(shell, TRAIN_WITH, ok=False).error_in_exec
    path = str(err.bundle_path)
    assert f"Bundle: {path};" in str(err), err
    assert f"replay.replay({path!r}, factory=Net)" in str(err), err
    assert f"run `nanreplay {path}`" not in str(err), err


def test_a_training_cell_run_again_records_again(shell):
    for code in (IMPORTS, NET, DATA):
        run(shell, code)
    model, opt = shell.user_ns["model"], shell.user_ns["opt"]
    assert hooks(model, opt) == 0
    paths = []
    for _ in range(2):
        err = run(shell, TRAIN_WITH, ok=False).error_in_exec
        assert type(err).__name__ == "NonFiniteError", err
        assert hooks(model, opt) == 0  # the with block detached the recorder
        paths.append(err.bundle_path)
        # the event stopped the loop before the update: each run fires at its own BAD_STEP
        assert err.event["step"] == BAD_STEP and err.event["samples"] == [BAD_ROW], err.event
    assert paths[0] != paths[1] and all(p.exists() for p in paths), paths
    assert sorted(p.name for p in paths[0].parent.iterdir()) == [
        f"step{BAD_STEP:08d}-rank0-1.nan", f"step{BAD_STEP:08d}-rank0.nan"]
    shell.user_ns["bundle"] = str(paths[1])
    run(shell, "rep = replay.replay(bundle, factory=Net)")
    rep = shell.user_ns["rep"]
    assert rep["reproduced"] and rep["origin"]["samples"] == [BAD_ROW], rep["origin"]


def test_an_attach_cell_run_again_detaches_the_first_recorder(shell):
    """``recorder = FlightRecorder(...).attach()`` run twice: the second warns once and takes
    over; the model carries one recorder's hooks, and the event is written once."""
    for code in (IMPORTS, NET, DATA):
        run(shell, code)
    model, opt = shell.user_ns["model"], shell.user_ns["opt"]
    attach = "recorder = FlightRecorder(model, opt, loss_fn=crit, out_dir=OUT).attach()"
    run(shell, attach)
    one = hooks(model, opt)
    assert one > 0
    with pytest.warns(UserWarning, match="already had a FlightRecorder attached") as warned:
        run(shell, attach)
    assert len(warned) == 1 and hooks(model, opt) == one
    err = run(shell, LOOP, ok=False).error_in_exec
    assert type(err).__name__ == "NonFiniteError" and err.event["step"] == BAD_STEP, err
    assert [p.name for p in err.bundle_path.parent.iterdir()] == [err.bundle_path.name]
    run(shell, "recorder.detach()")
    assert hooks(model, opt) == 0


def test_a_redefined_class_is_replayed_with_its_new_code(shell):
    for code in (IMPORTS, NET, DATA):
        run(shell, code)
    run(shell, TRAIN_WITH, ok=False)
    edited = cell_name(shell, NET_EDITED)  # the user edits the class cell and runs it again
    run(shell, DATA)
    err = run(shell, TRAIN_WITH, ok=False).error_in_exec
    shell.user_ns["bundle"] = str(err.bundle_path)
    run(shell, "rep = replay.replay(bundle, factory=Net)")
    assert_planted(shell.user_ns["rep"], edited, NET_EDITED_LINE, NET_EDITED)


def test_an_event_in_a_training_cell_is_the_cells_error(shell):
    """No ``with``: attach in one cell, train in later ones, detach in another. The event is
    the training cell's error; later cells run; the detach leaves no hook."""
    for code in (IMPORTS, NET, DATA):
        run(shell, code)
    model, opt = shell.user_ns["model"], shell.user_ns["opt"]
    run(shell, "recorder = FlightRecorder(model, opt, loss_fn=crit, out_dir=OUT).attach()")
    run(shell, f"for x, y in batches[:{BAD_STEP}]:\n"
               + "".join("    " + line + "\n" for line in LOOP.splitlines()[1:]))
    err = run(shell, f"for x, y in batches[{BAD_STEP}:]:\n"
                     + "".join("    " + line + "\n" for line in LOOP.splitlines()[1:]),
              ok=False).error_in_exec
    assert type(err).__name__ == "NonFiniteError", err
    path = str(err.bundle_path)
    assert re.match(rf"nanreplay: non-finite value \((?:\+Inf|-Inf|NaN)\) at step {BAD_STEP}, "
                    r"phase forward\. First made by module '<root>' \(__main__\.Net, call 0",
                    str(err)), err
    assert f"Bundle: {path}" in str(err), err
    run(shell, "print(recorder.bundle_path)")
    run(shell, "recorder.detach()")
    assert hooks(model, opt) == 0

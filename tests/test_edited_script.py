"""The model's classes defined in the training script itself, run as `python train.py` (module
``__main__``), edited before the replay (recorder.code_identity keys them by the name the
replay imports the script as): an eps added after the crash is a what-if naming the class and
the file, a renamed module is the code's change, an edit of the training loop below the model
is no edit of the model, an eps in the script's own loss function is that function's edit
(and the +Inf it made is called so, not a NaN). A notebook's class (a ``__main__`` without a
file) gets no key, so no note."""

import importlib
import runpy
import sys
import types
import uuid

import pytest
import torch
from edited_source import MODEL
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from replay import replay
from replay.load import read_step
from replay.report import to_text

BAD_ROW, BAD_STEP = 2, 3  # the constant row the loop plants (0/0 in Norm), and its step


LOOP = f'''

def main():
    from recorder import FlightRecorder
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    with FlightRecorder(model, opt, loss_fn=nn.CrossEntropyLoss(), out_dir="b",
                        factory=__FACTORY__) as rec:
        for step in range({BAD_STEP + 2}):
            x, y = torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)
            if step == {BAD_STEP}:
                x[{BAD_ROW}] = 1.5
            opt.zero_grad()
            loss = rec.loss_fn(model(x), y)
            loss.backward()
            opt.step()


if __name__ == "__main__":
    main()
'''

SCRIPT = MODEL + LOOP
EPS = SCRIPT.replace("/ std", "/ (std + 1e-5)")
RENAMED = SCRIPT.replace("self.norm", "self.normalize")
LOOP_EDITED = SCRIPT.replace("            opt.step()\n",
                             "            opt.step()\n            print(step, loss.item())\n")
# the loss of the script's own: a sum over the labels' sum, planted all 0 at BAD_STEP (+Inf)
LOSS_SCRIPT = SCRIPT.replace("def make_model():", """def my_loss(out, y):
    return nn.functional.cross_entropy(out, y, reduction="sum") / y.sum()


def make_model():""").replace("loss_fn=nn.CrossEntropyLoss()", "loss_fn=my_loss").replace(
    f"x[{BAD_ROW}] = 1.5", "y[:] = 0")
LOSS_EPS = LOSS_SCRIPT.replace("/ y.sum()", "/ (y.sum() + 1e-5)")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    yield from _run(tmp_path_factory, SCRIPT)


@pytest.fixture(scope="module")
def recorded_loss(tmp_path_factory):
    yield from _run(tmp_path_factory, LOSS_SCRIPT)


def _run(tmp_path_factory, script: str):
    """`python train_x.py` run to its event, as Python runs a script (runpy: its classes are
    ``__main__``'s, its directory first on the path), and its bundle; the replays import the
    script as ``train_x`` from there."""
    root = tmp_path_factory.mktemp("run")
    mod = f"train_{uuid.uuid4().hex[:8]}"
    path = root / f"{mod}.py"
    path.write_text(script.replace("__FACTORY__", repr(f"{mod}:make_model")))
    mp = pytest.MonkeyPatch()
    mp.chdir(root)
    mp.syspath_prepend(str(root))
    mp.setattr(sys, "dont_write_bytecode", True)
    with pytest.raises(NonFiniteError) as e:
        runpy.run_path(str(path), run_name="__main__")
    yield mod, path, e.value.bundle_path
    sys.modules.pop(mod, None)
    mp.undo()


def _replay_with(recorded, source: str):
    mod, path, bundle = recorded
    path.write_text(source.replace("__FACTORY__", repr(f"{mod}:make_model")))
    sys.modules.pop(mod, None)
    importlib.invalidate_caches()
    return replay(bundle)


def test_an_eps_added_in_the_script_is_a_what_if_naming_the_class_and_file(recorded):
    mod, path, _ = recorded
    r = _replay_with(recorded, EPS)
    assert not r["reproduced"] and r["cause"] == "not_reproduced"
    assert r["edited_code"] == [f"{mod}.Norm edited ({path.name})"]
    o = r["origin"]
    assert (o["module"], o["samples"], o["made"]) == ("norm", [BAD_ROW], "nan")
    assert to_text(r).splitlines()[0] == (f"nanreplay: step {BAD_STEP}, forward event — not "
                                          "made again by the edited code")


def test_a_module_renamed_in_the_script_is_the_codes_change(recorded):
    mod, path, _ = recorded
    r = _replay_with(recorded, RENAMED)
    assert not r["reproduced"]
    assert r["fidelity"]["code_edited"] == [f"{mod}.Net edited ({path.name})"]
    text = to_text(r)
    assert "'normalize' (call 0, micro-batch 0) ran in the re-run but is not in the recorded " \
           "model: the model's code was edited since the run" in text
    assert "factory_kwargs" not in text


def test_an_edit_of_the_scripts_training_loop_is_no_edit_of_the_model(recorded):
    r = _replay_with(recorded, LOOP_EDITED)
    o = r["origin"]
    assert r["reproduced"] and r["cause"] == "invalid" and not r.get("edited_code")
    assert (r["event"]["step"], o["module"], o["op"], o["samples"]) == (
        BAD_STEP, "norm", "aten.div", [BAD_ROW])
    assert not any("code differs" in p for p in r["problems"])


def test_an_eps_added_to_the_scripts_loss_function_names_it_and_the_inf(recorded_loss):
    mod, path, _ = recorded_loss
    r = _replay_with(recorded_loss, LOSS_EPS)
    assert not r["reproduced"] and r["cause"] == "not_reproduced"
    assert r["edited_code"] == [f"{mod}.my_loss edited ({path.name})"]
    assert (r["event"]["step"], r["origin"]["module"], r["origin"]["made"]) == (
        BAD_STEP, "<loss>", "+inf")
    assert "the edit (see the note) removes the +Inf at this step" in r["hint"]


def test_a_notebook_class_has_no_key_and_no_note(tmp_path, monkeypatch):
    """A notebook's cell: ``__main__`` without a file; the replay is given the factory."""
    main = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", main)
    exec(compile(MODEL, "<cell>", "exec"), vars(main))
    model = main.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    with pytest.raises(NonFiniteError) as e, FlightRecorder(
            model, opt, loss_fn=nn.CrossEntropyLoss(), out_dir=tmp_path) as rec:
        for step in range(BAD_STEP + 2):
            x, y = torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)
            if step == BAD_STEP:
                x[BAD_ROW] = 1.5
            opt.zero_grad()
            rec.loss_fn(model(x), y).backward()
            opt.step()
    assert "code" not in read_step(e.value.bundle_path).meta  # (no name to import it by)
    r = replay(e.value.bundle_path, factory=main.make_model)
    o = r["origin"]
    assert r["reproduced"] and r["cause"] == "invalid" and not r.get("edited_code")
    assert (r["event"]["step"], o["module"], o["op"], o["samples"]) == (
        BAD_STEP, "norm", "aten.div", [BAD_ROW])
    assert not any("code differs" in p for p in r["problems"])

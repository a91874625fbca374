"""``replay.replay`` from a notebook or script, as the ``nanreplay`` command's equal: the run's
out_dir taken as the bundle, every option an argument, its errors one ``ReplayError`` /
``BundleError`` line in the words of its arguments (``factory=``, not ``--factory MOD:FN``).

Before: ``replay.replay("nan-bundles")`` failed with ``cannot open (Is a directory)``; a class
that needs arguments said ``pass --factory MOD:FN (and --factory-kwargs)``; ``tries=["bogus"]``
was ignored, ``device="gpu"``, ``factory=42`` and ``factory_kwargs=[8]`` raised torch's or
Python's own exceptions from inside the replay; no ``html``, ``--info`` or ``--strip`` there."""

from __future__ import annotations

import json
import re

import pytest
import torch
from bundles import invoke_cli
from torch import nn

import replay
from recorder import FlightRecorder, NonFiniteError

BAD_STEP, BAD_ROW, WIDTH = 2, 3, 8
# an option of the command line named in a message of the Python API
CLI_WORD = re.compile(r"--(factory|try|device|debug|html|info|strip|json)\b|nanreplay \S+ --")


class Net(nn.Module):
    """Takes an argument the bundle does not hold, so the replay needs ``factory_kwargs``."""

    def __init__(self, width):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, width), nn.Linear(width, 1)

    def forward(self, x):
        keep = (x[:, :1] != 7).float()  # the plant: a row whose first feature is 7 logs 0
        return self.fc2(torch.log(self.fc1(x).abs() * keep))


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    """The out_dir of a run whose step BAD_STEP's row BAD_ROW makes log(0)."""
    out = tmp_path_factory.mktemp("api") / "nan-bundles"
    torch.manual_seed(0)
    model, criterion = Net(WIDTH), nn.MSELoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(NonFiniteError):
        with FlightRecorder(model, opt, loss_fn=criterion, out_dir=out):
            for step in range(4):
                x, y = torch.randn(8, 4), torch.randn(8, 1)
                if step == BAD_STEP:
                    x[BAD_ROW, 0] = 7.0
                loss = criterion(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
    return out


def _words_of(report) -> str:
    return json.dumps({k: v for k, v in report.items() if k not in ("history", "source_lines")})


def test_the_out_dir_replays_to_the_plant_with_every_option(out_dir, tmp_path):
    page = tmp_path / "report.html"
    report = replay.replay(out_dir, factory=Net, factory_kwargs={"width": WIDTH},
                           tries="auto", html=page)
    assert report["event"]["step"] == BAD_STEP and report["reproduced"]
    o = report["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"]) == (
        "forward", "", "aten.log", [BAD_ROW])  # ("": the root module, whose forward logs)
    assert report["cause"] == "invalid"
    assert [t["try"] for t in report["what_if"]] == [f"drop={BAD_ROW}"]
    assert report["what_if"][0]["finite"]
    assert page.read_text().startswith("<!DOCTYPE html>")
    assert not CLI_WORD.search(_words_of(report)), _words_of(report)
    # the command's outputs, from the API's report
    bundle = next(out_dir.glob("*.nan"))
    cli = invoke_cli(bundle, "--factory", "test_replay_python_api:Net",
                     "--factory-kwargs", json.dumps({"width": WIDTH}), "--try", "auto")
    assert replay.report_text(report).splitlines() == cli.stdout.splitlines()
    assert json.loads(replay.report_json(report))["origin"]["samples"] == [BAD_ROW]


def test_info_and_strip_have_their_functions(out_dir, tmp_path):
    info = replay.bundle_info(out_dir)
    assert info["event"]["step"] == BAD_STEP and info["stripped"] == []
    written = replay.strip_bundle(out_dir, tmp_path / "share.nan", ["batch"])
    assert replay.bundle_info(written[0])["stripped"] == ["batch"]
    with pytest.raises(replay.ReplayError, match=r"^parts=\['data'\]: strip_bundle removes"):
        replay.strip_bundle(out_dir, tmp_path / "x.nan", ["data"])


@pytest.mark.parametrize("kwargs, said", [
    ({"factory": Net}, "pass factory= (and factory_kwargs=) that builds the recorded model"),
    ({"factory": Net, "factory_kwargs": {"width": WIDTH}, "tries": ["bogus"]},
     "tries=['bogus']: expected KEY=VALUE"),
    ({"factory": Net, "factory_kwargs": {"width": WIDTH}, "tries": ["lr[5]=1"]},
     'tries=["lr[5]=1"]: the optimizer has 1 parameter group'),
    ({"device": "gpu"}, "device='gpu' is not a device the replay runs on"),
    ({"factory": 42}, "factory=42 is neither a function nor a class"),
    ({"factory": Net, "factory_kwargs": [WIDTH]}, "factory_kwargs=[8] is not a dict"),
    ({"factory": "nomodule_here:make"}, "cannot be imported"),
])
def test_errors_are_one_line_in_the_api_words(out_dir, kwargs, said):
    with pytest.raises(replay.ReplayError) as e:
        replay.replay(out_dir, **kwargs)
    message = str(e.value)
    assert said in message and "\n" not in message, message
    assert not CLI_WORD.search(message), message
    assert e.value.__cause__ is None and e.value.__suppress_context__  # (no chained traceback)


def test_a_folder_without_bundles_and_a_missing_path_are_bundle_errors(tmp_path):
    with pytest.raises(replay.ReplayError, match="is a directory with no \\*.nan bundle"):
        replay.replay(tmp_path)
    with pytest.raises(replay.BundleError, match="no such file or directory"):
        replay.replay(tmp_path / "nope.nan")


def test_an_internal_error_is_one_line_unless_debug(out_dir, monkeypatch):
    import replay.analyze

    def broken(*args):
        raise KeyError("inside")

    monkeypatch.setattr(replay.analyze, "analyze_bundle", broken)
    with pytest.raises(replay.ReplayError, match=r"^replay failed \(KeyError: 'inside'\); "
                       r"re-run with debug=True for the traceback$"):
        replay.replay(out_dir)
    with pytest.raises(KeyError):
        replay.replay(out_dir, debug=True)


def test_every_option_of_the_command_has_its_api_words():
    """A message naming any option of ``nanreplay`` (an option added later too) is said in the
    API's words."""
    from replay.api_words import python_words
    from replay.cli import main

    options = [o for p in main.params for o in p.opts if o.startswith("--") and o != "--help"]
    assert {"--factory", "--factory-kwargs", "--try", "--device", "--debug", "--html", "--info",
            "--strip", "--json", "--output"} <= set(options)
    for option in options:
        said = python_words(f"pass {option} lr=1 or {option}")
        assert "--" not in said, (option, said)

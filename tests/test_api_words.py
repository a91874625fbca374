"""Every message the replay can give, read through the Python API's words
(:mod:`replay.api_words`): no command-line option, no ``nanreplay`` command to type, no keyword
said twice, no call of the API the caller has just made, and the phrases that read wrong before
(each checked on the message its builder makes).

Before: ``replay.replay(p, device="cuda:1")`` on a machine without CUDA said
``device="cuda":1: this machine has no CUDA device``; the diverging hint said ``tries=["lr=0.1x"]
and clip=1.0 re-run``; the edited-path advice ``run `cd proj && nanreplay ../b.nan```; the
fidelity note ``pass them (factory_kwargs, factory_kwargs={...})``; a model class defined in a
notebook ``pass factory= (...) to re-run the step, or, where it is defined (a notebook),
replay.replay(path, factory=Net)``; ``no tries= re-runs that update``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import replay
from recorder import FlightRecorder, NonFiniteError
from replay.api_words import python_words

ROOT = Path(__file__).resolve().parent.parent
# (api_words names the options it maps; cli.py is the command itself)
NOT_MESSAGES = {"api_words.py", "cli.py"}


def _options() -> list[str]:
    from replay.cli import main

    return [o for p in main.params for o in p.opts if o.startswith("-") and o != "--help"]


def _rendered(node: ast.AST) -> str | None:
    """A string literal, an f-string with each placeholder as a word (``'X'`` for ``!r``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant)
                       else ("'X'" if v.conversion == ord("r") else "X") for v in node.values)
    return None


def _messages() -> list[tuple[str, str]]:
    """(where, text) of every string in replay/ and recorder/ naming an option or the command,
    docstrings left out."""
    found = []
    for path in sorted([*ROOT.glob("replay/*.py"), *ROOT.glob("recorder/*.py")]):
        if path.name in NOT_MESSAGES:
            continue
        source = path.read_text(encoding="utf-8")
        if "--" not in source and "nanreplay " not in source:
            continue
        tree = ast.parse(source)
        docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
        parts = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
        for n in ast.walk(tree):
            text = None if id(n) in docs | parts else _rendered(n)
            if text and re.search(r"--[a-z]|nanreplay \S", text):
                found.append((f"{path.name}:{n.lineno}", text))
    return found


def test_no_message_keeps_a_command_word_in_the_api():
    options = re.compile("|".join(rf"(?<![\w-]){re.escape(o)}(?![\w-])" for o in _options()))
    said = {where: python_words(text) for where, text in _messages()}
    assert len(said) > 100  # (the collection found the messages)
    wrong = {where: s for where, s in said.items()
             if options.search(s)  # an option left in
             or re.search(r"`(?:cd \S+ && )?nanreplay \S", s)  # a command to type
             or re.search(r"\b(\w+=)[^;]{0,3}\1", s)  # one keyword said twice in a row
             or re.search(r"replay\.replay\(path, factory=\w+\)", s)}  # the call being made
    assert not wrong, wrong


@pytest.mark.parametrize("cli, api", [
    ("lower the learning rate or clip the gradients (--try lr=0.1x and clip=1.0 re-run the "
     "bundle's rewind window with either)", 'clip the gradients (tries=["lr=0.1x", "clip=1.0"] '
     "re-run the bundle's rewind window"),
    ("--device cuda:1: this machine has no CUDA device; pass --device cpu",
     'device="cuda:1": this machine has no CUDA device; pass device="cpu"'),
    ("the run imported pkg from /w/proj: run `cd proj && nanreplay '../my runs/b.nan'`, or pass "
     "--factory proj.pkg:make to trust it", "run `os.chdir(\"proj\"); replay.replay('../my runs/"
     "b.nan')`, or pass factory=\"proj.pkg:make\" to trust it"),
    ("which no import reaches by that name: pass --factory MOD:FN (a function returning the "
     "model) to re-run the step, or, where it is defined (a notebook), replay.replay(path, "
     "factory=Net)", "pass factory=Net (the class itself, or a function that builds the model) "
     "to re-run the step"),
    ("run `nanreplay runs/b.nan --factory MOD:FN`, MOD:FN a function returning the model",
     'run `replay.replay("runs/b.nan", factory="MOD:FN")`, MOD:FN a function'),
    ("pass --factory MOD:FN, a function returning the model as the run built it",
     'pass factory=FN (or "MOD:FN"), a function returning the model'),
])
def test_phrases_read_in_the_api_words(cli, api):
    assert api in python_words(cli), python_words(cli)


def test_builders_phrases_read_in_the_api_words():
    from replay.cause_text import DO
    from replay.fidelity import BUILT_OTHERWISE
    from replay.unmeasured_weights import OWN_UPDATE_ADVICE

    assert 'tries=["lr=0.1x", "clip=1.0"] re-run the steps' in python_words(DO["diverging"])
    assert "no what-if (tries=) re-runs that update" in python_words(OWN_UPDATE_ADVICE)
    assert "pass them (factory_kwargs={...}, or record them with FlightRecorder(..., " \
        "factory_kwargs=))" in python_words(BUILT_OTHERWISE.format(attrs="a.b=1"))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.log(self.fc(x).abs() * (x[:, :1] != 7).float())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message of a machine without CUDA")
def test_a_cuda_device_with_an_index_is_said_whole(tmp_path):
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(NonFiniteError):
        with FlightRecorder(model, opt, out_dir=tmp_path):
            for step in range(3):
                x = torch.randn(8, 4)
                x[3, 0] = 7.0 if step == 2 else x[3, 0]
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
    with pytest.raises(replay.ReplayError, match=r'^device="cuda:1": this machine has no CUDA '
                       r'device; pass device="cpu"$'):
        replay.replay(tmp_path, factory=Tiny, device="cuda:1")

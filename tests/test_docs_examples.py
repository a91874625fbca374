"""The README's main command and the guide's first run say what ``examples/train_toy.py`` really
prints, and the source lines they cite are the source's.

The example runs as the README installs it: without NumPy (a ``sitecustomize`` makes ``numpy``
unimportable in the child processes, as on a machine where it is not installed). ``.ci/run``
runs the README's main command itself and compares its last lines with the README's report;
these tests tie that report to the guide, the golden ``bundles.TOY_REPORT`` and the source.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bundles import TOY_REPORT

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
README = (ROOT / "README.md").read_text(encoding="utf-8")
GUIDE = (ROOT / "docs" / "guide.md").read_text(encoding="utf-8")
BUNDLE = "nan-bundles/step00000037-rank0.nan"


def console_block(doc: str, prompt: str) -> list[str]:
    """The lines printed after ``$ <prompt>`` in a console block of ``doc``."""
    head, sep, rest = doc.partition(f"$ {prompt}\n")
    assert sep, f"no console block for {prompt!r}"
    return rest.split("```", 1)[0].rstrip("\n").splitlines()


def fenced_after(doc: str, marker: str) -> str:
    return doc.split(marker, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0].strip()


@pytest.fixture(scope="module")
def no_numpy(tmp_path_factory) -> dict[str, str]:
    """An environment in which ``import numpy`` fails in every Python started with it."""
    d = tmp_path_factory.mktemp("no-numpy")
    (d / "sitecustomize.py").write_text(
        "import sys\nsys.modules['numpy'] = None  # as if NumPy were not installed\n")
    paths = [str(d), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    probe = subprocess.run([sys.executable, "-c", "import numpy"], env=env, capture_output=True,
                           text=True, timeout=60)
    assert probe.returncode == 1 and "ModuleNotFoundError" in probe.stderr, probe.stderr
    return env


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, no_numpy) -> tuple[Path, subprocess.CompletedProcess]:
    """``python examples/train_toy.py`` (the README main command's last step), in a fresh
    directory, without NumPy."""
    cwd = tmp_path_factory.mktemp("first-run")
    proc = subprocess.run([sys.executable, str(EXAMPLES / "train_toy.py")], cwd=cwd,
                          env=no_numpy, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return cwd, proc


def test_readme_main_command_runs_the_example():
    main = fenced_after(README, "<!-- main-command -->")
    assert main.endswith("&& pip install -e . && python examples/train_toy.py"), main


def test_the_example_ends_with_the_report_in_readme_guide_and_golden(first_run):
    _, proc = first_run
    out = proc.stdout.rstrip("\n").splitlines()
    assert out[-len(TOY_REPORT):] == TOY_REPORT, proc.stdout
    assert console_block(README, f"nanreplay {BUNDLE}") == TOY_REPORT
    assert GUIDE.count("\n".join(TOY_REPORT)) == 1  # the first run's block ends with it


def test_the_guides_first_run_is_what_the_example_prints(first_run):
    """Line for line, except the three lines that name this machine: the bundle's absolute
    path, the Python version and the script's path and commit; and the message's command,
    which leads from the directory the script ran in to examples/ and the bundle."""
    cwd, proc = first_run
    out = proc.stdout.rstrip("\n").splitlines()
    guide = console_block(GUIDE, "python examples/train_toy.py")
    assert len(out) == len(guide), proc.stdout
    machine = {
        "bundle": f"bundle     {cwd / BUNDLE} (nanreplay-bundle/1)",
        "env": f"env        python {platform.python_version()}, torch {torch.__version__}, "
               "cuda None, rank 0/1",
    }
    for want, got in zip(guide, out):
        key = want.split(" ", 1)[0]
        if key in machine:
            assert got == machine[key]
        elif key == "run":
            assert re.fullmatch(r"run {8}\S*examples/train_toy\.py \(commit \S+\)", got), got
        elif (cd := re.search(r"run `cd (\S+) && nanreplay (\S+)`", got)) is not None:
            # (the command goes from where the script ran, here not the repository root, to
            # examples/, whence the factory's module imports, and on to the bundle)
            assert (cwd / cd[1]).resolve() == EXAMPLES.resolve(), got
            assert (cwd / cd[1] / cd[2]).resolve() == (cwd / BUNDLE).resolve(), got
            assert got.replace(cd[0], "") == re.sub(r"run `cd \S+ && nanreplay \S+`", "",
                                                    want), got
        else:
            assert got == want
    assert "Traceback" not in proc.stderr, proc.stderr


def test_the_replay_prints_nothing_on_stderr_without_numpy(first_run, no_numpy):
    """nanreplay needs no NumPy and says nothing about it (torch's own warning included)."""
    cwd, _ = first_run
    proc = subprocess.run([sys.executable, "-m", "replay", str(cwd / BUNDLE)], cwd=EXAMPLES,
                          env=no_numpy, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.rstrip("\n").splitlines() == TOY_REPORT


def test_cited_source_lines_are_the_sources():
    """The guide's "``examples/F``, line N: ``code``" and the golden report's ``F:N  text``
    name lines that hold that code (counted here from the file, not taken from the tool)."""
    cited = re.findall(r"`examples/([\w.]+\.py)`, line (\d+): `([^`]+)`", GUIDE)
    assert cited, "the guide cites no source line"
    for name, line, code in cited:
        text = (EXAMPLES / name).read_text().splitlines()[int(line) - 1]
        assert code in text, (name, line, text)
    [source] = [s for s in TOY_REPORT if s.startswith("  source")]
    where, text = source.split()[1], source.split(None, 2)[2]
    name, line = where.split(":")
    assert (EXAMPLES / name).read_text().splitlines()[int(line) - 1].strip() == text


def _shape(v):
    """``v``'s keys, nested, with the type of each leaf's value (lists by their first item)."""
    if isinstance(v, dict):
        return {k: _shape(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_shape(v[0])] if v else []
    return type(v).__name__


def test_the_cli_docs_json_report_is_the_examples(first_run):
    """docs/cli.md's ``--json`` report of the example has the keys (nested) and values the
    command prints, but for what names the machine (the bundle's path, torch's build) and the
    input range's floats, which may differ in their last digits."""
    cwd, _ = first_run
    doc = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    block = doc.split("The report of the\nexample:\n\n```json\n", 1)[1].split("```", 1)[0]
    proc = subprocess.run([sys.executable, "-m", "replay", "--json", str(cwd / BUNDLE)],
                          cwd=EXAMPLES, capture_output=True, text=True, timeout=300)
    want, got = json.loads(block), json.loads(proc.stdout)
    assert _shape(want) == _shape(got)
    for d in (want, got):
        del d["origin"]["input_range"], d["bundle"]["path"], d["bundle"]["torch"]
    assert want == got


# What the docs name and what the product has, both ways (read from the code, nothing run but
# ``nanreplay --help``, which imports no torch, and the first run's ``--info --json``).

CLI_DOC = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
REPLAY_SRC = "\n".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "replay").glob("*.py")))


def _python_blocks(doc: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", doc, re.S)


def test_the_help_and_the_options_table_are_the_commands():
    """docs/cli.md's ``--help`` block is what the command prints, every option has a row in its
    table (the hidden ``--debug`` is said in the text), and every row is an option."""
    from replay.cli import main

    env = dict(os.environ, COLUMNS="80")
    proc = subprocess.run([sys.executable, "-m", "replay", "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    block = CLI_DOC.split("$ nanreplay --help\n", 1)[1].split("```", 1)[0]
    assert proc.stdout.replace("python -m replay", "nanreplay") == block
    options = {max(p.opts, key=len): p for p in main.params if p.param_type_name == "option"}
    rows = set(re.findall(r"^\| `(?:-\w, )?(--[\w-]+)", CLI_DOC, re.M)) - {"--help"}
    assert rows == {o for o, p in options.items() if not p.hidden}
    assert all(f"`{o}`" in CLI_DOC for o, p in options.items() if p.hidden)
    said = {o for doc in (README, GUIDE, CLI_DOC) for cmd in re.findall(r"`nanreplay [^`]*`", doc)
            for o in re.findall(r" (--[a-z][\w-]*)", cmd)}
    assert said - {"--help"} <= set(options), said - set(options)
    from replay.whatif import KEYS

    row = re.search(r"^\| `--try KEY=VALUE` \|.*$", CLI_DOC, re.M)[0]
    assert not [k for k in KEYS if f"`{k}=" not in row], "--try keys the table does not name"


def _flight_recorder_keywords() -> set[str]:
    import inspect

    from recorder.flight import FlightRecorder

    params = inspect.signature(FlightRecorder.__init__).parameters
    return {n for n, p in params.items() if p.kind == p.KEYWORD_ONLY}


def test_every_flight_recorder_keyword_is_in_the_guide_and_no_other():
    """Each keyword of ``FlightRecorder`` (and each setting) is named in the guide, and the
    README's and the guide's code calls it with those only."""
    import ast
    import dataclasses

    from recorder.settings import Settings

    keywords = _flight_recorder_keywords()
    assert {f.name for f in dataclasses.fields(Settings)} <= keywords
    missing = [k for k in sorted(keywords) if not re.search(rf"`{k}(=|`)", GUIDE)]
    assert not missing, f"FlightRecorder keywords the guide does not name: {missing}"
    for doc in (README, GUIDE):
        for block in _python_blocks(doc):
            with contextlib.suppress(SyntaxError):  # (an excerpt of a loop, indented)
                for call in ast.walk(ast.parse(block)):
                    if isinstance(call, ast.Call) and getattr(call.func, "id", "") == \
                            "FlightRecorder":
                        unknown = {k.arg for k in call.keywords if k.arg} - keywords
                        assert not unknown, (unknown, block)


def test_the_python_api_is_the_documented_one():
    """Each of ``replay``'s public functions is named in the guide, and every written signature
    of ``replay.replay`` (guide, cli.md) lists its parameters in order."""
    import inspect

    import replay as api

    for name in api.__all__:
        assert f"replay.{name}" in GUIDE, name
    want = list(inspect.signature(api.replay).parameters)
    for doc in (GUIDE, CLI_DOC):
        written = re.findall(r"`replay\.replay\((path, \*,[^`]*)\)`", doc)
        assert written, "no replay.replay signature"
        for sig in written:
            names = [p.split("=")[0].strip() for p in sig.split(",")]
            assert [n for n in names if n != "*"] == want, sig


def _report_keys() -> tuple[set[str], set[str], set[str]]:
    """The report's top-level, ``origin`` and ``event`` keys the replay's code writes."""
    import ast

    top, origin = set(), set()
    for target, found in (("report", top), ("origin", origin)):
        found |= set(re.findall(rf'\b{target}\["(\w+)"\]\s*=(?!=)', REPLAY_SRC))
        found |= set(re.findall(rf'\b{target}\.setdefault\("(\w+)"', REPLAY_SRC))
    for m in re.finditer(r"\b(?:origin\.update|origin_fields)\(", REPLAY_SRC):
        with contextlib.suppress(SyntaxError):
            call = ast.parse(REPLAY_SRC[m.start():].split("\n\n", 1)[0].strip()).body[0].value
            origin |= {k.arg for k in call.keywords if k.arg}
    findings = ast.parse((ROOT / "replay" / "findings.py").read_text(encoding="utf-8"))
    made = {fn.name: fn.body for fn in findings.body if isinstance(fn, ast.FunctionDef)}
    [base] = [n.value for n in made["origin_fields"] if isinstance(n, ast.Assign)]
    report = made["base_report"][-1].value  # (``return {...}``)
    origin |= {k.value for k in base.keys}
    top |= {k.value for k in report.keys if isinstance(k, ast.Constant)}
    [event] = [v for k, v in zip(report.keys, report.values) if getattr(k, "value", 0) == "event"]
    event_keys = {k.value for k in event.keys if isinstance(k, ast.Constant)}
    event_keys |= {k.value for d in ast.walk(event) if isinstance(d, ast.Dict)
                   for k in d.keys if isinstance(k, ast.Constant)}
    # (history: the Python API's, said after the tables; origin: its own rows, origin.*)
    return top - {"history", "origin"}, origin, event_keys


def test_every_report_key_is_in_the_json_reference_and_no_other():
    """Each key the replay writes into the report, or its ``origin``, has a row in
    docs/cli.md's JSON tables, and each row's key is one the replay's code spells."""
    top, origin, event = _report_keys()
    assert {"format", "cause", "what_if"} <= top and {"op", "samples"} <= origin
    event_row = re.search(r"^\| `event` \|.*$", CLI_DOC, re.M)[0]
    assert not [k for k in event if f"`{k}`" not in event_row], "event keys not described"
    rows = re.findall(r"^\| `([\w.]+)`(?:, `([\w.]+)`)? \|", CLI_DOC, re.M)
    documented = {k for row in rows for k in row if k}
    missing = sorted(top - documented) + sorted(f"origin.{k}" for k in origin
                                                 if f"origin.{k}" not in documented)
    assert not missing, f"report keys docs/cli.md does not describe: {missing}"
    for key in documented:
        if not key.startswith("-") and key != key.upper():
            assert f'"{key.rsplit(".", 1)[-1]}"' in REPLAY_SRC or \
                f"{key.rsplit('.', 1)[-1]}=" in REPLAY_SRC, key


def test_the_info_json_keys_are_the_documented_ones(first_run):
    """docs/cli.md lists the keys of ``--info --json``: those of the example's bundle."""
    import replay as api

    cwd, _ = first_run
    listed = CLI_DOC.split("`--info --json` prints the same as an object with keys", 1)[1]
    listed = listed.split("\n\n", 1)[0]
    said = re.findall(r"`(\w+)`", listed)
    nested = {"null", "run_id", "rank", "world_size", "found", "missing"}  # (shard_set's)
    assert [k for k in said if k not in nested] == list(api.bundle_info(cwd / BUNDLE)), said

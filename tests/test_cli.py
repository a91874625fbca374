"""The ``nanreplay`` command through click's CliRunner: exit codes, stdout and stderr apart.

The toy bundle is the one ``examples/train_toy.py`` writes (its factory is
``toy_model:make_model``), so a replay that should rebuild the model runs from ``examples/``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import zstandard
from bundles import (
    EXAMPLES,
    ROOT,
    TOY_REPORT,
    one_error_line,
    rewrite,
    with_precursor,
)
from bundles import invoke_cli as invoke

from recorder.bundle import read_bundle


@pytest.fixture
def in_examples(monkeypatch):
    """Run from ``examples/`` (where the toy factory lives); sys.path is restored afterwards."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(EXAMPLES)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


TOY_TEXT = TOY_REPORT


# ---------------------------------------------------------------------------------------------
# the report


def test_replay_prints_the_short_report_and_exits_0(toy, in_examples):
    r = invoke(toy)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.splitlines() == TOY_TEXT
    assert r.stderr == ""


def _check_stable_keys(d: dict, bundle: Path) -> None:
    """The documented stable keys of ``--json``, each with its type."""
    assert d["format"] == "nanreplay-report/1"
    assert d["bundle"]["path"] == str(bundle)
    assert isinstance(d["bundle"]["rank"], int)
    assert isinstance(d["bundle"]["torch"], str)
    ev = d["event"]
    assert isinstance(ev["step"], int) and isinstance(ev["phase"], str)
    assert ev["module"] is None or isinstance(ev["module"], str)
    assert isinstance(d["reproduced"], bool)
    o = d["origin"]
    for key in ("phase", "module", "op", "param", "tensor", "source"):
        assert o[key] is None or isinstance(o[key], str), key
    assert o["call"] is None or isinstance(o["call"], int)
    assert isinstance(o["samples"], list) and all(isinstance(s, int) for s in o["samples"])
    assert isinstance(o["chain"], list) and all(isinstance(c, dict) for c in o["chain"])
    assert d["cause"] is None or isinstance(d["cause"], str)
    assert d["hint"] is None or isinstance(d["hint"], str)
    assert isinstance(d["precursors"], list)
    for p in d["precursors"]:
        assert isinstance(p["step"], int) and isinstance(p["kind"], str)
        assert isinstance(p["detail"], str)
    b = d["bisection"]
    assert b is None or (isinstance(b["probes"], int) and isinstance(b["agrees"], bool))


def test_json_is_the_only_thing_on_stdout_and_has_the_stable_keys(toy, in_examples):
    r = invoke("--json", toy)
    assert r.exit_code == 0, r.stderr
    assert r.stderr == ""
    d = json.loads(r.stdout)  # the whole of stdout is one JSON document
    _check_stable_keys(d, toy)
    assert (d["event"]["step"], d["event"]["phase"], d["event"]["module"]) == (37, "forward",
                                                                                 "norm")
    assert d["reproduced"] is True
    o = d["origin"]
    assert (o["phase"], o["module"], o["call"], o["op"]) == ("forward", "norm", 0, "aten.div")
    assert o["samples"] == [5]
    assert o["source"] == "toy_model.py:16"
    assert [c["op"] for c in o["chain"]] == ["aten.div"]
    assert d["cause"] == "invalid"
    assert d["hint"].startswith("aten.div of 0 by 0 (0/0)")
    assert d["precursors"] == []
    assert (d["bisection"]["probes"], d["bisection"]["agrees"]) == (4, True)
    assert "history" not in d


def test_json_lists_precursors_from_the_ring_buffer(toy, in_examples, tmp_path):
    b = with_precursor(toy, tmp_path / "jump.nan", step=30)
    r = invoke("--json", b)
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    _check_stable_keys(d, b)
    assert [(p["step"], p["kind"]) for p in d["precursors"]] == [(30, "loss_jump")]
    assert d["precursors"][0]["detail"].startswith("loss ")


def test_html_writes_a_page_and_still_prints_the_report(toy, in_examples, tmp_path):
    page = tmp_path / "report.html"
    r = invoke("--html", page, toy)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.splitlines() == TOY_TEXT
    text = page.read_text(encoding="utf-8")
    assert text.lstrip().lower().startswith("<!doctype html>")
    assert "aten.div" in text and 'id="verdict"' in text


@pytest.mark.parametrize("blocker", ["missing", "file"])
def test_html_in_a_directory_that_is_not_there_is_refused_before_the_replay(
        toy, in_examples, tmp_path, monkeypatch, blocker):
    parent = tmp_path / "no-such-dir"
    if blocker == "file":
        parent.write_text("")
    page = parent / "report.html"
    monkeypatch.setattr("replay.analyze.read_step", _must_not_replay)  # (where it is called)
    why = "does not exist" if blocker == "missing" else "is a file, not a directory"
    assert one_error_line(invoke("--html", page, toy)) == (
        f"nanreplay: cannot write the HTML report to {page} ({parent} {why}); pass an --html "
        "path in an existing directory")


def _must_not_replay(*args):
    raise AssertionError("the replay ran before the --html path was checked")


@pytest.mark.parametrize("as_json", [False, True])
def test_html_that_fails_to_write_after_the_replay_still_prints_the_report(
        toy, in_examples, tmp_path, monkeypatch, as_json):
    """A full disk under the page: the replay's report is printed all the same, then the one
    error line (exit 2); before, the report of a replay that could take minutes was lost."""
    page = tmp_path / "report.html"
    real = Path.write_text

    def full(self, *args, **kwargs):
        if self == page:
            raise OSError(28, "No space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)
    r = invoke(*(["--json"] if as_json else []), "--html", page, toy)
    assert r.exit_code == 2
    if as_json:
        d = json.loads(r.stdout)
        assert (d["origin"]["module"], d["origin"]["op"], d["cause"]) == ("norm", "aten.div",
                                                                         "invalid")
    else:
        assert r.stdout.splitlines() == TOY_TEXT
    assert r.stderr.splitlines() == [
        f"nanreplay: cannot write the HTML report to {page} (No space left on device); the "
        "report was printed; pass another --html path"]
    assert not page.exists()


def test_a_stdout_that_cannot_take_the_report_is_one_line(toy, in_examples, monkeypatch):
    """`nanreplay B.nan --json > /dev/full`: said as that, not as 'replay failed'."""
    import click

    real = click.echo

    def full_stdout(message=None, *args, err=False, **kwargs):
        if not err:
            raise OSError(28, "No space left on device")
        return real(message, *args, err=err, **kwargs)

    monkeypatch.setattr(click, "echo", full_stdout)
    assert one_error_line(invoke("--json", toy)) == (
        "nanreplay: cannot write the report to stdout (No space left on device); redirect it "
        "to a file or device with room")


def test_strip_to_a_path_that_cannot_be_written_is_one_line(toy, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = blocker / "share.nan"
    assert one_error_line(invoke("--strip", "batch", "-o", out, toy)) == (
        f"nanreplay: cannot write {out} ('{blocker}' is a file, not a directory); pass another "
        "-o path")


@pytest.mark.parametrize("module", ["replay", "replay.cli"])
def test_python_dash_m_replay_runs_the_same_command(toy, module):
    """``python -m replay`` and ``python -m replay.cli`` (which printed nothing and exited 0,
    a report silently lost) run the nanreplay command."""
    proc = subprocess.run([sys.executable, "-m", module, "--json", str(toy)], cwd=EXAMPLES,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    d = json.loads(proc.stdout)
    assert (d["origin"]["op"], d["origin"]["module"], d["cause"]) == ("aten.div", "norm",
                                                                      "invalid")


# ---------------------------------------------------------------------------------------------
# --info


def test_info_summarises_event_sizes_and_environment(toy):
    r = invoke("--info", toy)
    assert r.exit_code == 0, r.stderr
    assert r.stderr == ""
    lines = r.stdout.splitlines()
    assert lines[0] == f"bundle     {toy} (nanreplay-bundle/1)"
    assert lines[1] == "event      step 37, phase forward, nan, module norm"
    assert f"torch {torch.__version__}" in lines[5]
    assert "  weights                6 tensors       0.03 MB" in lines
    assert "  batch                  1 tensors       0.00 MB" in lines
    assert any(line.startswith("  ring buffer           13 tensors") for line in lines)


def test_info_json_is_one_document(toy):
    r = invoke("--info", "--json", toy)
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["event"]["step"] == 37 and d["factory"] == "toy_model:make_model"
    assert d["sizes"]["weights"]["tensors"] == 6
    assert d["env"]["torch"] == torch.__version__
    assert d["stripped"] == []


def test_the_out_dir_of_one_event_is_replayed_as_its_bundle(toy, tmp_path):
    """``nanreplay nan-bundles`` (the directory, as a user types it after the crash): the one
    event's bundle, its lowest rank's file; several events or none are one line naming what
    to pass."""
    one = tmp_path / "one"
    one.mkdir()
    for rank in (1, 0):
        (one / f"step00000037-rank{rank}.nan").write_bytes(toy.read_bytes())
    r = invoke("--info", one)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.splitlines()[0] == (
        f"bundle     {one / 'step00000037-rank0.nan'} (nanreplay-bundle/1)")
    (one / "step00000009-rank0.nan").write_bytes(toy.read_bytes())
    r = invoke("--info", one)
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr == (
        f"nanreplay: {one} holds the bundles of 2 events (step00000009-rank0.nan, "
        f"step00000037-rank0.nan); name one: the earliest step's is "
        f"{one / 'step00000009-rank0.nan'} (nanreplay --help lists the options)\n")
    r = invoke(tmp_path / "one" / "..")
    assert r.exit_code == 2 and "with no *.nan bundle in it" in r.stderr, r.stderr


# ---------------------------------------------------------------------------------------------
# --device


def _on_cuda(src: Path, dst: Path) -> Path:
    """``src`` as if it had been recorded on ``cuda:0`` (the tensors are the same bytes)."""
    def edit(m):
        for mod in m["modules"]:
            if mod.get("device"):
                mod["device"] = "cuda:0"
        m["modules"][0]["device"] = "cuda:0"
        return m

    return rewrite(src, dst, meta=edit)


def test_device_cpu_on_a_cpu_bundle(toy, in_examples):
    r = invoke("--device", "cpu", toy)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.splitlines() == TOY_TEXT


def test_device_cpu_replays_a_gpu_bundle_without_cuda(toy, in_examples, no_cuda, tmp_path):
    b = _on_cuda(toy, tmp_path / "gpu.nan")
    r = invoke("--device", "cpu", b)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.splitlines() == TOY_TEXT


def test_gpu_bundle_without_cuda_asks_for_device_cpu(toy, in_examples, no_cuda, tmp_path):
    b = _on_cuda(toy, tmp_path / "gpu.nan")
    line = one_error_line(invoke(b))
    assert line == ("nanreplay: the bundle was recorded on cuda:0 and this machine has no CUDA "
                    "device; pass --device cpu")


@pytest.mark.parametrize("recorded_on", ["cpu", "cuda"])
def test_device_cuda_without_cuda_is_one_line(toy, in_examples, no_cuda, tmp_path, recorded_on):
    b = toy if recorded_on == "cpu" else _on_cuda(toy, tmp_path / "gpu.nan")
    assert one_error_line(invoke("--device", "cuda", b)) == (
        "nanreplay: --device cuda: this machine has no CUDA device; pass --device cpu")


# ---------------------------------------------------------------------------------------------
# --strip


def _strip(toy: Path, out: Path, *parts: str):
    args = [a for p in parts for a in ("--strip", p)]
    return invoke(*args, "-o", out, toy)


@pytest.mark.parametrize("parts, gone", [
    (("batch",), ("batch/", "loss_in/", "outgrad/")),
    (("weights",), ("weights/", "grads/", "optim/", "optim_group/", "buffers/", "loss/")),
    (("batch", "weights"), ("batch/", "loss_in/", "outgrad/", "weights/", "grads/", "optim/")),
])
def test_strip_writes_a_copy_without_those_tensors(toy, tmp_path, parts, gone):
    out = tmp_path / "share.nan"
    r = _strip(toy, out, *parts)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.splitlines() == [f"wrote {out} without {', '.join(parts)}"]
    assert r.stderr == ""
    meta, tensors = read_bundle(out)
    orig_meta, orig = read_bundle(toy)
    assert not [k for k in tensors if k.startswith(gone)]
    kept = {k for k in orig if not k.startswith(gone)}
    assert set(tensors) == kept
    assert {k for k in tensors if k.startswith("ring/")} == \
        {k for k in orig if k.startswith("ring/")}
    for k in kept:
        torch.testing.assert_close(tensors[k], orig[k], rtol=0, atol=0, equal_nan=True,
                                   msg=k)
    assert meta["stripped"] == sorted(parts)
    assert meta["event"] == orig_meta["event"]
    assert meta["env"] == orig_meta["env"]


SECRET = "alice@example.com"


def _batch_with_json_leaves(src: Path, dst: Path) -> Path:
    """``src`` as the recorder writes a batch that holds non-tensor values: strings and numbers
    travel in the metadata (``micro_batches[i]['inputs']``), not as tensors."""
    def edit(m):
        mb = m["micro_batches"][0]
        mb["inputs"]["$list"][1] = {"$dict": [["note", SECRET], ["ids", {"$list": [17, 42]}]]}
        mb["paths"]["batch/0/0"] = f'[0][{SECRET!r}]'
        mb["loss_inputs"]["$list"][1] = {"$dict": [["tag", SECRET]]}
        return m

    return rewrite(src, dst, meta=edit)


def test_strip_batch_drops_the_batch_values_kept_in_the_metadata(toy, tmp_path):
    b = _batch_with_json_leaves(toy, tmp_path / "leafy.nan")
    assert SECRET in json.dumps(read_bundle(b)[0])
    out = tmp_path / "share.nan"
    assert _strip(b, out, "batch").exit_code == 0
    meta, _ = read_bundle(out)
    assert SECRET not in json.dumps(meta)
    assert SECRET.encode() not in zstandard.ZstdDecompressor().decompress(out.read_bytes())
    assert meta["event"] == read_bundle(b)[0]["event"]
    before = read_bundle(b)[0]["micro_batches"][0]
    assert meta["micro_batches"] == [{k: v for k, v in before.items() if k not in (
        "inputs", "loss_inputs", "paths", "loss_paths")}]


def test_input_event_of_a_batch_stripped_copy_is_reported_from_the_event(toy, in_examples,
                                                                          tmp_path):
    def to_input(m):
        m["event"].update(phase="input", module="", tensor="batch", samples=[5], kind="nan",
                          detail="non-finite value in the model's input batch")
        return m

    def nan_row(t):
        t["batch/0/0"] = t["batch/0/0"].clone()
        t["batch/0/0"][5] = float("nan")
        return t

    b = rewrite(toy, tmp_path / "input.nan", meta=to_input, tensors=nan_row)
    out = tmp_path / "share.nan"
    assert _strip(b, out, "batch").exit_code == 0
    r = invoke(out)
    assert r.stderr == ""
    lines = r.stdout.splitlines()
    assert lines[1:3] == ["  origin     input: nan made by the input batch", "  samples    [5]"]
    assert "  note       the batch was stripped from this bundle" in lines


def test_strip_never_overwrites(toy, tmp_path):
    out = tmp_path / "share.nan"
    out.write_bytes(b"someone else's file")
    r = _strip(toy, out, "batch")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.splitlines() == [f"wrote {tmp_path / 'share-1.nan'} without batch"]
    assert out.read_bytes() == b"someone else's file"


@pytest.mark.parametrize("parts, note", [
    (("batch",), "the batch was stripped from this bundle"),
    (("weights",), "the weights were stripped from this bundle"),
    (("batch", "weights"), "the batch and the weights were stripped from this bundle"),
])
def test_replaying_a_stripped_copy_exits_1_and_says_what_was_stripped(toy, in_examples, tmp_path,
                                                                      parts, note):
    jump = with_precursor(toy, tmp_path / "jump.nan", step=30)
    out = tmp_path / "share.nan"
    assert _strip(jump, out, *parts).exit_code == 0
    r = invoke(out)
    assert r.exit_code == 1, r.stdout + r.stderr
    assert r.stderr == ""
    lines = r.stdout.splitlines()
    assert lines[0] == ("nanreplay: step 37, forward event — not re-run "
                        f"({' and '.join(sorted(parts))} stripped)")
    assert lines[1] == "  origin     forward: nan made by norm, call 0, inputs finite"
    assert f"  note       {note}" in lines
    assert lines[-2:] == ["  precursors", lines[-1]]
    assert lines[-1].startswith("    step     30  loss_jump       loss ")
    j = invoke("--json", out)
    assert j.exit_code == 1
    d = json.loads(j.stdout)
    assert d["bundle"]["stripped"] == sorted(parts)
    assert note in d["problems"]
    assert d["reproduced"] is False
    assert [p["kind"] for p in d["precursors"]] == ["loss_jump"]


def test_stripped_copy_of_a_gpu_bundle_reads_without_cuda_or_device_option(toy, in_examples,
                                                                           no_cuda, tmp_path):
    """Nothing is re-run from a stripped copy, so it needs no CUDA and no --device cpu."""
    gpu = _on_cuda(with_precursor(toy, tmp_path / "jump.nan", step=30), tmp_path / "gpu.nan")
    out = tmp_path / "share.nan"
    assert _strip(gpu, out, "weights").exit_code == 0
    r = invoke(out)
    assert r.exit_code == 1, r.stdout + r.stderr
    assert r.stderr == ""
    lines = r.stdout.splitlines()
    assert lines[0] == "nanreplay: step 37, forward event — not re-run (weights stripped)"
    assert "  note       the weights were stripped from this bundle" in lines
    assert lines[-1].startswith("    step     30  loss_jump       loss ")


# ---------------------------------------------------------------------------------------------
# usage


def test_missing_file_is_a_usage_error(tmp_path):
    line = one_error_line(invoke(tmp_path / "nope.nan"))
    assert f"'{tmp_path / 'nope.nan'}' does not exist" in line


def test_missing_bundle_argument_is_one_line():
    line = one_error_line(invoke())
    assert line == ("nanreplay: Missing argument 'BUNDLE'. "
                    "(nanreplay --help lists the options)")


def test_unknown_device_is_a_usage_error(toy):
    assert "Invalid value for '--device'" in one_error_line(invoke("--device", "tpu", toy))


@pytest.mark.parametrize("args", [("--strip", "batch"), ("-o", "share.nan")])
def test_strip_and_output_go_together(toy, tmp_path, monkeypatch, args):
    monkeypatch.chdir(tmp_path)
    line = one_error_line(invoke(*args, toy))
    assert line == ("nanreplay: --strip and -o/--output go together: nanreplay B.nan --strip "
                    "batch -o shareable.nan (nanreplay --help lists the options)")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args", [("--info",), ("--strip", "batch", "-o", "share.nan")])
def test_html_needs_a_replay(toy, tmp_path, monkeypatch, args):
    monkeypatch.chdir(tmp_path)
    line = one_error_line(invoke(*args, "--html", "r.html", toy))
    assert "--html writes the report of a replay" in line
    assert list(tmp_path.iterdir()) == []  # neither the report nor the copy


@pytest.mark.parametrize("args, given, mode", [
    (("--info", "--try", "lr=1e-4"), "--try is", "--info"),
    (("--info", "--factory", "toy_model:make_model", "--device", "cpu"),
     "--factory, --device are", "--info"),
    (("--strip", "batch", "-o", "share.nan", "--try", "auto"), "--try is", "--strip"),
    (("--strip", "batch", "-o", "share.nan", "--json"), "--json is", "--strip"),
    # (--strip takes precedence over --info: the --json it refuses is the copy's, not the summary's)
    (("--info", "--json", "--strip", "batch", "-o", "share.nan"), "--json is", "--strip"),
])
def test_replay_options_without_a_replay_are_refused(toy, tmp_path, monkeypatch, args, given,
                                                      mode):
    """`nanreplay B.nan --info --try lr=1e-4` printed the summary and dropped the what-if
    without a word, which reads as if it had no answer; it is now refused as --html is."""
    monkeypatch.chdir(tmp_path)
    assert one_error_line(invoke(*args, toy)) == (
        f"nanreplay: {given} for a replay, and {mode} replays nothing: run them separately "
        "(nanreplay --help lists the options)")
    assert list(tmp_path.iterdir()) == []  # no copy written


def test_help_names_every_option():
    r = invoke("--help")
    assert r.exit_code == 0
    for opt in ("--json", "--html", "--info", "--factory", "--device", "--strip", "--output"):
        assert opt in r.stdout, opt


CHATTY = '''
import torch
from torch import nn

print("loading the model config")  # at import, as training modules often do


class Pooled(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(30, 8, padding_idx=0)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens):
        mask = (tokens != 0).float().unsqueeze(-1)
        pooled = (self.embed(tokens) * mask).sum(1) / mask.sum(1)  # 0/0 for an empty row
        print("pooled", tuple(pooled.shape))  # a debug print left in forward
        return self.head(pooled)


def make_model():
    print("building Pooled")
    torch.manual_seed(0)
    return Pooled()
'''


def test_json_stays_the_whole_of_stdout_when_the_model_prints(tmp_path, monkeypatch):
    """A factory module and a forward that print (at import, in the factory, a debug print in
    forward): their lines go to stderr, so `nanreplay B.nan --json | jq` still gets one JSON
    document; they came first on stdout and made it unparseable."""
    import importlib

    from torch import nn

    from recorder import FlightRecorder, NonFiniteError

    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    (tmp_path / "chatty_model.py").write_text(CHATTY)
    monkeypatch.chdir(tmp_path)
    mod = importlib.import_module("chatty_model")
    model = mod.make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    crit = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    try:
        with pytest.raises(NonFiniteError) as info:
            with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path / "b",
                                factory="chatty_model:make_model"):
                for step in range(5):
                    tokens = torch.randint(1, 30, (6, 7), generator=g)
                    if step == 3:
                        tokens[2] = 0  # an empty record
                    opt.zero_grad()
                    crit(model(tokens), torch.arange(6) % 3).backward()
                    opt.step()
        r = invoke("--json", info.value.bundle_path)
    finally:
        sys.modules.pop("chatty_model", None)
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)  # the whole of stdout is one JSON document
    o = d["origin"]
    assert (d["event"]["step"], o["module"], o["op"], o["samples"], d["cause"]) == (
        3, "", "aten.div", [2], "invalid")
    assert "building Pooled" in r.stderr and "pooled (6, 8)" in r.stderr

"""Bad bundles: each gives exit 2 and one ``nanreplay: ...`` line on stderr, no traceback, and
nothing runs.

Every bad file here is made from a real bundle whose recorded factory is a module *in the
current directory* (so nanreplay would trust and import it), and that module creates a marker
file when imported: a bad bundle that got as far as rebuilding the model would leave the marker.
A control test shows that the intact bundle does import it.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import types
import uuid
from pathlib import Path

import pytest
import zstandard
from bundles import (
    EXAMPLES,
    decompressed,
    edit_header,
    factory_module,
    huge_tensor_bundle,
    lying_frame,
    one_error_line,
    rewrite,
    with_factory,
)
from bundles import (
    invoke_cli as run,
)


class Evil:
    """A directory holding a factory module that leaves ``marker`` when imported."""

    def __init__(self, root: Path, toy: Path):
        self.name = f"evil_{uuid.uuid4().hex[:12]}"
        self.dir = root / "project"
        self.marker = root / "markers" / "imported"
        self.marker.parent.mkdir(parents=True)
        factory_module(self.dir, self.name, self.marker)
        self.bundle = with_factory(toy, root / "base" / "evil.nan", f"{self.name}:make_model")

    def assert_untouched(self) -> None:
        assert not self.marker.exists(), "nanreplay imported the bundle's factory"
        assert self.name not in sys.modules


@pytest.fixture(scope="module")
def evil(tmp_path_factory, toy) -> Evil:
    return Evil(tmp_path_factory.mktemp("evil"), toy)


@pytest.fixture
def in_project(evil, monkeypatch):
    """cwd = the directory of the evil factory: nanreplay would trust it there."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(evil.dir)
    yield
    evil.assert_untouched()


def test_control_the_intact_bundle_imports_its_factory_from_cwd(tmp_path, toy, monkeypatch):
    """The marker works: the same kind of bundle, intact, does import the module (which is why
    the bad ones must fail before that point)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    e = Evil(tmp_path, toy)
    monkeypatch.chdir(e.dir)
    try:
        r = run(e.bundle)
        assert r.exit_code == 0, r.stdout + r.stderr
        assert e.marker.read_text() == "imported"
    finally:
        sys.modules.pop(e.name, None)


# ---------------------------------------------------------------------------------------------
# the bad files: (name, builder(base bundle, tmp dir) -> path, message after "<path>: ",
# whether --info fails too (the damage is in the header))


def _truncate(keep):
    def make(base: Path, d: Path) -> Path:
        raw = base.read_bytes()
        out = d / "truncated.nan"
        out.write_bytes(raw[:keep(len(raw))])
        return out
    return make


def _flip(where):
    def make(base: Path, d: Path) -> Path:
        raw = bytearray(base.read_bytes())
        i = where(len(raw))
        for j in range(i, i + 16):
            raw[j] ^= 0xFF
        out = d / "flipped.nan"
        out.write_bytes(bytes(raw))
        return out
    return make


def _file(content: bytes, name: str = "bad.nan"):
    def make(base: Path, d: Path) -> Path:
        out = d / name
        out.write_bytes(content)
        return out
    return make


def _header(edit):
    def make(base: Path, d: Path) -> Path:
        return edit_header(base, d / "edited.nan", edit)
    return make


def _set_md(key, value):
    def edit(h):
        if value is _DELETE:
            del h["__metadata__"][key]
        else:
            h["__metadata__"][key] = value
    return _header(edit)


_DELETE = object()


def _first_tensor(edit):
    def e(h):
        name = next(k for k in h if k != "__metadata__")
        edit(h[name])
    return _header(e)


def _raw_header(head: bytes):
    def make(base: Path, d: Path) -> Path:
        _, body = decompressed(base)
        out = d / "rawheader.nan"
        head_padded = head + b" " * (-len(head) % 8)
        out.write_bytes(zstandard.ZstdCompressor().compress(
            len(head_padded).to_bytes(8, "little") + head_padded + body))
        return out
    return make


def _meta(edit):
    """Through write_bundle: a well-formed file whose JSON metadata is wrong."""
    def make(base: Path, d: Path) -> Path:
        def e(m):
            edit(m)
            return m
        return rewrite(base, d / "meta.nan", meta=e)
    return make


def _set_event(key, value):
    def edit(m):
        if value is _DELETE:
            del m["event"][key]
        else:
            m["event"][key] = value
    return _meta(edit)


def _set_meta(key, value):
    def edit(m):
        if value is _DELETE:
            del m[key]
        else:
            m[key] = value
    return _meta(edit)


def _huge_declared(base: Path, d: Path) -> Path:
    return lying_frame(base, d / "huge.nan", 1 << 50)


def _huge_single_segment(base: Path, d: Path) -> Path:
    """Frame descriptor with the single-segment flag: the window is the declared size."""
    raw = base.read_bytes()
    params = zstandard.get_frame_parameters(raw[:18])
    assert raw[4] == 0b10100100 and params.has_checksum  # 4-byte size, single segment, checksum
    out = d / "huge-window.nan"
    out.write_bytes(raw[:4] + bytes([0b11100100]) + (1 << 50).to_bytes(8, "little") + raw[9:])
    return out


def _plain_safetensors(base: Path, d: Path) -> Path:
    """The bundle's safetensors file as it is inside the frame, without the zstd frame."""
    out = d / "plain.nan"
    out.write_bytes(zstandard.ZstdDecompressor().decompress(base.read_bytes()))
    return out


PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(64)

NOT_A_BUNDLE = ("not a nanreplay bundle (no zstd frame at the start); pass the .nan file the "
                "recorder wrote")

CASES = [
    ("empty file", _file(b""), "empty (0 bytes); the file is incomplete", True),
    ("png image", _file(PNG, "picture.nan"), NOT_A_BUNDLE, True),
    ("text file", _file(b"step,loss\n0,1.38\n", "notes.nan"), NOT_A_BUNDLE, True),
    ("plain safetensors, not zstd", _plain_safetensors, NOT_A_BUNDLE, True),
    ("truncated inside the frame header", _truncate(lambda n: 7),
     "corrupted zstd frame header", True),
    ("truncated after the frame header", _truncate(lambda n: 12),
     "truncated: it ends at byte 12, inside block 0 of its zstd frame; the file is "
     "incomplete", True),
    # (found from the block headers, without decoding: --info refuses them too)
    ("truncated in half", _truncate(lambda n: n // 2), "truncated: it ends at byte ", True),
    ("last bytes cut", _truncate(lambda n: n - 40), "truncated: it ends at byte ", True),
    ("bytes flipped in the middle", _flip(lambda n: n // 2), "corrupted data while reading ",
     False),
    ("bytes flipped near the end", _flip(lambda n: n - 30), "corrupted data while reading ",
     False),
    ("newer format version", _set_md("version", "2"),
     "format version 2 is newer than this nanreplay reads (1); upgrade nanreplay: pip install "
     "-U nanreplay", True),
    ("version not a number", _set_md("version", "one"),
     "format version 'one' is not a number", True),
    ("version a JSON list", _set_md("version", [1]), "format version [1] is not a number",
     True),
    ("version missing", _set_md("version", _DELETE), "format version None is not a number",
     True),
    ("meta not JSON", _set_md("meta", "{'event': 1"),
     "metadata 'meta' is missing or not JSON; the file is corrupted", True),
    ("meta missing", _set_md("meta", _DELETE),
     "metadata 'meta' is missing or not JSON; the file is corrupted", True),
    ("meta a JSON list", _set_md("meta", "[1, 2]"),
     "metadata 'meta' is not a JSON object; the file is corrupted", True),
    ("meta without the event", _set_meta("event", _DELETE), "metadata lacks 'event'", True),
    ("meta empty", _meta(lambda m: m.clear()), "metadata lacks 'event'", True),
    ("event not an object", _set_meta("event", "step 37"),
     "metadata 'event' is a string, not an object", True),
    ("event without its step", _set_event("step", _DELETE), "metadata 'event' lacks 'step'",
     True),
    ("event step not an integer", _set_event("step", "37"),
     "metadata 'event.step' is a string, not an integer", True),
    ("event phase a list", _set_event("phase", ["forward"]),
     "metadata 'event.phase' is a list, not a string or null", True),
    ("model null", _set_meta("model", None), "metadata 'model' is null, not an object", True),
    ("params an object", _set_meta("params", {"a": 1}),
     "metadata 'params' is an object, not a list", True),
    ("module entry without a name", _meta(lambda m: m["modules"][1].pop("name")),
     "metadata 'modules' entry name is null, not a string", True),
    ("micro-batch entry a number", _set_meta("micro_batches", [3]),
     "metadata 'micro_batches' entry is an integer, not an object", True),
    ("stripped entry a number", _set_meta("stripped", [1]),
     "metadata 'stripped' entry is an integer, not a string", True),
    ("factory a list", _set_meta("factory", ["evil", "make"]),
     "metadata 'factory' is a list, not a string or null", True),
    ("no nanreplay metadata", _header(lambda h: h.pop("__metadata__")),
     "safetensors file without nanreplay metadata; pass a bundle written by the recorder",
     True),
    ("another format's metadata", _set_md("format", "pt"),
     "safetensors file without nanreplay metadata; pass a bundle written by the recorder",
     True),
    ("tensor entry without dtype", _first_tensor(lambda e: e.pop("dtype")),
     "has a malformed entry; the file is corrupted", True),
    ("tensor entry without offsets", _first_tensor(lambda e: e.pop("data_offsets")),
     "has a malformed entry; the file is corrupted", True),
    ("tensor entry with an unknown dtype", _first_tensor(lambda e: e.update(dtype="F128")),
     "has a malformed entry; the file is corrupted", True),
    ("tensor shape that does not fit its bytes", _first_tensor(lambda e: e.update(shape=[7])),
     "but its shape [7] needs 28 bytes at 0; the file is corrupted", True),
    ("tensor with a negative dimension", _first_tensor(lambda e: e.update(shape=[-1, 4])),
     "has a negative dimension", True),
    ("header not JSON", _raw_header(b"{this is not json"), "header is not JSON", True),
    ("header a JSON list", _raw_header(b"[1, 2, 3]"),
     "header is not a JSON object; the file is corrupted", True),
    ("zstd frame declaring a huge size", _huge_declared,
     "zstd frame declares 1125899906842624 bytes but the header describes ", True),
    ("zstd frame whose window is a huge declared size", _huge_single_segment,
     "corrupted data while reading header size (zstd decompress error: Frame requires too "
     "much memory for decoding)", True),
]


def _contains(line: str, path: Path, message: str) -> None:
    prefix = f"nanreplay: {path}: "
    assert line.startswith(prefix), line
    assert message in line[len(prefix):], line


@pytest.fixture(params=CASES, ids=[c[0] for c in CASES])
def bad(request, evil, tmp_path):
    name, make, message, header_level = request.param
    return make(evil.bundle, tmp_path), message, header_level


def test_replay_refuses(bad, in_project):
    path, message, _ = bad
    _contains(one_error_line(run(path)), path, message)


def test_json_refuses_and_prints_nothing_on_stdout(bad, in_project):
    path, message, _ = bad
    _contains(one_error_line(run("--json", path)), path, message)


def test_strip_refuses_and_writes_nothing(bad, in_project, tmp_path):
    path, message, _ = bad
    out = tmp_path / "out" / "share.nan"
    _contains(one_error_line(run("--strip", "batch", "-o", out, path)), path, message)
    assert not out.parent.exists() or not list(out.parent.iterdir())


def test_info_refuses_a_bad_header(bad, in_project):
    path, message, header_level = bad
    r = run("--info", path)
    if header_level:
        _contains(one_error_line(r), path, message)
    else:  # --info reads the header only; the damage is further in: it must still import nothing
        assert r.exit_code in (0, 2)


# ---------------------------------------------------------------------------------------------
# a zstd frame and a header that agree on a huge size the file does not hold


def _physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_huge_claimed_tensor_is_refused_before_reading(evil, tmp_path, in_project):
    n = 1 << 44  # 16 TiB: more than any machine this runs on
    b = huge_tensor_bundle(tmp_path / "bomb.nan", n, factory=f"{evil.name}:make_model")
    mem = _physical_memory()
    for args in ((b,), ("--json", b)):
        assert one_error_line(run(*args)) == (
            f"nanreplay: {b}: its tensors claim {n} bytes, more than this machine's memory "
            f"({mem} bytes); the file is corrupted, or read it on a larger machine")
    out = tmp_path / "out.nan"
    assert one_error_line(run("--strip", "batch", "-o", out, b)) == (
        f"nanreplay: {b}: tensor 'x' claims {n} bytes, more than this machine's memory "
        f"({mem} bytes); the file is corrupted or not a bundle")
    assert not out.exists()


def test_huge_claimed_tensor_costs_no_memory_when_the_file_is_short(evil, tmp_path, in_project):
    """A claim that fits in memory is read as far as the file goes: it must not be allocated
    and zero-filled first (peak RSS stays far below the claim)."""
    n = min(1 << 29, _physical_memory() // 4)  # (a larger claim is a decompression bomb:
    # 1000 times the file's size, above 1 GiB, refused before reading, tests/test_hostile_bundles)
    b = huge_tensor_bundle(tmp_path / "short.nan", n, factory=f"{evil.name}:make_model")
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    line = one_error_line(run(b))
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale - before
    # (its blocks end before the frame's declared size: the decoder calls that corrupt)
    assert line.startswith(f"nanreplay: {b}: corrupted data while reading tensor 'x' ("), line
    assert grown < n // 4, f"peak memory grew by {grown} bytes for a {n}-byte claim"


# ---------------------------------------------------------------------------------------------
# bad contents: the model and the factory


@pytest.fixture
def in_examples(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(EXAMPLES)


def other_model(line: str, what: str) -> bool:
    """``line`` is ``what``, then what to do when the factory's model does not take the
    bundle's weights: the run's command line (the toy's is pytest's) and --factory-kwargs."""
    head = (f"nanreplay: {what}; the factory builds a different model: it cannot see the run's "
            "configuration (command-line flags, config files); the run's command line was '")
    tail = ("'. Pass --factory-kwargs '{...}' with the settings that built the trained model "
            "(record them with FlightRecorder(..., factory_kwargs={...})), or --factory MOD:FN "
            "building it")
    return line.startswith(head) and line.endswith(tail)


def test_weights_whose_shape_does_not_fit_the_model(toy, tmp_path, in_examples):
    import torch

    def edit(t):
        t["weights/head.weight"] = torch.zeros(5, 64)
        return t

    b = rewrite(toy, tmp_path / "shapes.nan", tensors=edit)
    for args in ((b,), ("--json", b)):
        assert other_model(one_error_line(run(*args)), (
            "weights/head.weight has shape [5, 64] in the bundle but [4, 64] in the model from "
            "the factory"))


SCALED = """
import toy_model


class Scaled(toy_model.Classifier):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(32))

    def forward(self, x):
        return super().forward(x * self.scale)


def make_model():
    return Scaled()
"""


def _scaled_bundle(toy, tmp_path, monkeypatch, buffers: dict) -> tuple[Path, str]:
    """The toy's bundle made for a model with a ``scale`` buffer ([32], of ones), holding
    ``buffers`` (name -> shape) instead; and the factory's module name (to unload)."""
    import torch

    monkeypatch.setattr(sys, "path", list(sys.path))
    mod = f"scaled_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{mod}.py").write_text("import torch\n" + SCALED)
    monkeypatch.syspath_prepend(str(EXAMPLES))

    def meta(m):
        m["factory"] = f"{mod}:make_model"
        m["buffers"] = list(buffers)
        return m

    def tensors(t):
        t.update({f"buffers/{name}": torch.ones(shape) for name, shape in buffers.items()})
        return t

    b = rewrite(toy, tmp_path / "b" / "buffers.nan", meta=meta, tensors=tensors)
    monkeypatch.chdir(tmp_path)
    return b, mod


def test_a_buffer_the_model_does_not_have_is_not_added(toy, tmp_path, monkeypatch):
    b, mod = _scaled_bundle(toy, tmp_path, monkeypatch, {"scale": [32], "ghost": [32]})
    try:
        assert other_model(one_error_line(run(b)), "the model from the factory has no buffer "
                           "'ghost' that the bundle holds")
    finally:
        sys.modules.pop(mod, None)


def test_a_buffer_of_another_shape_runs_as_recorded_and_is_named(toy, tmp_path, monkeypatch):
    """A buffer the forward resizes (a quantization observer's per-channel scale, [1] at
    construction) was refused as 'the factory builds a different model'. The re-run now uses
    the bundle's (what ran: assigned, never broadcast into the factory's) and says so."""
    b, mod = _scaled_bundle(toy, tmp_path, monkeypatch, {"scale": [1]})
    try:
        res = run(b, "--json")
        assert res.exit_code in (0, 1), res.output
        rep = json.loads(res.stdout)
    finally:
        sys.modules.pop(mod, None)
    assert any(p.startswith("buffer scale [1] (the factory's [32]) ran with another shape than "
                            "the factory's model gives it: the re-run uses the bundle's")
               for p in rep["problems"]), rep["problems"]


def test_buffers_that_fit_are_loaded(toy, tmp_path, monkeypatch):
    """The control: the same factory with a recorded buffer of the right shape replays."""
    import torch

    monkeypatch.setattr(sys, "path", list(sys.path))
    mod = f"scaled_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{mod}.py").write_text("import torch\n" + SCALED)
    monkeypatch.syspath_prepend(str(EXAMPLES))

    def meta(m):
        m["factory"] = f"{mod}:make_model"
        m["buffers"] = ["scale"]
        return m

    def tensors(t):
        t["buffers/scale"] = torch.ones(32)
        return t

    b = rewrite(toy, tmp_path / "b" / "buffers.nan", meta=meta, tensors=tensors)
    monkeypatch.chdir(tmp_path)
    try:
        r = run(b)
        assert r.exit_code == 0, r.stdout + r.stderr
        assert "made by aten.div in norm" in r.stdout
    finally:
        sys.modules.pop(mod, None)


@pytest.mark.parametrize("loss", [{"kind": "module"}, {"kind": "module", "class": 3},
                                  {"kind": "plugin", "name": "x"}, {"class": "torch.nn.L1Loss"}])
def test_a_loss_entry_the_recorder_never_writes_is_a_note(toy, tmp_path, in_examples, loss):
    """The toy's event is in the forward, which needs no loss: a malformed ``loss`` entry is
    said in the report (it names no loss to re-run) and the replay goes on."""
    def meta(m):
        m["loss"] = loss
        return m

    r = run(rewrite(toy, tmp_path / "loss.nan", meta=meta))
    assert r.exit_code == 0, r.stdout + r.stderr
    assert "made by aten.div in norm" in r.stdout
    assert "the bundle's loss entry is not one the recorder writes" in r.stdout


OTHER_MODELS = """
import toy_model
from torch import nn


def no_head_bias():
    m = toy_model.Classifier()
    m.head = nn.Linear(64, 4, bias=False)
    return m


def no_encoder():
    m = toy_model.Classifier()
    m.encoder = nn.Identity()
    m.head = nn.Linear(32, 4)
    return m
"""


@pytest.mark.parametrize("fn, message", [
    ("no_head_bias", "the model from the factory has no parameter 'head.bias' that the bundle "
                     "holds"),
    ("no_encoder", "the model from the factory has no parameter 'encoder.0.bias' (and 3 more) "
                   "that the bundle holds"),
])
def test_factory_option_building_another_model(toy, tmp_path, monkeypatch, fn, message):
    monkeypatch.setattr(sys, "path", list(sys.path))
    mod = f"others_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{mod}.py").write_text(OTHER_MODELS)
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert other_model(one_error_line(run("--factory", f"{mod}:{fn}", toy)), message)
    finally:
        sys.modules.pop(mod, None)


def test_factory_option_that_does_not_import(toy, in_examples):
    spec = f"nosuch_{uuid.uuid4().hex[:8]}:make_model"
    line = one_error_line(run("--factory", spec, toy))
    mod = spec.partition(":")[0]
    assert line == (f"nanreplay: factory '{spec}' cannot be imported (ModuleNotFoundError: No "
                    f"module named '{mod}'); run from the directory that holds it or pass "
                    "--factory MOD:FN")


def test_factory_option_naming_a_missing_function(toy, in_examples):
    line = one_error_line(run("--factory", "toy_model:no_such_fn", toy))
    assert line == ("nanreplay: factory 'toy_model:no_such_fn' cannot be imported "
                    "(AttributeError: module 'toy_model' has no attribute 'no_such_fn'); run "
                    "from the directory that holds it or pass --factory MOD:FN")


def test_factory_option_without_a_colon(toy, in_examples):
    assert one_error_line(run("--factory", "toy_model", toy)) == (
        "nanreplay: factory 'toy_model' is not of the form 'module:function'; pass --factory "
        "mypkg.train:make_model")


def test_recorded_factory_that_does_not_import(toy, tmp_path, monkeypatch):
    """Under cwd (so trusted), but its import fails: one line, exit 2."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    name = f"broken_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text("import no_such_dependency_xyz\n")
    b = with_factory(toy, tmp_path / "b" / "broken.nan", f"{name}:make_model")
    monkeypatch.chdir(tmp_path)
    assert one_error_line(run(b)) == (
        f"nanreplay: factory '{name}:make_model' cannot be imported (ModuleNotFoundError: No "
        "module named 'no_such_dependency_xyz'); run from the directory that holds it or pass "
        "--factory MOD:FN")
    sys.modules.pop(name, None)


def test_factory_whose_import_error_spans_lines_still_gives_one_line(toy, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    name = f"multiline_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "raise ImportError('needs the GPU build\\n  pip install thing\\n\\n  then retry')\n")
    b = with_factory(toy, tmp_path / "b" / "multi.nan", f"{name}:make_model")
    monkeypatch.chdir(tmp_path)
    assert one_error_line(run(b)) == (
        f"nanreplay: factory '{name}:make_model' cannot be imported (ImportError: needs the GPU "
        "build pip install thing then retry); run from the directory that holds it or pass "
        "--factory MOD:FN")
    sys.modules.pop(name, None)


def _raising_model(toy, tmp_path, monkeypatch, statement: str) -> Path:
    """The toy bundle with a factory whose model's forward runs ``statement`` (a raise)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    name = f"raising_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "import toy_model\n\n"
        "class Boom(toy_model.Classifier):\n"
        "    def forward(self, x):\n"
        f"        {statement}\n\n"
        "def make_model():\n    return Boom()\n")
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.chdir(tmp_path)
    # the replay imports it: gone again at teardown (monkeypatch undoes in reverse: the
    # placeholder comes back, then the absent key)
    monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.delitem(sys.modules, name)
    return with_factory(toy, tmp_path / "b" / "boom.nan", f"{name}:make_model")


def test_model_error_spanning_lines_gives_one_line(toy, tmp_path, monkeypatch):
    """An exception from the replayed model's own code (torch's are often multi-line)."""
    b = _raising_model(toy, tmp_path, monkeypatch,
                       "raise RuntimeError('shape mismatch\\n  expected [4]\\n  got [5]')")
    assert one_error_line(run(b)) == (
        "nanreplay: replay failed (RuntimeError: shape mismatch expected [4] got [5]); re-run "
        "with --debug for the traceback")


def test_a_kilobytes_long_model_error_is_cut(toy, tmp_path, monkeypatch):
    """torch's dispatcher errors ("Could not run 'aten::aminmax' with arguments from the
    'SparseCPU' backend ... only available for these backends: [CPU, CUDA, ...]") run to
    kilobytes: the line keeps their first 300 characters."""
    b = _raising_model(toy, tmp_path, monkeypatch, "raise NotImplementedError("
                       "'no kernel for this backend: ' + 'Backend, ' * 900)")
    line = one_error_line(run(b))
    assert line.startswith("nanreplay: replay failed (NotImplementedError: no kernel for this "
                           "backend: Backend, Backend,"), line
    assert line.endswith("...); re-run with --debug for the traceback"), line
    assert len(line) == len("nanreplay: replay failed (NotImplementedError: ") + 300 + len(
        "); re-run with --debug for the traceback"), len(line)


def test_recorded_factory_that_returns_no_model(toy, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    name = f"nomodel_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text("def make():\n    return 42\n")
    b = with_factory(toy, tmp_path / "b" / "nomodel.nan", f"{name}:make")
    monkeypatch.chdir(tmp_path)
    assert one_error_line(run(b)) == (
        f"nanreplay: factory '{name}:make' returned int; it must return an nn.Module or a dict "
        "with 'model' (and optionally 'loss_fn', 'optimizer')")
    sys.modules.pop(name, None)


def test_bundle_without_a_factory_asks_for_one(toy, tmp_path, in_examples):
    """No factory and no class to rebuild the model from: the recorder's report, not
    re-run (exit 1), with one note that asks for a factory (tests/test_no_factory.py has the
    class that can be rebuilt)."""
    b = with_factory(toy, tmp_path / "nofactory.nan", None)
    result = run(b)
    assert result.exit_code == 1, result.stdout
    lines = result.stdout.splitlines()
    assert lines[0] == ("nanreplay: step 37, forward event — not re-run (factory not "
                        "imported)"), lines
    assert ("  note       the bundle names no model factory, so nothing was re-run: pass "
            "--factory MOD:FN (a function returning the model) to re-run the step, or, where it "
            "is defined (a notebook), replay.replay(path, factory=that_function)") in lines


def test_console_script_gives_the_same_single_line(tmp_path):
    """The installed ``nanreplay`` entry point, as a user runs it."""
    import shutil
    import subprocess

    exe = shutil.which("nanreplay")
    assert exe is not None, "the nanreplay console script is not installed"
    bad = tmp_path / "notes.nan"
    bad.write_text("not a bundle\n")
    proc = subprocess.run([exe, str(bad)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [f"nanreplay: {bad}: {NOT_A_BUNDLE}"]

"""Real and deliberately broken ``.nan`` bundles for the CLI tests.

``toy_bundle`` runs ``examples/train_toy.py``'s own loop under the flight recorder (in process,
a second or two) and returns the bundle it wrote. Every other helper starts from such a real
bundle and breaks one thing: through ``recorder.bundle.write_bundle`` when the damage is in the
contents (meta, a tensor), or on the raw bytes when it is in the container (zstd frame,
safetensors header).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import zstandard
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle, write_bundle

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TOY_SOURCE = EXAMPLES / "toy_model.py"


def toy_bundle(out_dir: Path) -> Path:
    """The bundle of ``examples/train_toy.py`` (step 37, NaN made by ``aten.div`` in ``norm``)."""
    saved = list(sys.path)
    sys.path.insert(0, str(EXAMPLES))
    try:
        from toy_model import make_model  # stays in sys.modules, with its file in examples/
        from train_toy import batches  # (which puts examples/ on sys.path too)
    finally:
        sys.path[:] = saved

    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    criterion = nn.CrossEntropyLoss()
    try:
        with FlightRecorder(model, optimizer, loss_fn=criterion, out_dir=out_dir,
                            factory="toy_model:make_model"):
            for x, y in batches(100):
                optimizer.zero_grad()
                loss = criterion(model(x), y)
                loss.backward()
                optimizer.step()
    except NonFiniteError as e:
        return Path(e.bundle_path)
    raise AssertionError("the toy example's planted NaN did not fire")


# The text report of the toy bundle, replayed from ``examples/`` (its golden output).
TOY_REPORT = [
    "nanreplay: step 37, forward event — reproduced",
    "  origin     forward: nan made by aten.div in norm, call 0, inputs finite",
    "  source     toy_model.py:16    return (x - mean) / std  "
    "# the bug: no eps, 0/0 when a row is constant",
    "  samples    [5]",
    "  cause      invalid — aten.div of 0 by 0 (0/0), which exact arithmetic makes too: add an "
    "eps to the denominator (std + eps, d.clamp_min(eps)) or skip the rows where it is 0",
    "  bisection  4 re-runs over 8 calls (limit 4), agrees with the instrumented pass",
]

_SHARED: dict[str, Path] = {}


def shared_toy_bundle(tmp_path_factory) -> Path:
    """One toy bundle per test session, shared by every test file (read it, never write it)."""
    if "toy" not in _SHARED:
        _SHARED["toy"] = toy_bundle(tmp_path_factory.mktemp("toy-bundle"))
    return _SHARED["toy"]


def with_precursor(src: Path, dst: Path, step: int = 30, factor: float = 100.0) -> Path:
    """``src`` with the recorded loss of ``step`` made ``factor`` times the loss before it, so
    the ring buffer holds a ``loss_jump`` precursor."""
    def edit(t):
        steps = t["ring/steps"].tolist()
        loss = t["ring/loss"].clone()
        i = steps.index(step)
        loss[i] = loss[i - 1] * factor
        t["ring/loss"] = loss
        return t

    return rewrite(src, dst, tensors=edit)


# ---------------------------------------------------------------------------------------------
# rewriting the contents


def rewrite(src: Path, dst: Path, *, meta=None, tensors=None) -> Path:
    """``src`` written again as ``dst`` with ``meta(meta)`` / ``tensors(tensors)`` applied."""
    m, t = read_bundle(src)
    if meta is not None:
        m = meta(m)
    if tensors is not None:
        t = tensors(t)
    dst.parent.mkdir(parents=True, exist_ok=True)
    stem = dst.name.removesuffix(".nan")
    path = write_bundle(dst.parent, stem, m, t)
    assert path == dst, f"{dst} already existed"
    return path


def with_factory(src: Path, dst: Path, factory: str | None) -> Path:
    def edit(m):
        m["factory"] = factory
        return m

    return rewrite(src, dst, meta=edit)


def factory_module(directory: Path, name: str, marker: Path) -> Path:
    """``directory/name.py``: the toy model's code, plus a line that creates ``marker`` when the
    module is imported (the proof that nanreplay ran it)."""
    directory.mkdir(parents=True, exist_ok=True)
    # "import torch" too: a trusted module's attributes lead to other modules (the safety
    # tests walk from it to torch.os.getpid)
    code = (f"from pathlib import Path as _P\n_P({str(marker)!r}).write_text('imported')\n"
            "import torch  # noqa: F401\n\n" + TOY_SOURCE.read_text())
    path = directory / f"{name}.py"
    path.write_text(code)
    return path


# ---------------------------------------------------------------------------------------------
# rewriting the container


def decompressed(src: Path) -> tuple[dict[str, Any], bytes]:
    """The safetensors header (as JSON) and the tensor bytes inside ``src``."""
    data = zstandard.ZstdDecompressor().decompress(src.read_bytes())
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def recompress(dst: Path, header: dict[str, Any], body: bytes) -> Path:
    """A bundle file from a (possibly edited) safetensors header and tensor bytes."""
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    payload = len(head).to_bytes(8, "little") + head + body
    dst.write_bytes(zstandard.ZstdCompressor(write_content_size=True,
                                             write_checksum=True).compress(payload))
    return dst


def edit_header(src: Path, dst: Path, edit) -> Path:
    header, body = decompressed(src)
    edit(header)
    return recompress(dst, header, body)


def _blocks(frame: bytes, start: int) -> list[bytes]:
    """The raw blocks of the zstd frame whose first block header is at ``start``."""
    out, i = [], start
    while True:
        h = int.from_bytes(frame[i:i + 3], "little")
        last, kind, size = h & 1, (h >> 1) & 3, h >> 3
        n = 3 + (1 if kind == 1 else size)  # an RLE block stores one byte
        out.append(frame[i:i + n])
        i += n
        if last:
            return out


def frame_with_content_size(payload: bytes, declared: int, *, keep_last_block: bool) -> bytes:
    """``payload`` compressed into a zstd frame whose header declares ``declared`` bytes.

    The frame header is hand-built: descriptor ``0xC0`` (8-byte content size, no single segment,
    no checksum), the compressor's own window descriptor, then ``declared``. Without the last
    block the frame just stops, as if the file were cut short while the decoder still expects
    ``declared`` bytes.
    """
    c = zstandard.ZstdCompressor(write_content_size=False, write_checksum=False).compress(payload)
    assert c[4] == 0, "expected a frame without content size, checksum or dictionary"
    blocks = _blocks(c, 6)
    if not keep_last_block:
        assert len(blocks) > 1, "payload too small to span several blocks"
        blocks = blocks[:-1]
    return c[:4] + b"\xc0" + c[5:6] + declared.to_bytes(8, "little") + b"".join(blocks)


def lying_frame(src: Path, dst: Path, declared: int) -> Path:
    """``src``'s exact contents in a frame whose header claims ``declared`` bytes."""
    payload = zstandard.ZstdDecompressor().decompress(src.read_bytes())
    dst.write_bytes(frame_with_content_size(payload, declared, keep_last_block=True))
    return dst


def huge_tensor_bundle(dst: Path, nbytes: int, factory: str | None = None) -> Path:
    """A bundle whose header and frame consistently claim one ``nbytes`` tensor, of which the
    file holds only the first MiB: reading it must neither allocate nor touch ``nbytes``. Its
    frame's blocks are whole (the last one marked last), so only decoding finds it short."""
    meta = {"format": "nanreplay-bundle/1", "event": {"step": 1, "phase": "forward"},
            "factory": factory, "params": []}
    header = {"__metadata__": {"format": "nanreplay-bundle", "version": "1", "complex": "[]",
                               "meta": json.dumps(meta)},
              "x": {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]}}
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    prefix = len(head).to_bytes(8, "little") + head
    frame = frame_with_content_size(prefix + bytes(1 << 20), len(prefix) + nbytes,
                                    keep_last_block=True)
    dst.write_bytes(frame)
    return dst


def copy(src: Path, dst: Path) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    return dst


# ---------------------------------------------------------------------------------------------
# running the CLI


def line_number(models: str, text: str) -> int:
    """The first line of ``tests/<models>`` holding ``text``: where a planted bug's op is
    written (found by its text, so a test does not break when lines above it move)."""
    lines = (Path(__file__).parent / models).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


def source_line(models: str, text: str) -> str:
    """``"<models>:N"`` (see :func:`line_number`), as a report names a source line."""
    return f"{models}:{line_number(models, text)}"


def invoke_cli(*args):
    """``nanreplay ARGS`` through click's runner; a raw exception or traceback fails the test."""
    from click.testing import CliRunner

    from replay.cli import main

    result = CliRunner().invoke(main, [str(a) for a in args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"nanreplay raised {result.exception!r}") from result.exception
    assert "Traceback" not in result.stdout + result.stderr
    return result


def replay_report(bundle, *args: str) -> tuple[dict, int]:
    """``nanreplay BUNDLE --json ARGS`` in this process: the report and the exit code (0: the
    event reproduced, 1: not); nothing on stderr, no raw exception."""
    r = invoke_cli(bundle, "--json", *args)
    assert r.stderr == "" and r.exit_code in (0, 1), (r.exit_code, r.stderr)
    return json.loads(r.stdout), r.exit_code


def nanreplay_json(bundle, *args: str, code: int | None = 0) -> dict:
    """The ``--json`` report of a replay that exits with ``code`` (None: either)."""
    rep, got = replay_report(bundle, *args)
    assert code is None or got == code, (got, rep.get("cause"), rep.get("reproduced"))
    return rep


def check_report(rep: dict, **expected) -> None:
    """The report's fields named in ``expected``: ``cause`` and ``reproduced`` of the report,
    ``step`` of its event, any other of its origin."""
    o = rep["origin"]
    got = {k: (rep[k] if k in ("cause", "reproduced") else rep["event"]["step"] if k == "step"
               else o.get(k)) for k in expected}
    assert got == expected, rep


def one_error_line(result) -> str:
    """The single ``nanreplay: ...`` line of a failed run (exit 2, nothing on stdout)."""
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("nanreplay: "), lines[0]
    return lines[0]

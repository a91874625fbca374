"""Bundles crafted or damaged below the metadata's types (tests/test_bad_bundles.py): JSON the
parser chokes on (nesting, 5000-digit integers, NaN literals), table entries ``int()`` would
misread, a decompression bomb, keys the metadata names that the file lacks, integer weights.
Each gives one ``nanreplay: <path>: what; what to do`` line and exit 2, never "replay failed"
(the CLI's last resort for a bug) nor a raw exception."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
import zstandard
from bundles import EXAMPLES, decompressed, edit_header, one_error_line, rewrite
from bundles import invoke_cli as run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import replay
from recorder.errors import BundleError


@pytest.fixture
def in_examples(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(EXAMPLES)


def _payload(head: bytes, body: bytes) -> bytes:
    head += b" " * (-len(head) % 8)
    return len(head).to_bytes(8, "little") + head + body


def _raw(edit):
    """The bundle with its safetensors header's text edited (``edit(text) -> text``)."""
    def make(base: Path, d: Path) -> Path:
        header, body = decompressed(base)
        out = d / "hostile bündle.nan"  # (a space and a non-ASCII letter in the name)
        out.write_bytes(zstandard.ZstdCompressor(write_checksum=True).compress(
            _payload(edit(json.dumps(header)).encode(), body)))
        return out
    return make


def _meta_text(text: str):
    def edit(h):
        h["__metadata__"]["meta"] = text
    return lambda base, d: edit_header(base, d / "meta text.nan", edit)


def _first(edit):
    def e(h):
        edit(h[min((k for k in h if k != "__metadata__"),
                   key=lambda k: h[k]["data_offsets"][0])])
    return lambda base, d: edit_header(base, d / "table.nan", e)


def _complex_first(h):
    h["__metadata__"]["complex"] = json.dumps([next(k for k in h if k != "__metadata__")])


def _bomb(base: Path, d: Path) -> Path:
    """A complete zstd frame of 65 KB that decodes to a 2 GiB tensor of zeros: RLE blocks,
    4 bytes each for 128 KiB."""
    n = 2 << 30
    meta = json.dumps({"event": {"step": 1}, "params": []})
    head = json.dumps({"__metadata__": {"format": "nanreplay-bundle", "version": "1",
                                        "meta": meta},
                       "x": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}).encode()
    prefix = _payload(head, b"")

    def block(last: int, kind: int, size: int) -> bytes:
        return (last | kind << 1 | size << 3).to_bytes(3, "little")

    # frame header: 8-byte content size, a 2 MiB window; then the header raw, the zeros RLE
    out = bytearray(b"\x28\xb5\x2f\xfd\xc0\x58" + (len(prefix) + n).to_bytes(8, "little"))
    out += block(0, 0, len(prefix)) + prefix
    blocks = n >> 17
    out += (block(0, 1, 1 << 17) + b"\0") * (blocks - 1) + block(1, 1, 1 << 17) + b"\0"
    (d / "bomb.nan").write_bytes(out)
    return d / "bomb.nan"


NOT_JSON = "metadata 'meta' is missing or not JSON; the file is corrupted"
MALFORMED = "has a malformed entry; the file is corrupted"
CASES = [
    ("meta nested 100k deep", _meta_text('{"event": {"step": 1}, "x": ' + "[" * 100_000
                                         + "]" * 100_000 + "}"), NOT_JSON),
    ("meta with a 5000-digit integer", _meta_text('{"event": {"step": 1' + "0" * 5000 + "}}"),
     NOT_JSON),
    ("meta with a NaN literal", _meta_text('{"event": {"step": NaN}}'), NOT_JSON),
    ("header nested 100k deep",
     _raw(lambda t: t[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}"),
     "header is not JSON (nested too deeply); the file is corrupted"),
    ("offsets Infinity", _raw(lambda t: t.replace('"data_offsets": [0,',
                                                  '"data_offsets": [Infinity,', 1)),
     "header is not JSON (Infinity is not JSON); the file is corrupted"),
    ("shape a string of digits", _first(lambda e: e.update(shape="12")), MALFORMED),
    ("shape of floats", _first(lambda e: e.update(shape=[float(s) for s in e["shape"]])),
     MALFORMED),
    ("shape beyond int64 with no bytes", _first(lambda e: e.update(
        shape=[0, 1 << 70], data_offsets=[0, 0])), "has a dimension above 2**63"),
    ("complex names a tensor that is no pairs", lambda base, d: edit_header(
        base, d / "complex.nan", _complex_first), "which is not a tensor of real pairs"),
    ("decompression bomb", _bomb, "bytes of tensors and header (over 1000 "
     "times as many: a decompression bomb"),
]


@pytest.mark.parametrize("make,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_bundle_gives_one_line(make, message, toy, tmp_path, in_examples):
    path = make(toy, tmp_path)
    for args in ((path,), ("--json", path), ("--info", path)):
        line = one_error_line(run(*args))
        assert line.startswith(f"nanreplay: {path}: ") and message in line, line
    with pytest.raises(BundleError, match=re.escape(message)):
        replay.replay(path)


def _rename_tensor(h):
    h["ring/loss-renamed"] = h.pop("ring/loss")


def test_a_key_the_metadata_names_that_the_file_lacks(toy, tmp_path, in_examples):
    """A tensor renamed (a flipped bit in its name) and an optimizer without its param_groups:
    one line naming the key, and still a KeyError for code that tries a key and falls back."""
    renamed = edit_header(toy, tmp_path / "renamed.nan", _rename_tensor)
    assert one_error_line(run(renamed)) == (
        "nanreplay: the bundle holds no tensor 'ring/loss', which its metadata names; the file "
        "is corrupted or was not written by the recorder; pass the bundle it wrote")

    def no_groups(m):
        del m["optimizer"]["param_groups"]
        return m
    groupless = rewrite(toy, tmp_path / "groupless.nan", meta=no_groups)
    assert "the bundle's metadata lacks 'param_groups', which the replay reads" in \
        one_error_line(run(groupless))
    with pytest.raises(KeyError):
        replay.replay(groupless)


def test_integer_weights_for_a_trained_float_parameter(toy, tmp_path, in_examples):
    key = "weights/encoder.0.weight"

    def as_int(t):
        t[key] = t[key].to(torch.int64)
        return t
    path = rewrite(toy, tmp_path / "intweights.nan", tensors=as_int)
    assert one_error_line(run(path)) == (
        f"nanreplay: {key} is torch.int64 in the bundle but a trained torch.float32 parameter "
        "in the model from the factory; the file is corrupted or was written for another "
        "model: pass the bundle the recorder wrote")


@pytest.fixture(scope="module")
def header_payload(tmp_path_factory):
    from bundles import shared_toy_bundle
    raw = zstandard.ZstdDecompressor().decompress(shared_toy_bundle(tmp_path_factory).read_bytes())
    return raw, int.from_bytes(raw[:8], "little")


@settings(max_examples=15, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_a_bit_flipped_in_the_header_is_one_line_or_a_replay(where, bit, header_payload,
                                                             tmp_path, in_examples):
    """A bit flipped anywhere in the safetensors header (size, table, metadata), the frame
    recompressed so that its checksum holds: the replay runs (exit 0 or 1: a flip it cannot
    tell from a real value) or refuses in one line that is not the CLI's last resort."""
    raw, size = header_payload
    i = int(where * (8 + size))
    flipped = bytearray(raw)
    flipped[i] ^= 1 << bit
    path = tmp_path / f"flip-{i}-{bit}.nan"
    path.write_bytes(zstandard.ZstdCompressor(write_checksum=True).compress(bytes(flipped)))
    r = run("--json", path)
    if r.exit_code != 2:
        assert r.exit_code in (0, 1) and r.stderr == "", (r.exit_code, r.stderr)
        return
    assert "replay failed" not in one_error_line(r)

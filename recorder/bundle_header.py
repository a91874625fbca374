"""A ``.nan`` bundle's header (its metadata and tensor table), read without torch: what
``nanreplay --info`` and ``--strip``'s checks need, which must start in a fraction of a second.
:class:`recorder.bundle.BundleReader` adds the tensors."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import zstandard

from .errors import BundleError
from .frame_end import frame_end

FORMAT = "nanreplay-bundle"
VERSION = 1
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_MAX_HEADER = 256 * 1024 * 1024  # a safetensors header above this is not one we wrote
CHUNK = 1 << 20
# a file that stops inside its bundle: the writer never leaves one under a bundle's name (it
# writes a temporary file and links it into place), so it is a copy, or a foreign writer's
CUT_SHORT = ("the file is incomplete (a copy or download cut short, or a write killed "
             "midway); copy it again from where the recorder wrote it, or re-run the training "
             "to record a new bundle")
# bytes per element of each safetensors dtype the writer uses (recorder.bundle: torch's names)
ITEMSIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
             "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


def jsonable(x: Any) -> Any:
    """``x`` with non-finite floats spelt as strings (JSON has no NaN) and tuples as lists."""
    if isinstance(x, float) and not math.isfinite(x):
        # 'nan', 'inf', '-inf': float() reads each back (a float subclass, NumPy's float64
        # from a schedule's np.cos or np.sqrt, would repr as 'np.float64(inf)')
        return repr(float(x))
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


class HeaderReader:
    """A bundle's metadata and tensor table (``entries``: name, safetensors dtype, shape,
    bytes), read and checked on open; the tensors, read by :class:`recorder.bundle.BundleReader`,
    follow in the stream."""

    def __init__(self, path: str | os.PathLike, *, whole: bool = True):
        self.path = Path(path)
        self._whole = whole  # False: a frame cut short is found only when its data is read
        self._file = None
        self._stream = None
        self._consumed = False
        try:
            self._open()
        except BaseException:  # not only BundleError: never leave the file open
            self.close()
            raise

    # -- context manager --
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def error(self, what: str, fix: str = "") -> BundleError:
        return BundleError(f"{self.path}: {what}" + (f"; {fix}" if fix else ""))

    def _open(self) -> None:
        try:
            self._file = open(self.path, "rb")
        except OSError as e:
            raise self.error(f"cannot open ({e.strerror})") from None
        declared = self._frame().content_size
        self._stream = zstandard.ZstdDecompressor().stream_reader(
            self._file, read_size=CHUNK, read_across_frames=False, closefd=False)
        size = int.from_bytes(self._read_exact(8, "header size"), "little")
        if size > _MAX_HEADER:
            raise self.error(f"header claims {size} bytes (limit {_MAX_HEADER})",
                             "the file is corrupted or not a bundle")
        try:
            header = json.loads(self._read_exact(size, "header"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self.error(f"header is not JSON ({e.msg if hasattr(e, 'msg') else e})",
                             "the file is corrupted") from None
        if not isinstance(header, dict):
            raise self.error("header is not a JSON object", "the file is corrupted")
        md = header.pop("__metadata__", None)
        if not isinstance(md, dict) or md.get("format") != FORMAT:
            raise self.error("safetensors file without nanreplay metadata",
                             "pass a bundle written by the recorder")
        try:
            version = int(md.get("version", ""))
        except (TypeError, ValueError):  # a JSON list, object or null is no version either
            raise self.error(f"format version {md.get('version')!r} is not a number") from None
        if version > VERSION:
            raise self.error(f"format version {version} is newer than this nanreplay reads "
                             f"({VERSION})", "upgrade nanreplay: pip install -U nanreplay")
        self.format_version = version
        try:
            self.meta = json.loads(md["meta"])
            self._complex = set(json.loads(md.get("complex", "[]")))
        except (KeyError, TypeError, json.JSONDecodeError):
            raise self.error("metadata 'meta' is missing or not JSON",
                             "the file is corrupted") from None
        if not isinstance(self.meta, dict):
            raise self.error("metadata 'meta' is not a JSON object", "the file is corrupted")
        self.entries = self._check_table(header)
        data = sum(n for _, _, _, n in self.entries)
        expected = 8 + size + data
        if declared not in (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR) \
                and declared != expected:
            raise self.error(f"zstd frame declares {declared} bytes but the header describes "
                             f"{expected}", "the file is corrupted")

    def _frame(self) -> zstandard.FrameParameters:
        """The frame's parameters, once the file is known to hold the whole frame."""
        size = os.fstat(self._file.fileno()).st_size
        if size == 0:
            raise self.error("empty (0 bytes)", CUT_SHORT)
        magic = self._file.read(4)
        if magic != _ZSTD_MAGIC:
            if (kind := {".py": "a Python script", ".ipynb": "a notebook"}.get(
                    Path(self.path).suffix)) is not None:  # (the training code given)
                raise self.error(f"{kind}, not a nanreplay bundle",
                                 "pass the .nan file the recorder wrote in its out_dir "
                                 "(nan-bundles/ unless the run gave another)")
            raise self.error("not a nanreplay bundle (no zstd frame at the start)",
                             "pass the .nan file the recorder wrote")
        self._file.seek(0)
        try:
            params = zstandard.get_frame_parameters(self._file.read(18))
        except zstandard.ZstdError as e:
            raise self.error(f"corrupted zstd frame header ({e})") from None
        end, why = frame_end(self._file, size) if self._whole else (size, "")
        if end < 0:  # (found before decoding gigabytes up to the cut)
            raise self.error(f"truncated: {why}", CUT_SHORT)
        self._file.seek(0)
        return params

    def _check_table(self, header: dict[str, Any]) -> list[tuple[str, str, list[int], int]]:
        entries, offset = [], 0
        rows = []
        for name, spec in header.items():
            try:
                dtype, size = spec["dtype"], ITEMSIZES[spec["dtype"]]
                shape = [int(d) for d in spec["shape"]]
                begin, end = (int(x) for x in spec["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise self.error(f"tensor {name!r} has a malformed entry",
                                 "the file is corrupted") from None
            if any(d < 0 for d in shape):
                raise self.error(f"tensor {name!r} has a negative dimension")
            rows.append((begin, end, name, dtype, shape, size))
        for begin, end, name, dtype, shape, size in sorted(rows, key=lambda r: (r[0], r[1])):
            n = math.prod(shape) * size
            if begin != offset or end - begin != n:
                raise self.error(f"tensor {name!r} has offsets [{begin}, {end}) but its shape "
                                 f"{shape} needs {n} bytes at {offset}", "the file is corrupted")
            offset = end
            entries.append((name, dtype, shape, n))
        return entries

    def _read_exact(self, n: int, what: str) -> bytes:
        buf = bytearray(n)
        self._readinto(memoryview(buf), what)
        return bytes(buf)

    def _readinto(self, view: memoryview, what: str) -> None:
        got = 0
        try:
            while got < len(view):
                k = self._stream.readinto(view[got:])
                if not k:
                    raise self.error(f"truncated while reading {what} ({got} of {len(view)} "
                                     "bytes)", CUT_SHORT)
                got += k
        except zstandard.ZstdError as e:
            raise self.error(f"corrupted data while reading {what} ({e})",
                             "the file is damaged; copy it again") from None

    def _skip(self, n: int, name: str) -> None:
        scratch = memoryview(bytearray(min(n, CHUNK)))
        left = n
        while left:
            k = min(left, len(scratch))
            self._readinto(scratch[:k], f"tensor {name!r}")
            left -= k

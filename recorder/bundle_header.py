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

from .bundle_keys import Metadata
from .errors import BundleError
from .frame_end import frame_end

FORMAT = "nanreplay-bundle"
VERSION = 1
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_MAX_HEADER = 256 * 1024 * 1024  # a safetensors header above this is not one we wrote
CHUNK = 1 << 20
_MAX_DIM = (1 << 63) - 1
# a decompression bomb: a small file whose frame decodes to gigabytes (of one repeated byte).
# The recorder's bundles (weights, gradients, optimizer state) compress a few times at most;
# one above both limits is refused before its tensors are allocated
_BOMB_BYTES, _BOMB_RATIO = 1 << 30, 1000
# a file that stops inside its bundle: the writer never leaves one under a bundle's name (it
# writes a temporary file and links it into place), so it is a copy, or a foreign writer's
CUT_SHORT = ("the file is incomplete (a copy or download cut short, or a write killed "
             "midway); copy it again from where the recorder wrote it, or re-run the training "
             "to record a new bundle")
# bytes per element of each safetensors dtype the writer uses (recorder.bundle: torch's names)
ITEMSIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
             "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def strict_json(text: str | bytes, objects: type[dict] = dict) -> Any:
    """``text`` parsed as strict JSON (no NaN or Infinity literals: the writer never makes
    them); a ValueError for anything else, including nesting too deep for the parser and an
    integer too long to convert, which ``json.loads`` raises as other errors. ``objects``:
    the class its JSON objects are made as."""
    try:
        return json.loads(text, parse_constant=_refuse_constant, object_hook=objects)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _ints(values: Any) -> list[int]:
    """A JSON list of integers (a shape, offsets), or a ValueError: no strings, which ``int``
    would read digit by digit, no floats it would cut, no booleans."""
    if not isinstance(values, list) or not all(type(v) is int for v in values):
        raise ValueError(values)
    return values


def physical_memory() -> int | None:
    """Bytes of RAM on this machine (``None`` where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


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
            raise self.error(f"cannot open ({e.strerror})", "pass the path of the .nan file "
                             "the recorder wrote (its out_dir holds them)") from None
        declared = self._frame().content_size
        self._stream = zstandard.ZstdDecompressor().stream_reader(
            self._file, read_size=CHUNK, read_across_frames=False, closefd=False)
        size = int.from_bytes(self._read_exact(8, "header size"), "little")
        if size > _MAX_HEADER:
            raise self.error(f"header claims {size} bytes (limit {_MAX_HEADER})",
                             "the file is corrupted or not a bundle")
        try:
            header = strict_json(self._read_exact(size, "header"))
        except ValueError as e:  # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
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
            raise self.error(f"format version {md.get('version')!r:.40} is not a number",
                             "the file is corrupted or not a bundle") from None
        if version > VERSION:
            raise self.error(f"format version {version} is newer than this nanreplay reads "
                             f"({VERSION})", "upgrade nanreplay: pip install -U nanreplay")
        self.format_version = version
        try:
            self.meta = strict_json(md["meta"], Metadata)
            self._complex = strict_json(md.get("complex", "[]"))
        except (KeyError, TypeError, ValueError):
            raise self.error("metadata 'meta' is missing or not JSON",
                             "the file is corrupted") from None
        if not isinstance(self.meta, dict):
            raise self.error("metadata 'meta' is not a JSON object", "the file is corrupted")
        self.entries = self._check_table(header)
        self._check_complex()
        data = sum(n for _, _, _, n in self.entries)
        expected = 8 + size + data
        self._check_ratio(expected)
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

    def _check_ratio(self, expected: int) -> None:
        stored = max(os.fstat(self._file.fileno()).st_size, 1)
        mem = physical_memory()  # (a claim beyond it is refused as such when it is read)
        if _BOMB_BYTES < expected <= (mem or expected) and expected > _BOMB_RATIO * stored:
            raise self.error(f"its {stored} bytes claim {expected} bytes of tensors and header "
                             f"(over {_BOMB_RATIO} times as many: a decompression bomb, which "
                             "the recorder's bundles never are); nothing was allocated",
                             "the file is not a bundle the recorder wrote, or is damaged")

    def _check_table(self, header: dict[str, Any]) -> list[tuple[str, str, list[int], int]]:
        entries, offset = [], 0
        rows = []
        for name, spec in header.items():
            try:
                dtype, size = spec["dtype"], ITEMSIZES[spec["dtype"]]
                shape, (begin, end) = _ints(spec["shape"]), _ints(spec["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise self.error(f"tensor {name!r} has a malformed entry",
                                 "the file is corrupted") from None
            if any(d < 0 for d in shape):
                raise self.error(f"tensor {name!r} has a negative dimension",
                                 "the file is corrupted")
            if any(d > _MAX_DIM for d in shape):  # (torch sizes are int64: [0, 2**70] holds
                raise self.error(f"tensor {name!r} has a dimension above 2**63",  # no bytes)
                                 "the file is corrupted")
            rows.append((begin, end, name, dtype, shape, size))
        for begin, end, name, dtype, shape, size in sorted(rows, key=lambda r: (r[0], r[1])):
            n = math.prod(shape) * size
            if begin != offset or end - begin != n:
                raise self.error(f"tensor {name!r} has offsets [{begin}, {end}) but its shape "
                                 f"{shape} needs {n} bytes at {offset}", "the file is corrupted")
            offset = end
            entries.append((name, dtype, shape, n))
        return entries

    def _check_complex(self) -> None:
        """The tensors metadata 'complex' names (stored as real pairs): each a float tensor of
        the table whose last dimension is 2, so that ``view_as_complex`` takes it."""
        pairs = {name: (dtype, shape) for name, dtype, shape, _ in self.entries}
        names = self._complex if isinstance(self._complex, list) else [self._complex]
        for name in names:
            dtype, shape = pairs.get(name, ("", [])) if isinstance(name, str) else ("", [])
            if dtype not in ("F64", "F32", "F16") or not shape or shape[-1] != 2:
                raise self.error(f"metadata 'complex' names {str(name)[:80]!r}, which is not a "
                                 "tensor of real pairs", "the file is corrupted")
        self._complex = set(names)

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

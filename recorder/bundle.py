"""The ``.nan`` bundle: one zstd frame holding one standard safetensors file.

Writer and reader live side by side (the format is specified in ``docs/bundle-format.md``).
``zstd -d x.nan -o x.safetensors`` gives a file any safetensors reader opens. Every non-tensor
datum is JSON in the safetensors ``__metadata__``; nothing is ever pickled.

Writing is streamed (one tensor on the host at a time, bytes handed to zstd without a copy) and
atomic (temporary file, fsync, link into place without overwriting). Reading is streamed too:
each tensor is decompressed straight into the buffer that becomes its storage.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import zstandard

from .errors import BundleError
from .frame_end import frame_end

FORMAT = "nanreplay-bundle"
VERSION = 1
SUFFIX = ".nan"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_MAX_HEADER = 256 * 1024 * 1024  # a safetensors header above this is not one we wrote
_CHUNK = 1 << 20
# a file that stops inside its bundle: the writer never leaves one under a bundle's name (it
# writes a temporary file and links it into place), so it is a copy, or a foreign writer's
_CUT_SHORT = ("the file is incomplete (a copy or download cut short, or a write killed "
              "midway); copy it again from where the recorder wrote it, or re-run the training "
              "to record a new bundle")

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}
_FROM_STR = {v: k for k, v in _DTYPES.items()}


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ---------------------------------------------------------------------------------------------
# Writing


def _prepare(name: str, t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The tensor as it will be stored (complex as real pairs) and whether it was complex."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"bundle entry {name!r} is a {type(t).__name__}, not a tensor")
    if t.layout != torch.strided:
        raise TypeError(
            f"bundle entry {name!r} is a {t.layout} tensor; the bundle stores dense tensors only "
            "(make it dense with .to_dense())")
    t = t.detach()
    if t.is_complex():
        return torch.view_as_real(t.resolve_conj()), True
    if t.dtype not in _DTYPES:
        raise TypeError(f"bundle entry {name!r} has dtype {t.dtype}, which safetensors cannot hold")
    return t, False


def _host_bytes(t: torch.Tensor) -> tuple[torch.Tensor, memoryview]:
    """A contiguous host copy of ``t`` (or ``t`` itself) and a zero-copy view of its bytes."""
    t = t.to("cpu").contiguous()
    n = t.numel() * t.element_size()
    if n == 0:
        return t, memoryview(b"")
    raw = (ctypes.c_ubyte * n).from_address(t.data_ptr())
    return t, memoryview(raw).cast("B")


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


def header_bytes(meta: dict[str, Any], entries: list[tuple[str, torch.Tensor]],
                 complex_keys: list[str]) -> tuple[bytes, int]:
    """The safetensors header (padded to 8 bytes) and the size of the data that follows."""
    header: dict[str, Any] = {
        "__metadata__": {
            "format": FORMAT,
            "version": str(VERSION),
            "complex": json.dumps(complex_keys),
            "meta": json.dumps(jsonable(meta), allow_nan=False, separators=(",", ":")),
        }
    }
    offset = 0
    for name, t in entries:
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return raw, offset


def write_bundle(out_dir: str | os.PathLike, stem: str, meta: dict[str, Any],
                 tensors: dict[str, torch.Tensor], *, level: int = 1) -> Path:
    """Write ``tensors`` and ``meta`` as ``out_dir/stem.nan`` and return the path.

    Never overwrites: if the name exists, ``stem-1.nan``, ``stem-2.nan``... is used. On any error
    the partial file is removed and the error propagates; nothing else is touched.
    """
    out_dir = Path(out_dir)
    entries, complex_keys = [], []
    for name, t in tensors.items():
        stored, was_complex = _prepare(name, t)
        entries.append((name, stored))
        if was_complex:
            complex_keys.append(name)
    head, data_size = header_bytes(meta, entries, complex_keys)
    total = 8 + len(head) + data_size
    # one temporary per process *and thread*: two threads writing the same stem at once
    # (two recorders in one process) must not share, truncate or unlink each other's file
    tmp = out_dir / f".{stem}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        with open(tmp, "wb") as f:
            cctx = zstandard.ZstdCompressor(level=level, threads=-1, write_checksum=True,
                                            write_content_size=True)
            # no `with`: its exit would end the frame even after a failed write, and the
            # frame's "Src size is incorrect" would replace the real error (ENOSPC, ...)
            zf = cctx.stream_writer(f, size=total, closefd=False, write_size=_CHUNK)
            zf.write(len(head).to_bytes(8, "little"))
            zf.write(head)
            for _, t in entries:
                host, view = _host_bytes(t)
                for start in range(0, len(view), 64 * _CHUNK):
                    zf.write(view[start:start + 64 * _CHUNK])
                del host, view
            zf.close()  # ends the frame; f stays open (closefd=False)
            f.flush()
            os.fsync(f.fileno())
        path = _link_unique(tmp, out_dir, stem)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(out_dir)
    return path


def _link_unique(tmp: Path, out_dir: Path, stem: str) -> Path:
    """Give ``tmp`` its final name without ever replacing an existing file."""
    for i in range(10_000):
        path = out_dir / (f"{stem}{SUFFIX}" if i == 0 else f"{stem}-{i}{SUFFIX}")
        try:
            os.link(tmp, path)
            return path
        except FileExistsError:
            continue
        except OSError:  # file systems without hard links: exclusive create, then rename
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                continue
            os.close(fd)
            os.replace(tmp, path)
            return path
    raise FileExistsError(f"{out_dir}: 10000 bundles named {stem}*{SUFFIX} already exist")


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# Reading


class BundleReader:
    """Streamed, validating reader of one bundle.

    >>> with BundleReader("step00000006-rank0.nan") as r:        # doctest: +SKIP
    ...     r.meta["event"]["step"]
    ...     weights = {k: t for k, t in r.tensors() if k.startswith("weights/")}

    The metadata and the tensor table are read and checked on open; tensors are decompressed in
    file order, each into its own buffer. ``tensors()`` can be called once per open.
    """

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
    def __enter__(self) -> BundleReader:
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
            self._file, read_size=_CHUNK, read_across_frames=False, closefd=False)
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
            raise self.error("empty (0 bytes)", _CUT_SHORT)
        magic = self._file.read(4)
        if magic != _ZSTD_MAGIC:
            raise self.error("not a nanreplay bundle (no zstd frame at the start)",
                             "pass the .nan file the recorder wrote")
        self._file.seek(0)
        try:
            params = zstandard.get_frame_parameters(self._file.read(18))
        except zstandard.ZstdError as e:
            raise self.error(f"corrupted zstd frame header ({e})") from None
        end, why = frame_end(self._file, size) if self._whole else (size, "")
        if end < 0:  # (found before decoding gigabytes up to the cut)
            raise self.error(f"truncated: {why}", _CUT_SHORT)
        self._file.seek(0)
        return params

    def _check_table(self, header: dict[str, Any]) -> list[tuple[str, torch.dtype, list[int], int]]:
        entries, offset = [], 0
        rows = []
        for name, spec in header.items():
            try:
                dtype = _FROM_STR[spec["dtype"]]
                shape = [int(d) for d in spec["shape"]]
                begin, end = (int(x) for x in spec["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise self.error(f"tensor {name!r} has a malformed entry",
                                 "the file is corrupted") from None
            if any(d < 0 for d in shape):
                raise self.error(f"tensor {name!r} has a negative dimension")
            rows.append((begin, end, name, dtype, shape))
        for begin, end, name, dtype, shape in sorted(rows, key=lambda r: (r[0], r[1])):
            n = math.prod(shape) * _itemsize(dtype)
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
                                     "bytes)", _CUT_SHORT)
                got += k
        except zstandard.ZstdError as e:
            raise self.error(f"corrupted data while reading {what} ({e})",
                             "the file is damaged; copy it again") from None

    def tensors(self, want=None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` in file order; skip names for which ``want(name)`` is false."""
        if self._consumed:
            raise RuntimeError("BundleReader.tensors() can be iterated once; reopen the bundle")
        self._consumed = True
        for name, dtype, shape, n in self.entries:
            if want is not None and not want(name):
                self._skip(n, name)
                continue
            if n == 0:
                t = torch.empty(shape, dtype=dtype)
            else:
                buf, view = self._buffer(n, name)
                self._readinto(view, f"tensor {name!r}")
                del view
                t = buf.view(dtype).reshape(shape)
            if name in self._complex:
                t = torch.view_as_complex(t)
            yield name, t
            del t  # the caller holds it if it wants it: never two tensors alive here
            buf = None
        try:
            trailing = self._stream.read(1)
        except zstandard.ZstdError:  # bytes after the frame that are not a zstd frame
            trailing = True
        if trailing:
            raise self.error("trailing data after the last tensor", "the file is corrupted")

    def _buffer(self, n: int, name: str) -> tuple[torch.Tensor, memoryview]:
        """An uninitialised ``n``-byte host tensor and a view of its bytes to read into.

        Nothing is written to it before the data arrives (``bytearray(n)`` zero-fills), so a
        header that claims a huge tensor the file does not hold costs no memory: the read stops
        at the end of the file. A claim larger than the machine's memory is refused up front.
        """
        mem = _physical_memory()
        if mem is not None and n > mem:
            raise self.error(f"tensor {name!r} claims {n} bytes, more than this machine's "
                             f"memory ({mem} bytes)", "the file is corrupted or not a bundle")
        try:
            buf = torch.empty(n, dtype=torch.uint8)
        except (RuntimeError, MemoryError):
            raise self.error(f"tensor {name!r} claims {n} bytes, which cannot be allocated "
                             "here", "the file is corrupted or not a bundle") from None
        return buf, memoryview((ctypes.c_ubyte * n).from_address(buf.data_ptr())).cast("B")

    def _skip(self, n: int, name: str) -> None:
        scratch = memoryview(bytearray(min(n, _CHUNK)))
        left = n
        while left:
            k = min(left, len(scratch))
            self._readinto(scratch[:k], f"tensor {name!r}")
            left -= k


def read_bundle(path: str | os.PathLike, want=None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Read a whole bundle: ``(meta, tensors)``. Raises :class:`BundleError` on anything bad."""
    with BundleReader(path) as r:
        total = sum(n for name, _, _, n in r.entries if want is None or want(name))
        mem = _physical_memory()
        if mem is not None and total > mem:
            raise r.error(f"its tensors claim {total} bytes, more than this machine's memory "
                          f"({mem} bytes)", "the file is corrupted, or read it on a larger "
                          "machine")
        return r.meta, dict(r.tensors(want))


def _physical_memory() -> int | None:
    """Bytes of RAM on this machine (``None`` where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None

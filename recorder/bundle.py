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
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import zstandard

from .bundle_header import CHUNK, FORMAT, VERSION, HeaderReader, jsonable
from .bundle_header import physical_memory as _physical_memory
from .bundle_keys import Tensors
from .partial_writes import temp_name

SUFFIX = ".nan"
_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}
_FROM_STR = {v: k for k, v in _DTYPES.items()}  # (the header's names, see bundle_header)


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
    if type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
        raise TypeError(f"bundle entry {name!r} is a {type(t).__qualname__} tensor subclass with "
                        "its own __torch_dispatch__ (no storage of its own); store its inner "
                        "tensors (recorder.wrapped.store_wrapped)")
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
    if t.data_ptr() == 0:  # (never read address 0: a tensor without storage of its own)
        raise TypeError(f"a {type(t).__qualname__} tensor of shape {list(t.shape)} has no "
                        "storage (data_ptr() is 0): the bundle cannot hold its bytes")
    raw = (ctypes.c_ubyte * n).from_address(t.data_ptr())
    return t, memoryview(raw).cast("B")


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
    # one temporary per host, process *and thread*: two threads writing the same stem at once
    # (two recorders in one process) must not share, truncate or unlink each other's file;
    # its name says whose it is if the write never finishes (see recorder.partial_writes)
    tmp = out_dir / temp_name(stem)
    try:
        with open(tmp, "wb") as f:
            cctx = zstandard.ZstdCompressor(level=level, threads=-1, write_checksum=True,
                                            write_content_size=True)
            # no `with`: its exit would end the frame even after a failed write, and the
            # frame's "Src size is incorrect" would replace the real error (ENOSPC, ...)
            zf = cctx.stream_writer(f, size=total, closefd=False, write_size=CHUNK)
            zf.write(len(head).to_bytes(8, "little"))
            zf.write(head)
            for _, t in entries:
                host, view = _host_bytes(t)
                for start in range(0, len(view), 64 * CHUNK):
                    zf.write(view[start:start + 64 * CHUNK])
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


class BundleReader(HeaderReader):
    """Streamed, validating reader of one bundle.

    >>> with BundleReader("step00000006-rank0.nan") as r:        # doctest: +SKIP
    ...     r.meta["event"]["step"]
    ...     weights = {k: t for k, t in r.tensors() if k.startswith("weights/")}

    The metadata and the tensor table are read and checked on open; tensors are decompressed in
    file order, each into its own buffer. ``tensors()`` can be called once per open.
    """

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
                t = torch.empty(shape, dtype=_FROM_STR[dtype])
            else:
                buf, view = self._buffer(n, name)
                self._readinto(view, f"tensor {name!r}")
                del view
                t = buf.view(_FROM_STR[dtype]).reshape(shape)
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


def read_bundle(path: str | os.PathLike, want=None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Read a whole bundle: ``(meta, tensors)``. Raises :class:`BundleError` on anything bad."""
    with BundleReader(path) as r:
        total = sum(n for name, _, _, n in r.entries if want is None or want(name))
        mem = _physical_memory()
        if mem is not None and total > mem:
            raise r.error(f"its tensors claim {total} bytes, more than this machine's memory "
                          f"({mem} bytes)", "the file is corrupted, or read it on a larger "
                          "machine")
        return r.meta, Tensors(r.tensors(want))

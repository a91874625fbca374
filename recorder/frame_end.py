"""Where a file's zstd frame ends, found by walking its block headers without decompressing.

A bundle whose write was cut short (the process killed, the disk full) or that was copied
incompletely stops inside its frame. Decoding would find that only after the tensors before the
cut (gigabytes for a large model), and ``nanreplay --info``, which reads the header alone, would
not find it at all. Each block header gives the next one's offset, so the walk costs one 3-byte
read per block (128 KiB of data or less each).
"""

from __future__ import annotations

from typing import BinaryIO

import zstandard

_RLE, _RESERVED = 1, 3  # block types (0 raw and 2 compressed: their size is stored)


def frame_end(f: BinaryIO, size: int) -> tuple[int, str]:
    """``(end, "")``: the offset just past the frame that starts at ``f``'s offset 0 (its last
    block and checksum), or ``(-1, why)`` when the file, ``size`` bytes long, ends inside it or a
    block header is invalid."""
    f.seek(0)
    head = f.read(18)
    try:
        pos = zstandard.frame_header_size(head)
        checksum = zstandard.get_frame_parameters(head).has_checksum
    except zstandard.ZstdError as e:
        return -1, f"its zstd frame header is cut or damaged ({e})"
    block = 0
    while True:
        f.seek(pos)
        raw = f.read(3)
        if len(raw) < 3:
            return -1, f"it ends at byte {size}, before block {block} of its zstd frame"
        word = int.from_bytes(raw, "little")
        last, kind, length = word & 1, (word >> 1) & 3, word >> 3
        if kind == _RESERVED:
            return -1, f"block {block} of its zstd frame, at byte {pos}, has an invalid header"
        pos += 3 + (1 if kind == _RLE else length)
        if pos > size:
            return -1, f"it ends at byte {size}, inside block {block} of its zstd frame"
        block += 1
        if last:
            end = pos + (4 if checksum else 0)
            if end > size:
                return -1, f"it ends at byte {size}, inside its zstd frame's checksum"
            return end, ""

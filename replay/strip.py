"""Shareable copies of a bundle without the batch and/or the weights (training data may be
private; weights may be proprietary). The ring buffer, event and environment stay. One rank's
bundle of a sharded event is stripped with its set (:func:`strip_set`)."""

from __future__ import annotations

from pathlib import Path

from recorder.bundle import BundleReader, write_bundle

from .meta_check import check_meta
from .shards import missing, ranks_of, shard_set

WEIGHT_PREFIXES = ("weights/", "buffers/", "grads/", "optim/", "optim_group/", "optim_seq/",
                   "trained/")
BATCH_PREFIXES = ("batch/", "loss_in/", "outgrad/")
PARTS = {"batch": BATCH_PREFIXES, "weights": WEIGHT_PREFIXES + ("loss/",)}
# per micro-batch metadata that holds batch contents: the input and loss-argument trees (their
# JSON leaves) and the readable paths (dict keys) of their tensors
BATCH_META_KEYS = ("inputs", "loss_inputs", "paths", "loss_paths")


def strip(src: str | Path, dst: str | Path, parts: list[str]) -> Path:
    """Write ``dst`` (a ``.nan`` path) as ``src`` without ``parts`` ("batch", "weights")."""
    drop = tuple(p for part in parts for p in PARTS[part])
    dst = Path(dst)
    stem = dst.name[:-4] if dst.name.endswith(".nan") else dst.name
    with BundleReader(src) as r:
        check_meta(r.meta, src)
        meta = dict(r.meta)
        tensors = dict(r.tensors(lambda name: not _own_name(name).startswith(drop)))
    if "batch" in parts:
        # The batch's non-tensor values (strings, numbers, dict keys) live in the metadata.
        meta["micro_batches"] = _without_batch(meta.get("micro_batches", []))
        if isinstance(meta.get("rewind"), dict):  # (and the window's steps', as their tensors)
            meta["rewind"] = {**meta["rewind"], "records": [
                {**rec, "micro_batches": _without_batch(rec.get("micro_batches") or [])}
                for rec in meta["rewind"].get("records") or []]}
    meta["stripped"] = sorted(set(meta.get("stripped", [])) | set(parts))
    dst.parent.mkdir(parents=True, exist_ok=True)
    return write_bundle(dst.parent, stem, meta, tensors)


def _own_name(name: str) -> str:
    """A tensor's name as the event step's own: a rewind window's copy of the weights
    (``rewind/weights/...``) and its steps' batches (``rewind/step/<s>/batch/...``) are the
    same data as the step's, stripped with them (kept, a "safe to share" copy held the batches
    and weights of every step of the window)."""
    if not name.startswith("rewind/"):
        return name
    rest = name[len("rewind/"):]
    if rest.startswith("step/"):
        rest = rest.split("/", 2)[-1]  # (past the step number)
    return rest


def _without_batch(mbs: list) -> list:
    return [{k: v for k, v in mb.items() if k not in BATCH_META_KEYS} for mb in mbs]


def strip_set(path: Path, dst: Path, parts: list[str]) -> list[Path]:
    """``--strip``: ``dst`` as ``path`` without ``parts``; for one rank's shards, the whole
    set (a copy of one rank's shards replays nothing): ``<dst stem>-rank<r>.nan`` per rank,
    each keeping the run id, so the copies are a set again."""
    with BundleReader(path) as r:
        meta = r.meta
    if "shards" not in meta or ranks_of(meta) is None:
        return [strip(path, dst, parts)]
    found = shard_set(path, meta)
    if len(found) < int(ranks_of(meta)["world_size"]):
        raise missing(path, meta, found)
    stem = dst.name[:-4] if dst.name.endswith(".nan") else dst.name
    return [strip(p, dst.with_name(f"{stem}-rank{r}.nan"), parts)
            for r, p in sorted(found.items())]

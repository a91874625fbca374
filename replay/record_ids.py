"""The dataset records the origin's samples are, where the batch says so.

A loader shuffles (a ``WeightedRandomSampler``, length buckets, workers interleaving an
``IterableDataset``'s shards), so "samples [4] of step 6" does not tell the user which record of
the dataset to open. Many batches carry the answer beside the features: a collate_fn's record
ids (``batch["id"]``, a dataclass's ``row_id``, a namedtuple's ``index``) or the files the
records were read from (``batch["path"]``, default_collate's list of strings), or each record
dict of a list of them holds its own (``collate_fn=list``: ``batch[*]["image_id"]``). When the model
or the loss was given such a per-sample identifier (one value per sample of the origin's
micro-batch, most of them distinct, so a record a sampler drew twice still counts: no label,
no length), the report gives its values at the samples (``origin.records``) and a note says
which records to look at.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from recorder.capture import batch_path, loss_path
from recorder.objects import member
from recorder.tensor_collections import tag_of

from .load import Step

# a key or field that names a record: one of these words alone (id, index, path), or after
# a word for the record (sample_id, image_idx, file_path); not an entity's (user_id, item_id)
_ID_WORDS = {"id", "ids", "idx", "idxs", "index", "indices", "uid", "uids", "path", "paths",
             "file", "files", "filename", "filenames", "fname", "fnames", "url", "urls", "uri",
             "uris", "name", "names", "key", "keys", "guid", "guids", "uuid", "uuids", "qid",
             "qids", "filepath", "filepaths", "fpath", "fpaths"}
_RECORD_WORDS = {"sample", "samples", "record", "records", "example", "examples", "row", "rows",
                 "data", "dataset", "image", "images", "img", "file", "instance", "utt",
                 "utterance", "doc", "document", "clip", "video", "audio", "wav", "scan",
                 "patient", "subject", "case", "batch", "source", "src", "rec", "query",
                 "question", "sentence", "text", "seq", "sequence", "slide", "tile", "protein",
                 "mol", "molecule"}
_LAST = re.compile(r'(?:\["([^"]+)"\]|\.(\w+))$')
_SHOWN = 8  # records listed in the note


def record_ids_note(report: dict[str, Any], step: Step) -> None:
    """``origin.records`` and the note, for an origin naming some (not all) samples."""
    o = report.get("origin") or {}
    samples, n = o.get("samples") or [], o.get("batch_size") or 0
    i = o.get("micro_batch") or 0
    if not samples or not n or o.get("all_samples") or not 0 <= i < len(step.micro_batches) \
            or max(samples) >= n:
        return
    found = {name: [values[s] for s in samples]
             for name, values in identifiers(step, step.micro_batches[i], n)}
    if not found:
        return
    o["records"] = found
    said = "; ".join(f"{name} = {short(v)}" for name, v in found.items())
    report["problems"].append(
        f"the batch carries the records' identifiers: samples {short(samples)} are {said} "
        f"(the dataset's records to look at; a shuffled loader's rows say nothing of them)")


def short(values: list) -> str:
    shown = ", ".join(json.dumps(v) if isinstance(v, str) else str(v) for v in values[:_SHOWN])
    return f"[{shown}" + (f", ... (+{len(values) - _SHOWN})]" if len(values) > _SHOWN else "]")


def identifiers(step: Step, entry: dict, n: int):
    """(readable name, values) of a micro-batch's model inputs and loss arguments (``entry``:
    the bundle's, or a rewind window step's) that are a per-sample identifier of ``n``
    samples."""
    n_args = _n_args(entry.get("inputs"))
    seen = set()
    for tree, name_of in ((entry.get("inputs"), lambda raw: batch_path(raw, n_args)),
                          (entry.get("loss_inputs"), loss_path)):
        for raw, value in _leaves(tree, ""):
            values = _values(step, value, n)
            if values is not None and _id_name(raw, values) \
                    and (name := name_of(raw)) not in seen:
                seen.add(name)
                yield name, values


def _n_args(tree: Any) -> int:
    try:
        return len(tree["$list"][0]["$list"])
    except (KeyError, IndexError, TypeError):
        return 0


def _leaves(node: Any, path: str):
    """(raw path, leaf) of a bundle's JSON tree: a tensor's ``{"$t": key}`` or a list of
    JSON scalars (a collated list of file names)."""
    if not isinstance(node, dict):
        return
    if "$t" in node:
        yield path, node
    elif "$ndarray" in node:  # (a NumPy array of ids, recorded as a tensor)
        yield from _leaves(node["$ndarray"], path)
    elif "$list" in node or "$tuple" in node:
        items = node.get("$list", node.get("$tuple")) or []
        if items and all(_plain_id(v) for v in items):
            yield path, items
            return
        yield from _per_record(items, path)
        fields = node.get("$fields")
        for k, v in enumerate(items):
            yield from _leaves(v, f"{path}.{fields[k]}" if fields and k < len(fields)
                               else f"{path}[{k}]")
    elif "$dict" in node:
        for k, v in node["$dict"]:
            yield from _leaves(v, f"{path}[{json.dumps(k)}]")
    elif (tag := _object_tag(node)) is not None:
        for item in node.get("$fields") or []:
            if isinstance(item, list) and len(item) == 2:
                yield from _leaves(item[1], path + member(tag, str(item[0])))


def _object_tag(node: dict) -> str | None:
    """The tag of a node recorded by its fields or keys: a dataclass, a mapping that is no dict
    (transformers' ``BatchEncoding``, what ``DataCollatorWithPadding`` returns), a keyed batch
    object, a TensorDict or a tensorclass."""
    found = [t for t in ("$dataclass", "$mapping", "$keyed") if t in node]
    return found[0] if found else tag_of(node)


def _plain_id(v: Any) -> bool:
    """A JSON integer or string, or a NumPy integer (an id a hand collate took from a pandas
    column or an ``np.arange``, recorded as ``{"$numpy": "int64", "value": 17}``)."""
    return isinstance(v, (str, int)) and not isinstance(v, bool) or _numpy_int(v) is not None


def _numpy_int(v: Any) -> int | None:
    ok = isinstance(v, dict) and str(v.get("$numpy", "")).startswith(("int", "uint")) \
        and type(v.get("value")) is int
    return v["value"] if ok else None


def _per_record(items: list, path: str):
    """(raw path, values) of each key a list of record dicts (a collate_fn's ``list``, a
    detection loader's targets) holds a number, a string or a 0-d tensor at in every one:
    ``batch[*]["image_id"]``, one value per sample."""
    # (keys named by a string or a number only: monodepth2's ("color", 0, -1) keys are no ids)
    dicts = [dict(v["$dict"]) for v in items if isinstance(v, dict) and "$dict" in v
             and all(isinstance(k, (str, int)) for k, _ in v["$dict"])]
    if len(dicts) < 2 or len(dicts) != len(items) or len({tuple(d) for d in dicts}) != 1:
        return
    for k in dicts[0]:
        values = [d[k] for d in dicts]
        if all(_plain_id(v) or isinstance(v, dict) and "$t" in v for v in values):
            yield f"{path}[*][{json.dumps(k)}]", values


def _values(step: Step, leaf: Any, n: int) -> list | None:
    """The leaf's ``n`` values, one per sample, when they are integers or strings, most of
    them distinct: a sampler drawing with replacement (``WeightedRandomSampler``'s default)
    repeats a record in a batch, while a group's value (a ``dataset_id`` of 2 sources) repeats
    in most rows."""
    if isinstance(leaf, list):
        values = [_scalar(step, v) for v in leaf]
        if any(v is None for v in values):
            return None
    else:
        t = step.tensors.get(leaf["$t"])
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.is_floating_point() \
                or t.is_complex() or t.dtype == torch.bool:
            return None
        values = t.tolist()
    return values if len(values) == n and 2 * len(set(values)) > n else None


def _id_name(raw: str, values: list) -> bool:
    m = _LAST.search(raw)
    name = (m.group(1) or m.group(2)) if m else ""
    words = [w for w in re.split(r"[_\W]+", name.lower()) if w]
    if not words or words[-1] not in _ID_WORDS:
        return False
    if len(words) == 1:  # a bare key names a record by strings only (WebDataset's __key__),
        # never an attention's key; a bare name may be a class's
        return words[0] not in ("name", "names", "key", "keys") \
            or words[0] in ("key", "keys") and all(isinstance(v, str) for v in values)
    return len(words) == 2 and words[0] in _RECORD_WORDS


def _scalar(step: Step, v: Any) -> int | str | None:
    """A record's identifier: a JSON number or string, or a 0-d integer tensor's value."""
    if not isinstance(v, dict):
        return v
    if (i := _numpy_int(v)) is not None:
        return i
    t = step.tensors.get(v.get("$t"))
    ok = isinstance(t, torch.Tensor) and t.dim() == 0 and not t.is_floating_point() \
        and not t.is_complex() and t.dtype != torch.bool
    return int(t) if ok else None

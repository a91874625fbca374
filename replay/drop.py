"""``--try drop=I,J``: the samples the report names removed from a recorded micro-batch (its
batch, its loss inputs, a target flattened from ``(B, T)``, its ``PackedSequence`` packed again
without them, an ``EmbeddingBag``'s flat inputs and offsets without their bags, a graph's edge
list without their edges, a metric loss's mined pairs or triplets without those holding them
and, when no loss can be re-run, its recorded output gradients)."""

from __future__ import annotations

import re

import torch
from torch import nn

from recorder.capture import batch_path, loss_path, tree_refs
from recorder.finite import zero_one
from recorder.padded_ids import padded_ids
from recorder.samples import Bags, Segments, bag_offsets, broadcast_fields, packed_in

from .drop_segments import drop_segments, unmatched_bounds
from .drop_sparse import drop_sparse
from .load import micro_batch_inputs
from .recorded import entry_samples, n_args

GRAPHS = ("the samples are graphs of a batch concatenated node by node (an input assigns each "
          "node row to its graph, as PyG's batch vector does): removing one would cut its nodes "
          "and edges and renumber the rest, which only the data pipeline can do; leave those "
          "graphs out of the dataset and train again")

UNBOUNDED = ("{name} reads as the boundaries of the {n} samples' rows ({n} + 1 offsets from 0, "
             "as cu_seqlens), but no input has as many rows as its last: the drop cannot cut "
             "the rows it bounds, so this try cannot tell; leave those samples out of the data "
             "and train again")


def undroppable(step, i: int) -> str | None:
    """Why the samples of micro-batch ``i`` cannot be dropped from the recorded batch: they
    are graphs whose nodes the inputs concatenate (:class:`recorder.samples.Segments`), or an
    input bounds each sample's rows of something no input holds; None when they can."""
    mb = step.micro_batches[i]
    if "inputs" not in mb:
        return None
    found = packed_in(list(micro_batch_inputs(step, i)))
    size = entry_samples(mb, step.tensors, step.model).size
    if any(isinstance(v, Segments) and v.groups(size) for v in found.values()):
        return GRAPHS
    count = n_args(mb.get("inputs"))
    named = {**{batch_path(p, count): step.tensors.get(k) for k, p in mb.get("paths", {}).items()},
             **{loss_path(p): step.tensors.get(k) for k, p in mb.get("loss_paths", {}).items()}}
    name = unmatched_bounds(named, size)
    return None if name is None else UNBOUNDED.format(name=name, n=size)


_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def left_by(step, change) -> str:
    """What ``change``'s drop left of its micro-batch, said where the re-run without those
    samples raised: one sample, which a BatchNorm in training mode refuses where its feature
    map is 1x1 (DeepLab's image pooling), is the likely why. ``""`` for no drop."""
    i, dropped = (change.drop_micro_batch or (0,))[0], change.drop
    n = entry_samples(step.micro_batches[i], step.tensors, step.model).size \
        if dropped and i < len(step.micro_batches) else 0
    if not n:
        return ""
    left = n - len(dropped)
    bn = left == 1 and any(isinstance(m, _BATCH_NORMS) for m in step.model.modules())
    return (f" (the drop left {left} of the batch's {n} samples"
            + (": a BatchNorm in training mode cannot normalise a batch of one where its "
               "feature map is 1x1, so this try cannot tell" if bn else "") + ")")


def compared_with(step, i: int) -> tuple[int, ...]:
    """Micro-batch ``i`` and the others whose outputs the same loss call took, with as many
    samples: one loss over several forwards of the same images (multi-crop views, SimCLR's
    two) compares their rows, which are the same samples, so a drop removes them from each."""
    mbs = step.micro_batches
    size = entry_samples(mbs[i], step.tensors, step.model).size
    for j in range(i, len(mbs)):
        taken = set(_outputs_taken(mbs[j].get("loss_inputs"), j))
        if i in taken:
            return tuple(sorted(k for k in taken if k < len(mbs) and entry_samples(
                mbs[k], step.tensors, step.model).size == size))
    return (i,)


def _outputs_taken(node, j: int):
    """The micro-batches whose outputs a recorded loss-input tree (of micro-batch ``j``'s loss
    call) refers to."""
    if isinstance(node, dict):
        if "$out" in node:
            yield node.get("mb", j)
            return
        for v in node.values():
            yield from _outputs_taken(v, j)
    elif isinstance(node, list):
        for v in node:
            yield from _outputs_taken(v, j)


def drop_rows(tensors: dict[str, torch.Tensor], mbs, rows: list[int], model,
               out_grads: bool = False) -> None:
    """Remove the samples ``rows`` from every batch and loss-input tensor (and, with
    ``out_grads``, recorded output gradient) that has the batch's samples (along the dim the
    report named them in: dim 1 of a sequence-first ``(T, B, F)``), and from every
    ``PackedSequence``, packed again without them. A sparse input gets a new node in the
    micro-batch's ``inputs`` (its size): ``mbs`` must be the caller's copies."""
    for mb in mbs:
        where = entry_samples(mb, tensors, model)
        if not where.size:
            continue
        keep = torch.tensor([i for i in range(where.size) if i not in set(rows)],
                            dtype=torch.long)
        packed = [_repack(tensors, node, keep) for node in _packed_nodes(mb.get("inputs"))]
        cut: list[str] = []  # (a sparse input's own index and value tensors)
        if "inputs" in mb:
            mb["inputs"] = drop_sparse(tensors, mb["inputs"], where.size, keep, cut)
        for tree in ("inputs", "loss_inputs"):  # (records: their tensors are not cut by row)
            if tree in mb:
                mb[tree] = _drop_records(tensors, mb[tree], where.size, keep, cut)
        paths = [k for k in mb.get("paths", {}) if k not in cut]
        done = {k for keys in packed for k in keys} | set(cut) | set(
            _drop_bags(tensors, {k: mb["paths"][k] for k in paths}, where.size, keep)) | set(
            _drop_edges(tensors, paths, where.size, keep)) | set(
            _drop_index_tuples(tensors, [k for k in mb.get("loss_paths", {}) if k not in cut],
                               where.size, keep))
        left = [k for k in (*paths, *mb.get("loss_paths", {})) if k not in done]
        # (rows packed per sample are of tensors that hold no sample along a dim of their own)
        unrowed = {k for k in left if isinstance(x := tensors.get(k), torch.Tensor)
                   and where.dim(x) is None}
        done |= set(drop_segments(tensors, left, unrowed, where.size, keep))
        grads = list(mb.get("output_grads", {}).values()) if out_grads else []
        inputs = [tensors.get(j) for j in mb.get("paths", {})]  # (as recorded, before the cut)
        # (a land-sea mask (H, W) beside (B, C, H, W) states: no sample's, whatever H is)
        given = [t for j in (*mb.get("paths", {}), *mb.get("loss_paths", {}))
                 if isinstance(t := tensors.get(j), torch.Tensor)]
        shared = {id(t) for t in [*broadcast_fields(given), *_node_edges(given, where.size)]}
        for k in [*mb.get("paths", {}), *mb.get("loss_paths", {}), *grads]:
            x = tensors.get(k)
            d = where.dim(x) if isinstance(x, torch.Tensor) and k not in done \
                and id(x) not in shared else None
            if d is not None:
                tensors[k] = x.index_select(d, keep)
                if d == 0 and _pairwise(x, inputs, given):
                    tensors[k] = tensors[k].index_select(1, keep)
            elif k in mb.get("loss_paths", {}) and isinstance(x, torch.Tensor):
                tensors[k] = _drop_flat(x, where, keep)


def _node_edges(given: list[torch.Tensor], n: int) -> list[torch.Tensor]:
    """Integer ``(2, E)`` edge lists in a batch of 2 whose values index the nodes of a
    batch-first ``(B, N, F)`` input (a mesh passed to forward beside its node states): no
    sample's rows, though their dim 0 has the batch's size. Token ids ``(B, T)`` beside
    ``(B, T, D)`` features have ``E == N``."""
    if n != 2:  # (else a (2, E) tensor has no dim of the batch's size to cut)
        return []
    nodes = {u.shape[1] for u in given if u.dim() >= 3 and u.shape[0] == n
             and (u.is_floating_point() or u.is_complex())}
    return [t for t in given if t.dim() == 2 and t.shape[0] == 2 and t.numel()
            and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool
            and any(t.shape[1] != m and 0 <= int(t.min()) and int(t.max()) < m for m in nodes)]


def _pairwise(x: torch.Tensor, inputs: list, given: list = ()) -> bool:
    """Whether a square ``(B, B)`` tensor over the samples is pairwise (a graph's dense
    adjacency, a distance matrix: its columns are the samples too) rather than ``B`` features
    per sample that happen to number ``B`` (an MLP's ``(16, 16)`` batch): symmetric, an
    additive attention mask (a directed graph's 0s and -infs), or non-negative beside a
    per-sample input of another width (the nodes' features); never a
    length mask, whose every row is valid then padded (a ``(B, T)`` frame mask where the batch
    has as many clips as frames: all True when no clip is padded, so symmetric), nor one beside
    a per-sample ``(B, B, F)`` input, whose dim 1 holds each sample's items (a CVRP batch of as
    many instances as customers: the demands ``(B, N)`` beside the cities ``(B, N, 2)``; a
    filter's ranges ``(B, T)`` beside its loss's true track ``(B, T, 2)``, in ``given``)."""
    if x.dim() != 2 or x.shape[0] != x.shape[1] or _length_mask(x) or padded_ids(x):
        return False
    if torch.equal(x, x.T) or _additive_mask(x):
        return True
    if any(isinstance(t, torch.Tensor) and t.dim() >= 3 and t.shape[:2] == x.shape
           for t in [*inputs, *given]):
        return False  # (B values per sample beside (B, B, F): CVRP's demands beside its cities)
    beside = any(isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[0] == x.shape[0]
                 and t.shape[1] != x.shape[0] for t in inputs)
    return beside and not x.is_complex() and bool((x >= 0).all())


def _additive_mask(x: torch.Tensor) -> bool:
    """An additive attention mask over the samples (a directed graph's, added to the
    ``(N, N)`` scores): 0 where one node may attend to another, ``-inf`` (or a large
    negative, ``-1e9``, a dtype's min) where not, both present; not a key-padding mask (whose
    0s come first in every row)."""
    if not x.is_floating_point():
        return False
    zero, off = x == 0, x <= -1e4
    return bool((zero | off).all()) and bool(zero.any()) and bool(off.any()) \
        and not _length_mask(zero)


def _length_mask(x: torch.Tensor) -> bool:
    """A 0/1 mask whose every row's ones come first (right padding), or every row's last (not
    a kernel matrix, positive everywhere)."""
    if x.is_complex() or not zero_one(x):
        return False
    steps = (x != 0).to(torch.int8).diff(dim=1)
    return bool((steps <= 0).all()) or bool((steps >= 0).all())


def _drop_bags(tensors: dict[str, torch.Tensor], paths: dict[str, str], n: int,
               keep: torch.Tensor) -> list[str]:
    """Each ``EmbeddingBag``'s flat inputs (ids, ``per_sample_weights``) without the rows of
    the dropped bags, and its ``offsets`` (one per sample, and the end with
    ``include_last_offset``) for the bags kept, table by table
    (:func:`recorder.samples.bag_offsets` pairs them); returns their keys."""
    keys = [k for k in paths if isinstance(tensors.get(k), torch.Tensor)
            and tensors[k].dim() == 1]
    flat = [(tuple(re.findall(r"\[([^\]]*)\]", paths[k])), tensors[k]) for k in keys]
    groups: dict[int, list[int]] = {}
    for i, j in bag_offsets(flat):
        if flat[j][1].numel() in (n, n + 1):  # (n + 1: include_last_offset's final end)
            groups.setdefault(j, []).append(i)
    done = []
    for j, members in groups.items():
        o, total = flat[j][1], max(flat[i][1].numel() for i in members)
        rows = torch.isin(Bags(o).bag_of(torch.arange(total)), keep.to(o.device, o.dtype))
        for i in members:
            tensors[keys[i]] = flat[i][1][rows[:flat[i][1].numel()].to(flat[i][1].device)]
        last = o.numel() == n + 1
        sizes = (torch.diff(o) if last else torch.diff(o, append=o.new_tensor([total])))
        ends = torch.cat([o.new_zeros(1), sizes.index_select(0, keep.to(o.device)).cumsum(0)])
        tensors[keys[j]] = ends if last else ends[:-1]
        done += [keys[j], *(keys[i] for i in members)]
    return done


def _drop_edges(tensors: dict[str, torch.Tensor], keys: list[str], n: int,
                keep: torch.Tensor) -> list[str]:
    """A graph's edge list (``edge_index``, an integer ``(2, E)`` input whose values are rows
    of the batch: the samples are its nodes) without the edges that touch a dropped node, its
    nodes renumbered to the rows kept, and the tensors with one row per edge (edge weights,
    edge features) without the same edges; returns their keys."""
    edges = [k for k in keys if isinstance(t := tensors.get(k), torch.Tensor)
             and not t.is_floating_point() and t.dim() == 2 and t.shape[0] == 2 != n
             and t.numel() and 0 <= int(t.min()) and int(t.max()) < n]
    if not edges:
        return []
    kept = torch.zeros(n, dtype=torch.bool)
    kept[keep] = True
    renumber = torch.cumsum(kept, 0) - 1
    done = []
    for k in edges:
        e = tensors[k]
        cols = kept[e.cpu()].all(0)
        per_edge = [j for j in keys if j not in edges and isinstance(tensors.get(j), torch.Tensor)
                    and tensors[j].dim() and tensors[j].shape[0] == e.shape[1] != n]
        for j in per_edge:
            tensors[j] = tensors[j][cols.to(tensors[j].device)]
        tensors[k] = renumber[e.cpu()[:, cols]].to(e.device, e.dtype)
        done += [k, *per_edge]
    return done


def _index_tuple(t, n: int) -> bool:
    """``t`` may be row indices into a batch of ``n``: integers in [0, n), ``(P, k)`` with
    ``k`` of 2 to 4 (pairs, triplets, quadruplets) or 1-D, ``P`` not ``n``."""
    return (isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex()
            and t.dtype != torch.bool and t.dim() and t.numel() > 0 and t.shape[0] != n
            and (t.dim() == 1 or (t.dim() == 2 and 2 <= t.shape[1] <= 4))
            and 0 <= int(t.min()) and int(t.max()) < n)


def _drop_index_tuples(tensors: dict[str, torch.Tensor], keys: list[str], n: int,
                       keep: torch.Tensor) -> list[str]:
    """A metric loss's mined tuples of the batch's rows (``(P, 2)`` pairs, ``(P, 3)``
    triplets, or 1-D anchor/positive/negative index tensors of ``P`` each, as
    pytorch-metric-learning's ``indices_tuple``) without the tuples that hold a dropped
    sample, the rest renumbered to the rows kept, and the loss tensors with one row per tuple
    (whether a pair is of one class) cut alike; returns their keys."""
    found = [k for k in keys if _index_tuple(tensors.get(k), n)]
    sizes = [tensors[k].shape[0] for k in found]
    # (a lone 1-D one may be anything of integers: a tuple has two at least)
    found = [k for k, p in zip(found, sizes) if tensors[k].dim() == 2 or sizes.count(p) > 1]
    kept = torch.zeros(n, dtype=torch.bool)
    kept[keep] = True
    renumber = torch.cumsum(kept, 0) - 1
    done: list[str] = []
    for p in sorted({tensors[k].shape[0] for k in found}):
        group = [k for k in found if tensors[k].shape[0] == p]
        rows = torch.ones(p, dtype=torch.bool)
        for k in group:
            rows &= kept[tensors[k].cpu()].reshape(p, -1).all(1)
        per_row = [k for k in keys if k not in found and isinstance(tensors.get(k), torch.Tensor)
                   and tensors[k].dim() and tensors[k].shape[0] == p]
        for k in group:
            t = tensors[k]
            tensors[k] = renumber[t.cpu()[rows]].to(t.device, t.dtype)
        for k in per_row:
            tensors[k] = tensors[k][rows.to(tensors[k].device)]
        done += group + per_row
    return done


def _drop_records(tensors: dict[str, torch.Tensor], tree, n: int, keep: torch.Tensor,
                  cut: list[str]):
    """``tree`` with each list of ``n`` per-sample entries (a ``collate_fn``'s per-image
    target dicts, torchvision's list of images: :func:`recorder.samples.packed_in`'s
    ``Record``) holding the kept samples' entries only; their tensors' keys go to ``cut``."""
    if isinstance(tree, list):
        return [_drop_records(tensors, v, n, keep, cut) for v in tree]
    if not isinstance(tree, dict):
        return tree
    items = tree.get("$list", tree.get("$tuple"))
    if isinstance(items, list) and len(items) == n and _records_node(tensors, items):
        cut += [k for v in items for k in tree_refs(v, "$t")]
        return {k: [items[i] for i in keep.tolist()] if k in ("$list", "$tuple") else v
                for k, v in tree.items()}
    return {k: _drop_records(tensors, v, n, keep, cut) for k, v in tree.items()}


def _records_node(tensors: dict[str, torch.Tensor], items: list) -> bool:
    """A recorded list reads as per-sample entries, as the recorder's ``_records`` decides."""
    if all(isinstance(v, dict) and "$t" in v for v in items):
        ts = [tensors.get(v["$t"]) for v in items]
        if not all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in ts):
            return False
        return all(t.dim() >= 3 for t in ts) and len({t.dim() for t in ts}) == 1 \
            and any(t.shape[0] != len(ts) for t in ts) or _ragged(ts)
    return all(isinstance(v, dict) and "$dict" in v and any(tree_refs(v, "$t"))
               and not _has_output(v) for v in items)


def _ragged(ts: list[torch.Tensor]) -> bool:
    """Per-sample point or box sets (a crowd image's head points ``(N_i, 2)``, a detection
    target's boxes ``(N_i, 4)``): rows of one width, as many as each sample has, not all
    alike (a list of equal shapes may be anything: a forward's own arguments)."""
    return all(t.dim() == 2 for t in ts) and len({t.shape[1] for t in ts}) == 1 \
        and len({t.shape[0] for t in ts}) > 1


def _has_output(node) -> bool:
    if isinstance(node, dict):
        return "$out" in node or any(_has_output(v) for v in node.values())
    return isinstance(node, list) and any(_has_output(v) for v in node)


def _drop_flat(x: torch.Tensor, where, keep: torch.Tensor) -> torch.Tensor:
    """A loss target flattened from (B, T, ...) to (B*T, ...) (a language model's
    ``crit(logits.view(-1, V), labels.view(-1))``; (T*B, ...) for a sequence-first model)
    without the dropped samples' rows, as the re-computed output's view will be; other
    tensors unchanged."""
    n = where.size
    if x.dim() == 0 or not n or x.shape[0] <= n or x.shape[0] % n:
        return x
    k, rest = x.shape[0] // n, x.shape[1:]
    if where.seq_first:
        return x.reshape(k, n, *rest).index_select(1, keep).reshape(-1, *rest)
    return x.reshape(n, k, *rest).index_select(0, keep).reshape(-1, *rest)


def _packed_nodes(tree):
    """The ``PackedSequence`` nodes of a micro-batch's recorded inputs (``$namedtuple``)."""
    if isinstance(tree, dict):
        if str(tree.get("$namedtuple", "")).endswith(":PackedSequence") and "$tuple" in tree:
            yield tree
            return
        for v in tree.values():
            yield from _packed_nodes(v)
    elif isinstance(tree, list):
        for v in tree:
            yield from _packed_nodes(v)


def _repack(tensors: dict[str, torch.Tensor], node: dict, keep: torch.Tensor) -> list[str]:
    """The sequences of one recorded ``PackedSequence`` but those not in ``keep``, packed again
    in place (its data rows are time steps of several samples: no row can be cut alone);
    returns its tensors' keys."""
    from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

    keys = [item.get("$t") if isinstance(item, dict) else None for item in node["$tuple"]]
    keys += [None] * (4 - len(keys))
    if keys[0] is None or keys[1] is None:
        return []
    seq = PackedSequence(*(tensors[k] if k is not None else None for k in keys[:4]))
    padded, lengths = pad_packed_sequence(seq, batch_first=True)
    sorted_before = keys[2] is None  # packed sorted (enforce_sorted=True): it stays sorted
    again = pack_padded_sequence(padded[keep], lengths[keep], batch_first=True,
                                 enforce_sorted=sorted_before)
    for k, t in zip(keys, again):
        if k is not None and t is not None:
            tensors[k] = t
    return [k for k in keys if k is not None]

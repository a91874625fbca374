"""Which dimension of a tensor holds the samples, so events and reports name samples, not time
steps.

PyTorch's recurrent and attention modules take sequences first by default: ``nn.LSTM``,
``nn.GRU``, ``nn.RNN``, ``nn.MultiheadAttention`` and ``nn.Transformer*`` with
``batch_first=False`` take ``(T, B, ...)``, and ``nn.CTCLoss`` takes ``(T, B, C)``
log-probabilities. The samples of such a batch are its dim 1.

The batch size is the size that most of a step's tensors have (the root inputs, the loss's
targets, the root outputs), where the batch sits counting twice: each tensor gives each of its
sizes 2 when it stands at dim 0 (or dim 1 in a model with sequence-first modules), else 1; a
square matrix (an attention mask, ``(T, T)``) holds no batch and is not counted. An LSTM batch
``(10, 5, 6)`` with targets ``(5,)`` and logits ``(5, 3)`` is a batch of 5; a batch-first
``(8, 12, 4)`` series passed with a ``(12, 12)`` causal mask, and forecasting ``(8, 12, 1)``,
is a batch of 8, not 12. A tie goes to the first input's dim 1 in a model with
sequence-first modules, else to its dim 0. A tensor's
samples are along its dim 0 when it has the batch's size there, or along its dim 1 in such a
model, or in a 3-D hidden state ``(layers, B, H)`` of a model holding a recurrent module
(``batch_first`` or not); a tensor with none of these (a weight) has none.

When the first root output and a loss target share a size where a batch stands, only such
sizes count (:func:`compared`): a batch of graphs concatenated node by node (features
``(N, F)``, labels ``(G,)``, logits ``(G, C)``) is a batch of ``G`` graphs, not of ``N`` nodes;
a node tensor's rows name the graphs its ``batch`` vector assigns them to (:class:`Segments`).

A ``PackedSequence`` (variable-length sequences for the recurrent modules) is a batch of
``batch_sizes[0]``; its ``data`` is packed time-major, so the samples of its rows are found
through ``batch_sizes`` and ``sorted_indices`` (:func:`packed_samples`), not along a dim.

>>> s = Samples(5, seq_first=True)
>>> s.dim(torch.zeros(10, 5, 6)), s.dim(torch.zeros(5, 3)), s.dim(torch.zeros(16, 4))
(1, 0, None)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from .bag_offsets import Bags, bag_offsets
from .capture import tensor_leaves
from .edge_rows import edge_graphs, edge_samples
from .finite import bad_rows
from .objects import described
from .padded_ids import padded_ids
from .record_lists import listed_records, tensor_records
from .target_inputs import named_args, named_target, target_ids, untargeted
from .time_major import carried_batch, time_major_inputs

# the modules whose ``batch_first=False`` puts the batch in dim 1
_SEQUENCE_MODULES = (nn.RNNBase, nn.MultiheadAttention, nn.Transformer,
                     nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


def recurrent(model: nn.Module | None) -> bool:
    """``model`` holds an ``nn.LSTM``, ``nn.GRU`` or ``nn.RNN``: its hidden states, passed in
    and returned (a state carried between truncated-BPTT steps), are ``(layers * directions,
    B, H)``, the batch in dim 1 whatever ``batch_first`` says."""
    return model is not None and any(isinstance(m, nn.RNNBase) for m in model.modules())


def seq_first(model: nn.Module | None) -> bool:
    """``model`` holds a recurrent or attention module that takes sequences first."""
    if model is None:
        return False
    return any(isinstance(m, _SEQUENCE_MODULES) and getattr(m, "batch_first", True) is False
               for m in model.modules())


@dataclass(frozen=True)
class Samples:
    """The batch's size (0: unknown) and whether the model takes sequences first."""

    size: int = 0
    seq_first: bool = False
    recurrent: bool = False  # the model holds a recurrent module (see :func:`recurrent`)
    # the root inputs' assignment vector of a graph batch: a value any module computed per node
    # (an atom's energy, its force) names the graphs its rows are in
    segments: Segments | None = field(default=None, compare=False, repr=False)
    # the ids of the root inputs that are loss targets (see recorder.target_inputs)
    targets: frozenset = field(default=frozenset(), compare=False, repr=False)
    # the samples the recorder found non-finite in the root outputs, whose batch dim is not in
    # doubt: which of dims 0 and 1 holds the samples of a (B, B, ...) value of a seq-first model
    seen: frozenset = field(default=frozenset(), compare=False, repr=False)

    def dim(self, t: torch.Tensor, stacked: bool = False) -> int | None:
        """The dimension of ``t`` that holds the samples; None when ``t`` has none (a 0-d
        tensor, a weight), dim 0 when the batch size is unknown. ``stacked``: ``t`` is a value
        the forward computed from the batch (an output, an op's result), where a leading
        dimension of another size stacks copies of the batch: IWAE's K posterior samples per
        input ``(K, B, ...)``, an ensemble's members, a hand-written time-major loop."""
        if t.dim() == 0:
            return None
        if not self.size:
            return 0
        shape = shape_of(t)
        if self.seq_first and t.dim() > 1 and shape[1] == self.size:
            return 1
        if shape[0] == self.size:
            return 0
        # (else dim 0 only: a weight's gradient, (4, 8) against a batch of 8, holds none; but
        # a recurrent module's hidden state, (layers, B, H), has the batch in dim 1)
        if self.recurrent and t.dim() == 3:
            return 1 if shape[1] == self.size else None
        # (a dim 0 that is a multiple of the batch flattens it with another dim, the tokens of
        # a (B * T, r) LoRA product: a dim 1 of the batch's size there is no batch)
        if stacked and t.dim() > 1 and shape[1] == self.size and shape[0] % self.size:
            return 1
        return None

    def per_node(self, t: torch.Tensor) -> bool:
        """``t``'s rows are the nodes of the micro-batch's graph batch (:attr:`segments`)."""
        s = self.segments
        return (s is not None and t.dim() > 0 and not t.is_nested and s.groups(self.size)
                and t.shape[0] == s.ids.numel() and self.dim(t) is None)

    def rows(self, t: torch.Tensor, packed: Mapping[int, PackedSequence | Bags | Segments] | None = None,
             stacked: bool = False) -> list[int]:
        """The samples of ``t`` that hold a non-finite value ([] when ``t`` has no samples);
        through its ``PackedSequence`` when ``t`` is the ``data`` of one in ``packed`` (see
        :func:`packed_in`)."""
        seq = packed.get(id(t)) if packed else None
        if isinstance(seq, Bags):
            return seq.samples(bad_rows(t, 0))
        if isinstance(seq, Segments) and self.dim(t) is None and seq.groups(self.size):
            return seq.samples(bad_rows(t, 0))
        if isinstance(seq, PackedSequence) and seq.data is t:
            return packed_samples(seq, bad_rows(t, 0))
        if isinstance(seq, Field):
            return []
        if isinstance(seq, Record) and seq.of == self.size:  # (a clip as long as the batch
            # is large is one sample too: its dim 0 is its frames)
            return [seq.index] if bad_rows(t.reshape(1, -1), 0) else []
        if self.per_node(t):
            return self.segments.samples(bad_rows(t, 0))
        if (e := self.segments and self.segments.edges) is not None and self.dim(t) is None \
                and t.dim() and t.shape[0] == e.numel() and self.segments.groups(self.size):
            return edge_samples(e, bad_rows(t, 0))
        d = self.dim(t, stacked)
        if d == 1 and self.seen and shape_of(t)[0] == self.size:  # (B, B, ...): either dim
            first, rows = bad_rows(t, 0), bad_rows(t, 1)
            return first if set(first) <= self.seen and not set(rows) <= self.seen else rows
        return [] if d is None else bad_rows(t, d)

    def first_rows(self, tensors: Iterable[torch.Tensor],
                   packed: Mapping[int, PackedSequence | Bags | Segments] | None = None,
                   stacked: bool = False) -> list[int]:
        """The non-finite samples of the first floating tensor with any."""
        for t in tensors:
            if t.is_floating_point() and t.dim():
                rows = self.rows(t, packed, stacked)
                if rows:
                    return rows
        return []


def packed_in(obj: Any, targets: frozenset = frozenset()
              ) -> dict[int, PackedSequence | Bags | Segments]:
    """The ``PackedSequence`` objects in a nested structure of tuples, lists and dicts, by the
    ``id`` of their ``data`` (as :meth:`Samples.rows` looks them up); and, for an
    ``EmbeddingBag``'s flat inputs (ids, ``per_sample_weights``) given beside their
    ``offsets``, the :class:`Bags` that says which sample each of their rows is in; for the
    tensors whose rows a graph batch's assignment vector covers, its :class:`Segments` (a
    loss target is none: held under a target's name, or by id in ``targets``); for each
    tensor of a list of per-sample entries, its :class:`Record`."""
    found: dict[int, PackedSequence | Bags | Segments] = {}
    flat: list[tuple[tuple, torch.Tensor]] = []  # (path, tensor)
    rowed: list[torch.Tensor] = []

    def walk(o: Any, path: tuple) -> None:
        if isinstance(o, PackedSequence):
            found.setdefault(id(o.data), o)
        elif isinstance(o, torch.Tensor) and o.dim() >= 1:
            flat.append((path, o)) if o.dim() == 1 else rowed.append(o)
        elif isinstance(o, (list, tuple)):
            if _records(o):
                for k, v in enumerate(o):
                    for t in tensor_leaves(v):
                        found.setdefault(id(t), Record(k, len(o)))
            for k, v in enumerate(o):
                walk(v, (*path, k))
        elif isinstance(o, dict) or (o := described(o)) is not None:  # (PyG's Batch by key)
            for k, v in o.items() if isinstance(o, dict) else o[2]:
                walk(v, (*path, k))

    walk(obj, ())
    for t in broadcast_fields(rowed):
        found.setdefault(id(t), FIELD)
    # (a graph batch's assignment vector also reads as offsets, into its longer edge tensors;
    # a `labels=` vector is neither, whatever its values)
    if (segments := assignment(t for p, t in flat if not named_target(p)
                               and id(t) not in targets)) is not None:
        ids = segments.ids
        for t in [t for _, t in flat] + rowed:
            if shape_of(t)[0] == ids.numel():
                found.setdefault(id(t), segments)
        return found
    for i, j in bag_offsets(flat):
        found.setdefault(id(flat[i][1]), Bags(flat[j][1]))
    return found


@dataclass(frozen=True)
class Field:
    """A tensor that is one field broadcast over the samples (:func:`broadcast_fields`)."""


FIELD = Field()


def broadcast_fields(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors among ``tensors`` (a micro-batch's inputs) of 2 dims or more whose shape
    is the trailing shape of a floating one of 2 dims more, and not its leading shape: one
    field every sample shares (a land-sea mask or orography ``(H, W)`` passed to forward
    beside the ``(B, C, H, W)`` states), though its dim 0 may have the batch's size (as many
    latitude rows as samples). A ``(B, T)`` mask beside ``(B, T, D)`` features is per sample,
    and so is a ``(B, H, W)`` mask beside ``(B, C, H, W)`` values where ``C`` is ``B`` (an
    optical flow's valid pixels, ``(2, H, W)`` beside ``(2, 2, H, W)`` in a batch of 2)."""
    def field(t: torch.Tensor) -> bool:
        k = t.dim()
        return any(u.dim() >= k + 2 and (u.is_floating_point() or u.is_complex())
                   and tuple(u.shape[-k:]) == tuple(t.shape)
                   and tuple(u.shape[:k]) != tuple(t.shape) for u in tensors)
    return [t for t in tensors if t.dim() >= 2 and not t.is_nested and not t.is_sparse
            and field(t) and not padded_ids(t)]


@dataclass(frozen=True)
class Record:
    """Element ``index`` of a list of ``of`` per-sample entries: torchvision's list of images
    (their sizes may differ), a ``collate_fn``'s list of per-image target dicts. A tensor of
    one, without the batch's dimension, is all that sample's."""

    index: int
    of: int


def _records(o: list | tuple) -> bool:
    """``o`` reads as one entry per sample: dicts of data tensors, or floating tensors
    (:func:`~recorder.record_lists.tensor_records`)."""
    if all(isinstance(e, torch.Tensor) for e in o):
        return tensor_records(o)
    return _dict_records(o, set())


def _dict_records(o: list | tuple, made: set[int]) -> bool:
    """Two or more dicts of data tensors with the same keys (one per image)."""
    return len(o) >= 2 and all(isinstance(e, dict) and _data(list(tensor_leaves(e)), made)
                               for e in o) and len({tuple(e) for e in o}) == 1


@dataclass(frozen=True)
class Segments:
    """A graph batch's assignment vector (PyG's ``batch``): the graphs of a batch are
    concatenated node by node, and node row ``i`` belongs to sample ``ids[i]`` (``last``:
    the last node's graph; graphs without nodes hold no row)."""

    ids: torch.Tensor
    last: int
    edges: torch.Tensor | None = None  # the graph of each edge row (see recorder.edge_rows)

    def samples(self, rows: list[int]) -> list[int]:
        if not rows:
            return []
        return sorted(set(self.ids.cpu()[torch.tensor(rows)].tolist()))

    def groups(self, size: int) -> bool:
        """It assigns nodes to the ``size`` samples of a batch: more of them than its last
        graph's index, fewer than its nodes. Else a sorted integer vector is data of its own
        (an episode's support labels sorted by class, ``[0, 0, 1, 1, ...]``, beside a query
        batch of another size): its rows are no graph's nodes."""
        return self.last < size < self.ids.numel()


def assignment(tensors: Iterable[torch.Tensor]) -> Segments | None:
    """The :class:`Segments` of the one of ``tensors`` that reads as a graph batch's
    assignment vector (:func:`is_assignment`) with the fewest groups, or None: beside the
    atoms' batch vector, a neighbour list's sorted centre atoms (SchNetPack's ``_idx_i``)
    read as one too, grouping the pairs by atom."""
    tensors = list(tensors)
    found = [Segments(t, int(t[-1])) for t in tensors if t.dim() == 1 and is_assignment(t)]
    if (seg := min(found, key=lambda s: s.last, default=None)) is None:
        return None
    return replace(seg, edges=edge_graphs(tensors, seg.ids))


def is_assignment(t: torch.Tensor) -> bool:
    """``t`` reads as an assignment of rows to fewer samples: integers from 0, never
    decreasing, ending below its length (one host read, on the event's slow path)."""
    if t.dtype not in (torch.int64, torch.int32) or t.numel() < 2:
        return False
    v = t.detach().cpu()
    return int(v[0]) == 0 and bool((v[1:] >= v[:-1]).all()) and int(v[-1]) + 1 < v.numel()


def packed_samples(seq: PackedSequence, rows: list[int]) -> list[int]:
    """The samples (indices into the batch as it was packed) that ``rows`` of ``seq.data``
    belong to. Time step ``t`` holds rows ``sum(batch_sizes[:t])`` onwards, one for each of the
    ``batch_sizes[t]`` longest sequences in sorted order; sorted position ``j`` is sample
    ``sorted_indices[j]`` (``j`` when the batch was packed sorted, without indices).

    >>> from torch.nn.utils.rnn import pack_sequence
    >>> seq = pack_sequence([torch.ones(1), torch.ones(3), torch.ones(2)], enforce_sorted=False)
    >>> seq.batch_sizes.tolist(), seq.sorted_indices.tolist()
    ([3, 2, 1], [1, 2, 0])
    >>> packed_samples(seq, [2, 5])  # rows 0-2: step 0 of samples 1, 2, 0; row 5: step 2 of 1
    [0, 1]
    """
    if not rows:
        return []
    sizes = seq.batch_sizes.cpu()
    # (N,): the sorted position of each row: time step t lists positions 0..batch_sizes[t]-1
    span = torch.arange(int(sizes[0]))
    position = span.expand(len(sizes), -1)[span < sizes[:, None]]
    picked = position[torch.tensor(rows, dtype=torch.long)]
    if seq.sorted_indices is not None:
        picked = seq.sorted_indices.cpu()[picked]
    return sorted(set(picked.tolist()))


def of_micro_batch(mb, sequence_first: bool, rnn: bool = False, names: tuple = ()) -> Samples:
    """The :class:`Samples` of a recorded micro-batch (a :class:`~recorder.tape.MicroBatch`):
    from its inputs, its loss targets (the loss's tensors not computed from the output) and
    its outputs; from its first input ``PackedSequence`` when it has one. ``names``: the root
    forward's positional parameters (``targets`` of ``model(idx, targets)``). Stored in the
    bundle, so the replay names the same samples."""
    given = named_args(mb.args, mb.kwargs, names)
    return replace(_of_micro_batch(mb, sequence_first, rnn, given), targets=target_ids(given))


def _of_micro_batch(mb, sequence_first: bool, rnn: bool, given: list) -> Samples:
    """:func:`of_micro_batch`, ``given`` its root call's arguments by name (named_args)."""
    seq = next((v for v in packed_in([list(mb.args), mb.kwargs]).values()
                if isinstance(v, PackedSequence)), None)
    if seq is not None:  # (pack_padded_sequence refuses empty sequences: all have a step 0)
        return Samples(int(seq.batch_sizes[0]), sequence_first, rnn)
    made = {id(t) for t in tensor_leaves(mb.outputs)}
    lead = {shape_of(t)[0] for t in tensor_leaves(mb.outputs) if t.dim()}
    # (each argument by itself: the arguments are no list of samples, model(d1, d2))
    records = next((n for a in [*mb.args, *mb.kwargs.values(), *(mb.loss_args or ()),
                                *(mb.loss_kwargs or {}).values()]
                    if (n := per_sample_records(a, made, lead))), 0)
    if records:  # (their boxes' counts are no batch size: a batch of 4 images with 1-3 boxes)
        return Samples(records, sequence_first, rnn)
    targets = [t for t in tensor_leaves([list(mb.loss_args or ()), mb.loss_kwargs or {}])
               if t.grad_fn is None]
    outputs = list(tensor_leaves(mb.outputs))
    inputs = list(tensor_leaves([list(mb.args), mb.kwargs]))
    if not sequence_first and (n := carried_batch(inputs, outputs, rnn)):  # (T, B, F), state (B, H)
        return Samples(n, True, rnn)
    among = compared(targets, outputs, sequence_first) or (
        set() if sequence_first or not targets else _rows_kept(inputs, outputs))
    segments = assignment(untargeted(given))  # (no loss target: `labels=`, `targets`)
    if not among and segments is not None:  # (no loss target says it: an evaluation forward)
        return Samples(_graphs(segments, outputs), sequence_first, rnn, segments)
    found = infer(inputs, targets + outputs, sequence_first, rnn, among)
    if among and not sequence_first and time_major_inputs(inputs, found.size):
        found = replace(found, seq_first=True)  # ((T, B, F) through Linears, pooled to (B, C))
    return replace(found, segments=segments)


def _graphs(segments: Segments, outputs: list[torch.Tensor]) -> int:
    """A graph batch's number of graphs, its nodes' batch vector's last graph's count, or a
    root output's rows between that and the nodes' (graphs left without nodes at its end)."""
    nodes = segments.ids.numel()
    return next((n for t in outputs if _batched(t)
                 and segments.last < (n := shape_of(t)[0]) < nodes), segments.last + 1)


def per_sample_records(obj: Any, made: set[int] = frozenset(), lead: set[int] = frozenset()
                       ) -> int:
    """The length of the first list or tuple of dicts holding tensors of data in ``obj`` (the
    targets a detection ``collate_fn`` returns, one dict of boxes and labels per image, as
    torchvision's detection models take them), or 0: one record per sample, so the batch's
    size, whatever the sizes of the tensors inside (each image's number of boxes). Not dicts
    of model outputs (``made``, by id, or made by autograd: DETR's ``aux_outputs``, one dict
    per decoder layer), nor dicts of batches (each tensor's dim 0 the size ``lead`` of an
    output's: views of the batch, one dict per crop)."""
    if isinstance(obj, dict):
        return next((n for v in obj.values() if (n := per_sample_records(v, made, lead))), 0)
    if not isinstance(obj, (list, tuple)) or not obj:
        return 0
    if _dict_records(obj, made) and not all(t.dim() and shape_of(t)[0] in lead
                                            for t in tensor_leaves(obj)) \
            or listed_records(obj, made, lead):
        return len(obj)
    return next((n for v in obj if (n := per_sample_records(v, made, lead))), 0)


def _data(tensors: list[torch.Tensor], made: set[int]) -> bool:
    return bool(tensors) and all(t.grad_fn is None and id(t) not in made for t in tensors)


def _rows_kept(inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> set[int]:
    """The size of the first batched root output's dim 0 when a root input has it there too
    (square or not: 16 samples of 16 features): the model kept its rows, the samples, while
    the loss's other tensors share none of them (a metric loss's mined pairs ``(P, 2)``)."""
    out = next((t for t in outputs if _batched(t)), None)
    if out is None:
        return set()
    n = shape_of(out)[0]
    return {n} if any(t.dim() and shape_of(t)[0] == n for t in inputs) else set()


def compared(targets: list[torch.Tensor], outputs: list[torch.Tensor],
             sequence_first: bool) -> set[int]:
    """The sizes where the first batched root output and a loss target both may hold the
    batch: the rows the loss compares, so the samples (a graph batch's graphs, which its
    concatenated nodes outnumber); or the dim 1 of an output stacking copies of the batch,
    ``(K, B, ...)`` with ``K`` no multiple of ``B`` (a deep ensemble's members, IWAE's K
    samples), whose target is ``(B,)``, or with any ``K`` where the output has 3 dims or more
    (CTC's log-probabilities ``(T, B, C)``; a flattened batch ``(B * T, C)`` has 2)."""
    at = 2 if sequence_first else 1
    out = next((t for t in outputs if _batched(t)), None)
    if out is None:
        return set()
    sizes = {n for t in targets if _batched(t) for n in shape_of(t)[:at]}
    found = set(shape_of(out)[:at]) & sizes
    if found or sequence_first or out.dim() < 2:
        return found
    k, n = shape_of(out)[:2]  # (a 3-D one of a multiple too: CTC's (T, B, C), T = 2B)
    return {n} if n in sizes and (k % n or out.dim() > 2) else set()


def infer(inputs: Iterable[torch.Tensor], others: Iterable[torch.Tensor] = (),
          sequence_first: bool = False, rnn: bool = False,
          among: set[int] = frozenset()) -> Samples:
    """The :class:`Samples` of a micro-batch from its root ``inputs`` (in order) and
    ``others`` (loss targets, root outputs), as the module docstring says; only ``among``
    these sizes when some are given (:func:`compared`)."""
    inputs = [t for t in inputs if _batched(t)]
    counts: Counter = Counter()
    at = 2 if sequence_first else 1  # the dims where a batch stands
    for t in inputs + [t for t in others if _batched(t)]:
        shape = shape_of(t)
        counts.update({n: 2 if n in shape[:at] else 1 for n in set(shape) if n in among
                       or not among})
    if not counts:
        return Samples(0, sequence_first, rnn)
    top = max(counts.values())
    tied = {n for n, c in counts.items() if c == top}
    if len(tied) > 1 and inputs:
        shape = inputs[0].shape
        order = ([1, 0] if sequence_first else [0, 1]) + list(range(2, len(shape)))
        pick = next((shape[d] for d in order if d < len(shape) and shape[d] in tied), None)
        if pick is not None:
            return Samples(int(pick), sequence_first, rnn)
    return Samples(int(min(tied)), sequence_first, rnn)


def _batched(t) -> bool:
    """``t`` may hold the batch: a tensor with dims, other than a square matrix."""
    return isinstance(t, torch.Tensor) and t.dim() > 0 and not (
        t.dim() == 2 and not t.is_nested and t.shape[0] == t.shape[1])


def shape_of(t: torch.Tensor) -> tuple[int, ...]:
    """``t.shape``; a nested tensor's number of components only (its other sizes vary, and
    ``shape`` refuses it: point clouds of different sizes are a batch of clouds)."""
    return (t.size(0),) if t.is_nested else tuple(t.shape)

"""Models fed a ``PackedSequence`` (variable-length sequences, ``pack_padded_sequence(...,
enforce_sorted=False)``): the bundle keeps it a ``PackedSequence`` (GRU and LSTM check the
type), and the samples of its time-major ``data`` are the batch's indices, found through its
``batch_sizes`` and ``sorted_indices``.

The end-to-end tests train ``replay_models`` factories with the loop of ``test_replay_e2e``;
the others pin the tree encoding and the row mapping.
"""

from __future__ import annotations

import json
import sys
import types
from typing import NamedTuple

import pytest
import replay_models as R
import torch
from models import check_event
from test_replay_e2e import check, check_step, exit_code, record, single
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pack_sequence

from recorder.capture import UnrebuildableLeaf, flatten_tree, map_tensors, unflatten_tree
from recorder.samples import Samples, packed_in, packed_samples
from replay import replay

K = 3  # the step at which the planted bugs fire (replay_models.packed_batch's ``at``)
BAD = 3  # the sequence holding them: the longest, sorted position 0, not 3


pytestmark = pytest.mark.usefixtures("in_tests_dir")


class Span(NamedTuple):
    """A namedtuple type of an imported module: the replay rebuilds it as itself."""

    start: torch.Tensor
    end: int


def _packed() -> PackedSequence:
    x = torch.arange(2 * 3 * 1, dtype=torch.float32).reshape(2, 3, 1)
    return pack_padded_sequence(x, torch.tensor([1, 3]), batch_first=True, enforce_sorted=False)


def _round_trip(obj):
    """``obj`` through the bundle's tree encoding, its JSON included."""
    tree, tensors, paths = flatten_tree(obj, "batch/0")
    return unflatten_tree(json.loads(json.dumps(tree)), tensors), paths


# ---------------------------------------------------------------------------------------------
# the tree encoding


def test_namedtuples_keep_their_type_through_the_bundle_tree():
    seq, span = _packed(), Span(torch.ones(2), 7)
    (args, kwargs), paths = _round_trip([[seq, span], {"pair": (1, 2)}])
    got, got_span = args
    assert type(got) is PackedSequence
    assert all(a is b for a, b in zip(got, seq) if a is not None)
    assert type(got_span) is Span and got_span.start is span.start and got_span.end == 7
    assert type(kwargs["pair"]) is tuple and kwargs["pair"] == (1, 2)
    assert sorted(paths.values()) == ["[0][0].batch_sizes", "[0][0].data",
                                      "[0][0].sorted_indices", "[0][0].unsorted_indices",
                                      "[0][1].start"]


def test_an_unknown_namedtuple_type_is_rebuilt_by_its_fields_importing_nothing(monkeypatch):
    t = torch.ones(3)
    lazy = types.ModuleType("nanreplay_lazy_mod")
    asked: list[str] = []
    lazy.__getattr__ = lambda name: asked.append(name)  # a lazy-import hook: never called
    monkeypatch.setitem(sys.modules, "nanreplay_lazy_mod", lazy)
    for name in ("nanreplay_not_imported.sub:Batch", "nanreplay_lazy_mod:Batch",
                 f"{__name__}:Span.Batch", f"{__name__}:make.<locals>.Batch"):
        node = {"$tuple": [{"$t": "x/0"}, 3], "$namedtuple": name, "$fields": ["image", "label"]}
        got = unflatten_tree(node, {"x/0": t})
        assert type(got).__name__ == "Batch" and got._fields == ("image", "label"), name
        assert got.image is t and got.label == 3 and isinstance(got, tuple)
    assert "nanreplay_not_imported" not in sys.modules and "nanreplay_not_imported.sub" \
        not in sys.modules
    assert asked == []
    # the type found, but other fields: not it
    node = {"$tuple": [1, 2], "$namedtuple": f"{__name__}:Span", "$fields": ["a", "b"]}
    got = unflatten_tree(node, {})
    assert type(got) is not Span and type(got).__name__ == "Span" and got.b == 2


def test_plain_and_malformed_tuples():
    assert unflatten_tree({"$tuple": [1, 2]}, {}) == (1, 2)  # a bundle from before the key
    bad = {"$tuple": [1, 2], "$namedtuple": "torch.nn.utils.rnn:PackedSequence",
           "$fields": ["data"]}
    with pytest.raises(UnrebuildableLeaf, match="PackedSequence"):
        unflatten_tree(bad, {})


def test_map_tensors_keeps_namedtuples_and_packed_batch_sizes():
    seq, span = _packed(), Span(torch.ones(2), 7)
    got, got_span = map_tensors([seq, span], lambda t: t.double())
    assert type(got) is PackedSequence and got.data.dtype == torch.float64
    assert got.batch_sizes is seq.batch_sizes  # not mapped: it stays on the CPU
    assert got.sorted_indices.dtype == torch.float64  # (an index, mapped as any tensor)
    assert type(got_span) is Span and got_span.start.dtype == torch.float64
    # moved to another device (as the replay moves batches), batch_sizes stay on the CPU
    moved = map_tensors(seq, lambda t: t.to("meta"))
    assert moved.data.is_meta and moved.batch_sizes.device.type == "cpu"


# ---------------------------------------------------------------------------------------------
# samples of packed rows


def test_packed_rows_name_the_samples_they_belong_to():
    # lengths 1, 3, 2: sorted 1, 2, 0; rows: t0 -> samples 1, 2, 0; t1 -> 1, 2; t2 -> 1
    seq = pack_sequence([torch.ones(1), torch.ones(3), torch.ones(2)], enforce_sorted=False)
    assert [packed_samples(seq, [r]) for r in range(6)] == [[1], [2], [0], [1], [2], [1]]
    assert packed_samples(seq, []) == []
    # packed sorted, without indices: sorted positions are the samples
    seq = pack_sequence([torch.ones(3), torch.ones(2), torch.ones(1)])
    assert seq.sorted_indices is None
    assert packed_samples(seq, [2, 5]) == [0, 2]  # t0 of sample 2, t2 of sample 0


def test_samples_rows_of_packed_data():
    seq = pack_sequence([torch.ones(1, 2), torch.ones(3, 2), torch.ones(2, 2)],
                        enforce_sorted=False)
    seq.data[4, 1] = float("nan")  # time step 1 of sample 2
    where = Samples(3)
    assert where.rows(seq.data, packed_in({"x": [seq]})) == [2]
    assert where.rows(seq.data) == []  # (6, 2) rows are no batch of 3 by themselves


# ---------------------------------------------------------------------------------------------
# end to end


def test_nan_in_a_packed_input_sequence(tmp_path):
    err, _, _ = record("make_packed_lstm", single(lambda s: R.packed_batch(s, bad=BAD)),
                       tmp_path, lr=0.01)
    check_event(err.event, step=K, phase="input", module="", tensor="batch.data",
                samples=[BAD], kind="nan")
    rep = replay(err.bundle_path)
    check_step(rep, K, err.event)
    assert rep["reproduced"] is True and rep["cause"] == "input"
    check(rep, phase="input", tensor="batch.data", samples=[BAD], micro_batch=0, made="nan")
    assert rep["origin"]["batch_size"] == R.BATCH
    assert exit_code(err.bundle_path) == 0
    # dropping the sample packs the other sequences again (its rows are time steps shared
    # with them); dropping another leaves the NaN in
    tries = {t["try"]: t for t in replay(err.bundle_path, tries=[f"drop={BAD}", "drop=0"])
             ["what_if"]}
    assert tries[f"drop={BAD}"]["finite"] is True and tries[f"drop={BAD}"]["event_step"] is None
    assert tries["drop=0"]["finite"] is False and tries["drop=0"]["event_step"] == K


def test_log_of_packed_features_in_a_submodule(tmp_path):
    err, _, _ = record("make_packed_log_gru",
                       single(lambda s: R.packed_batch(s, bad=BAD, value=-1.0)), tmp_path,
                       lr=0.01)
    check_event(err.event, step=K, phase="forward", module="feats", samples=[BAD])
    rep = replay(err.bundle_path)
    check_step(rep, K, err.event)
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    check(rep, phase="forward", module="feats", call=0, op="aten.log", made="nan",
          inputs_finite=True, samples=[BAD])
    # the float64 re-run rebuilt the PackedSequence too: the cause comes from it
    assert "log" in rep["hint"]
    assert exit_code(err.bundle_path) == 0

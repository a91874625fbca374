"""Graphs as GNN code feeds them. A batch of graphs concatenated node by node (PyG's layout: node features ``(N, F)``, edges
``(2, E)``, a ``batch`` vector ``(N,)``, one label per graph ``(G,)``): its samples are the
graphs, which the concatenated nodes outnumber, not the node rows. Each test trains
``graph_models.graph_classifier`` as a user would until the recorder raises, then runs
``nanreplay --json --try``. A single graph whose nodes are the samples (node classification)
with its ``(2, E)`` edge list: ``--try drop=`` of nodes cuts their edges too."""

from __future__ import annotations

from pathlib import Path

import graph_models as M
import pytest
import torch
from bundles import nanreplay_json
from torch import nn

from recorder import FlightRecorder, NonFiniteError

K, BAD = 4, 4  # the step the planted bug fires at, and the graph it is in (of 6)


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def _batches(plant: str, steps: int = 8, graphs: int = 6):
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        data = []
        for i in range(graphs):
            n = int(torch.randint(4, 10, (1,), generator=g))
            if step == K and i == BAD and plant == "empty":
                n = 0  # a molecule whose atoms the featuriser all filtered out
            x = torch.randn(n, 8, generator=g)
            if step == K and i == BAD and plant == "nan":
                x[1, 3] = float("nan")  # a partial charge the featuriser could not compute
            data.append((x, M.molecule(g, n), torch.randint(0, 3, (), generator=g)))
        yield M.collate(data)


def _train(plant: str, out_dir: Path, pool: str = "mean") -> NonFiniteError:
    model = M.graph_classifier(pool)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="graph_models:graph_classifier",
                            factory_kwargs={"pool": pool}):
            for x, edge_index, batch, y in _batches(plant):
                opt.zero_grad()
                crit(model(x, edge_index, batch, y.numel()), y).backward()
                opt.step()
    return info.value


def _replay(bundle, *tries: str) -> dict:
    return nanreplay_json(bundle, *(a for t in tries for a in ("--try", t)))


def test_an_empty_graph_in_mean_pooling_names_that_graph_not_no_sample(tmp_path):
    """Graph 4 has no node: the mean pooling divides its zero sum by its zero count. The
    samples are the graphs (6), not the 40-odd node rows that outnumber them: before, the
    node count was taken for the batch size and no sample was named."""
    err = _train("empty", tmp_path)
    assert (err.event["step"], err.event["module"], err.event["samples"]) == (K, "pool", [BAD])
    rep = _replay(err.bundle_path, "drop=4")
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == (
        "forward", "pool", "aten.div", [BAD], "invalid")
    assert o["batch_size"] == 6 and "0/0" in rep["hint"]
    (tried,) = rep["what_if"]  # a graph cannot be cut out of the concatenated batch here
    assert tried["finite"] is None and "graphs of a batch concatenated" in tried["note"]


def test_a_nan_node_feature_names_the_graph_the_node_is_in(tmp_path):
    """A NaN in one node's features is an input event on the node tensor; its sample is the
    graph that node belongs to (through the batch vector), not the node's row."""
    err = _train("nan", tmp_path)
    assert (err.event["phase"], err.event["tensor"], err.event["samples"]) == (
        "input", "args[0]", [BAD])
    rep = _replay(err.bundle_path, "auto")
    assert (rep["origin"]["phase"], rep["origin"]["samples"], rep["cause"]) == (
        "input", [BAD], "input")
    assert rep["what_if"] == []  # auto proposes no drop it cannot make


def _gat_bundle(out_dir: Path) -> Path:
    """A GAT's hand-written edge softmax (no max subtracted) overflows exp on the edges of one
    node (23) whose features came in unnormalised at step K; inf / inf is NaN."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(60, 16, generator=g)
    y = torch.randint(0, 4, (60,), generator=g)
    edges = torch.randint(0, 60, (2, 240), generator=g)
    edge_index = torch.cat([edges, torch.arange(60).repeat(2, 1)], 1)
    model = M.node_gat()
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="graph_models:node_gat"):
            for step in range(8):
                xs = x.clone()
                if step == K:
                    xs[23] *= 5000.0  # raw counts where z-scores belong
                opt.zero_grad()
                crit(model(xs, edge_index), y).backward()
                opt.step()
    assert (info.value.event["step"], info.value.event["module"]) == (K, "gat1")
    return info.value.bundle_path


def test_dropping_nodes_of_a_graph_cuts_their_edges(tmp_path):
    """The samples are the nodes; dropping the unnormalised one must cut its edges from the
    edge list and renumber the rest (before, the model indexed past the shortened node
    tensor: IndexError in the user's code), and the step is then finite."""
    rep = _replay(_gat_bundle(tmp_path), "drop=23")
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], rep["cause"]) == (
        "forward", "gat1", "aten.exp", "overflow")
    assert 23 in o["samples"] and o["batch_size"] == 60
    (dropped,) = rep["what_if"]
    assert dropped["finite"] is True, dropped


def test_a_float64_try_makes_the_models_own_buffers_float64_too(tmp_path):
    """``--try dtype=float64`` on a model that makes its own scatter targets
    (``torch.zeros(n, heads).index_add_(0, dst, ex)``, no dtype given): those follow the try's
    type as they followed float32 in training. Before, the re-run raised in the model's code
    ('index_add_(): self (Float) and source (Double) must have the same scalar type') and the
    try read 'failed'. Here float64 overflows exp as well, as the cause says."""
    rep = _replay(_gat_bundle(tmp_path), "dtype=float64")
    (wider,) = rep["what_if"]
    assert "error" not in wider, wider
    assert wider["finite"] is False and wider["origin"]["module"] == "gat1", wider
    assert torch.get_default_dtype() == torch.float32  # restored after the re-run


def _sparse_gcn_run(out_dir: Path, clamp: bool) -> NonFiniteError:
    """pygcn's loop: features and a sparse normalised adjacency passed to ``forward``. At step
    K the edge sampling leaves node 7 with no edge into it (self loop included)."""
    import warnings
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 16, generator=g)
    y = torch.randint(0, 4, (50,), generator=g)
    edges = torch.cat([torch.randint(0, 50, (2, 150), generator=g),
                       torch.arange(50).repeat(2, 1)], 1)
    model = M.sparse_gcn()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="graph_models:sparse_gcn"):
            for step in range(8):
                e = edges[:, edges[1] != 7] if step == K else edges
                opt.zero_grad()
                crit(model(x, M.normalized_adjacency(e, 50, clamp)), y).backward()
                opt.step()
    assert info.value.bundle_path is not None, info.value.write_error
    return info.value


def test_a_sparse_adjacency_passed_to_forward_is_recorded_and_replayed(tmp_path):
    """A sparse COO input disabled the recorder ('recorder disabled after an internal error
    (NotImplementedError: Could not run aten::amin.out ... SparseCPU)'; training went on
    unrecorded), and a bundle could not hold it. It is now checked by its values and stored
    as its indices and values, and the replay rebuilds it: the 0/0 of node 7's normalisation
    is named in gc1, on node 7."""
    err = _sparse_gcn_run(tmp_path, clamp=True)
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (K, "forward", "gc1")
    rep = _replay(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == (
        "forward", "gc1", "aten.div", [7], "invalid")


def test_an_infinity_in_a_sparse_adjacency_is_an_input_event_on_it(tmp_path):
    """Without ``deg.clamp(min=1)`` the adjacency itself holds inf (0 ** -0.5 for node 7):
    the event is the input that holds it, named, not per sample."""
    err = _sparse_gcn_run(tmp_path, clamp=False)
    assert (err.event["step"], err.event["phase"], err.event["tensor"]) == (K, "input", "args[1]")
    rep = _replay(err.bundle_path)
    assert (rep["origin"]["phase"], rep["origin"]["tensor"], rep["cause"]) == (
        "input", "args[1]", "input")


def test_dropping_a_node_cuts_its_row_and_column_from_a_sparse_adjacency(tmp_path):
    """``--try drop=7`` on the pygcn run: node 7's row and column go from the sparse
    ``(N, N)`` adjacency with its features and label, the other nodes renumbered (before,
    the 49 rows kept met the 50 x 50 adjacency: 'addmm: ... Expected dim 0 size 50, got 49'
    in the user's code), and the step is finite without it; the bundle's own record of the
    adjacency is untouched for the next try (the unchanged re-run stays non-finite)."""
    err = _sparse_gcn_run(tmp_path, clamp=True)
    rep = _replay(err.bundle_path, "drop=7", "drop=3")
    dropped, other = rep["what_if"]
    assert dropped["finite"] is True, dropped
    assert other["finite"] is False and other["inconclusive"] is False, other


def test_dropping_a_node_cuts_its_row_and_column_from_a_dense_adjacency(tmp_path):
    """Node 11 is cut out of the graph (its row and column of the dense adjacency zeroed) at
    step K but kept in the batch: deg.pow(-0.5) is inf there. The replay names the pow and
    node 11; ``--try drop=11`` cuts the node's row and column from the ``(N, N)`` adjacency
    (before, only its row: 'mat1 and mat2 shapes cannot be multiplied (39x40 and 39x39)' in
    the user's code), and the step is finite without it."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 8, generator=g)
    y = torch.randint(0, 3, (40,), generator=g)
    base = (torch.rand(40, 40, generator=g) < 0.1).float()
    base = ((base + base.T) > 0).float() + torch.eye(40)
    model = M.dense_gcn()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="graph_models:dense_gcn"):
            for step in range(8):
                adj = base.clone()
                if step == K:
                    adj[11], adj[:, 11] = 0.0, 0.0
                opt.zero_grad()
                crit(model(x, adj), y).backward()
                opt.step()
    rep = _replay(info.value.bundle_path, "auto")
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], o["samples"],
            rep["cause"]) == (K, "forward", "", "aten.pow", [11], "invalid")
    # a degree's negative power: the graph idiom, not only a clamp to eps
    assert rep["hint"].startswith("aten.pow of 0 to a negative power (a pole), which exact "
                                  "arithmetic makes too: keep the base away from 0"), rep["hint"]
    assert "deg.clamp(min=1)" in rep["hint"] and "inv[deg == 0] = 0" in rep["hint"]
    (dropped,) = rep["what_if"]
    assert dropped["try"] == "drop=11" and dropped["finite"] is True, dropped


def test_a_scatter_max_pooling_of_an_empty_graph_is_the_reduction_not_the_head(tmp_path):
    """torch_scatter-style max pooling starts from -inf; graph 4 has no node, so its row
    keeps the -inf, and the head's addmm makes NaN of it. Before, that addmm was blamed with
    'an infinity met another in arithmetic: find the op that made the first infinity', which
    points at the intended -inf fill; the scatter_reduce that left the fill in an empty group
    is named now, on graph 4, with the fix."""
    err = _train("empty", tmp_path, pool="max")
    rep = _replay(err.bundle_path)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], o["made"], o["samples"],
            rep["cause"]) == (K, "forward", "", "aten.scatter_reduce", "-inf", [BAD], "invalid")
    assert "empty group" in rep["hint"] and "out[count == 0] = 0" in rep["hint"]
    assert [c["op"] for c in o["chain"]] == ["aten.full", "aten.scatter_reduce"]


def test_a_segment_mean_over_an_empty_graph_is_an_empty_group_not_a_pole(tmp_path):
    """``torch.segment_reduce(x, "mean", lengths=...)`` of graph 4, which has no node, is
    0/0. Before, the cause read 'aten.segment_reduce of 0 (at a pole or outside its domain):
    clamp the op's input away from the pole (x.clamp_min(eps))', which fixes nothing."""
    err = _train("empty", tmp_path, pool="segment")
    rep = _replay(err.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == (
        "", "aten.segment_reduce", [BAD], "invalid")
    assert "segment with no element" in rep["hint"] and "clamp_min" not in rep["hint"]

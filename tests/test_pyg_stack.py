"""End to end on graph learning with PyTorch Geometric (``pyg_stack_models``): ``Data`` graphs
joined into a ``Batch`` by ``torch_geometric.loader.DataLoader`` and passed whole as
``model(data)``, GCN/GAT/SAGE/GIN convolutions read out per graph by ``global_mean_pool`` over
the batch vector (graph regression, Adam, gradient clipping, float16 autocast), and a GAT node
classifier trained on a train mask through a loss wrapper. Each planted failure fires under
the recorder and is replayed with the CLI; the healthy runs raise nothing and train
bit-identically with and without the recorder.

The recorder saw none of a PyG ``Batch``'s tensors (no dict, no dataclass): a NaN feature
was an event at the root's output, and the replay could not rebuild the batch
(``DataBatch(...)`` 'cannot be rebuilt'). It now walks such objects by their ``to_dict()`` and
rebuilds them by their type's ``from_dict()``."""

from __future__ import annotations

import contextlib

import pyg_stack_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError
from recorder.capture import flatten_tree, map_tensors, tensor_leaves, unflatten_tree

pytestmark = pytest.mark.usefixtures("in_tests_dir")

K, BAD = 2, 1  # the step the planted failure is in, and its graph (of M.BATCH)
FACTORY = "pyg_stack_models:make_regressor"


def line_of(text: str) -> str:
    return source_line("pyg_stack_models.py", text)


def train(plant: str, out_dir, kw: dict | None = None, amp: torch.dtype | None = None,
          record: bool = True, **data_kw) -> torch.nn.Module:
    """Graph regression: Adam, MSE on the graph targets, gradient norm clipping; the forward
    under CPU autocast when ``amp`` is given."""
    kw = kw or {}
    model = M.make_regressor(**kw)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    crit = torch.nn.MSELoss()
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, factory=FACTORY,
                         factory_kwargs=kw)
    with rec if record else contextlib.nullcontext():
        for data in M.loader(plant, K, BAD, **data_kw):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=amp) if amp else contextlib.nullcontext():
                pred = model(data)
            loss = crit(pred.float(), data.y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    return model


def train_nodes(out_dir, empty_at: int | None = None, record: bool = True) -> torch.nn.Module:
    """Node classification on one citation graph: the loss over the train mask's nodes."""
    model = M.make_node_classifier()
    opt = torch.optim.Adam(model.parameters(), lr=5e-3, weight_decay=5e-4)
    crit = M.MaskedNLL()
    data = M.citation_graph()
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                        factory="pyg_stack_models:make_node_classifier") \
            if record else contextlib.nullcontext():
        for step in range(4):
            mask = data.train_mask.clone()
            if step == empty_at:  # a split whose batch holds no training node
                mask[:] = False
            opt.zero_grad()
            loss = crit(model(data.x, data.edge_index), data.y, mask)
            loss.backward()
            opt.step()
    return model


def fire(run, *args, step: int = K, **kw):
    with pytest.raises(NonFiniteError) as info:
        run(*args, **kw)
    ev = info.value.event
    assert ev["step"] == step, ev
    return ev, nanreplay_json(info.value.bundle_path)


def info_bundle(out_dir) -> str:
    (bundle,) = out_dir.glob("*.nan")
    return str(bundle)


def origin(rep: dict) -> tuple:
    o = rep["origin"]
    return o["phase"], o["module"], o["op"], o["samples"], rep["cause"]


def same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("kw", [{}, {"conv": "gat"}, {"conv": "sage", "pool": "add"},
                                {"conv": "gin", "pool": "mean_std"},
                                {"conv": "mean_agg", "pool": "manual"}])
def test_healthy_graphs_raise_nothing_and_train_the_same(tmp_path, kw):
    same(train("none", tmp_path, kw=kw), train("none", tmp_path, kw=kw, record=False))
    same(train_nodes(tmp_path), train_nodes(tmp_path, record=False))
    assert not list(tmp_path.glob("*.nan"))


def test_a_pyg_batch_is_stored_by_key_and_rebuilt_as_a_batch():
    """A ``DataBatch`` (made at run time of ``Batch`` and ``Data``) is walked by key, and
    rebuilt as a batch again: ``num_graphs``, ``batch`` and ``ptr`` as the loader made them."""
    data = next(iter(M.loader()))
    assert [t.shape for t in tensor_leaves(data)] == [v.shape for v in data.to_dict().values()]
    tree, tensors, paths = flatten_tree([[data], {}], "b")
    assert sorted(paths.values()) == sorted(f"[0][0].{k}" for k in data.keys())
    (back,), _ = unflatten_tree(tree, tensors)
    assert type(back).__name__ == "DataBatch" and back.num_graphs == data.num_graphs
    assert torch.equal(back.batch, data.batch) and torch.equal(back.edge_index, data.edge_index)
    copied = map_tensors(data, torch.clone)
    assert copied is not data and copied.num_graphs == M.BATCH
    assert torch.equal(copied.x, data.x) and copied.x is not data.x


def test_a_nan_feature_of_one_graph_is_an_input_event_on_that_graph(tmp_path):
    """A bad record's NaN feature in graph BAD's node: the event was one at the root's output
    (the Batch's tensors unseen) and the replay refused the batch; now an input event on
    ``batch.x`` naming graph BAD, replayed."""
    ev, rep = fire(train, "nan_x", tmp_path)
    assert (ev["phase"], ev["samples"]) == ("input", [BAD]), ev
    assert "batch.x" in ev["detail"], ev
    assert (rep["origin"]["phase"], rep["origin"]["samples"], rep["cause"]) == \
        ("input", [BAD], "input"), rep
    assert "data pipeline" in rep["hint"], rep["hint"]


def test_an_isolated_node_names_the_degree_division_and_its_graph(tmp_path):
    """A hand-written mean aggregation ``agg / deg``: a node no edge reaches is 0/0."""
    b = list(M.loader("isolated", K, BAD))[K]
    lone = int(b.ptr[BAD + 1]) - 1
    assert lone not in b.edge_index[1].tolist()
    ev, rep = fire(train, "isolated", tmp_path, kw={"conv": "mean_agg"})
    assert (ev["phase"], ev["module"], ev["samples"]) == ("forward", "conv1", [BAD]), ev
    assert origin(rep) == ("forward", "conv1", "aten.div", [BAD], "invalid"), rep
    assert rep["origin"]["source"] == line_of("return agg / deg"), rep
    assert f"0 at row(s) [{lone}], rows of sample(s) [{BAD}]" in rep["hint"], rep["hint"]
    assert "isolated nodes" in rep["hint"], rep["hint"]


def test_an_empty_graph_names_the_hand_written_mean_pool(tmp_path):
    """A graph with no node in the batch: the readout's sum over nothing divided by a count of
    0 (``global_mean_pool`` itself floors the count; the hand-written mean does not)."""
    ev, rep = fire(train, "empty", tmp_path, kw={"pool": "manual"})
    assert (ev["phase"], ev["module"], ev["samples"]) == ("forward", "", [BAD]), ev
    assert origin(rep) == ("forward", "", "aten.div", [BAD], "invalid"), rep
    assert rep["origin"]["source"] == line_of("g = total / count"), rep
    assert f"Sample(s) {BAD} are empty graphs" in rep["hint"], rep["hint"]


def test_a_one_node_graph_under_a_std_readout_is_a_backward_sqrt_on_it(tmp_path):
    """The std readout of a graph of one node is sqrt(0): finite forward, and sqrt's infinite
    derivative times the variance's zero gradient is NaN in backward only. The hint spoke of
    a distance between two points that coincide (``global_mean_pool``'s sum per graph and
    ``mean[batch]``, its mean read back at each node, were not seen as a spread); now it
    names the std of the graph's nodes, 0 for a graph of one node."""
    ev, rep = fire(train, "single", tmp_path, kw={"conv": "gin", "pool": "mean_std"})
    assert ev["phase"] == "backward", ev
    assert origin(rep) == ("backward", "", "SqrtBackward0", [BAD], "invalid"), rep
    assert rep["origin"]["source"] == line_of("g = mean + var.sqrt()"), rep
    assert "sum of squared deviations from the values' own mean" in rep["hint"], rep["hint"]
    assert "or a graph of one node" in rep["hint"], rep["hint"]
    assert "two points coincide" not in rep["hint"], rep["hint"]


def test_an_out_of_scale_graph_overflows_gat_in_float16(tmp_path):
    """GAT under float16 autocast, one graph's features in raw units (10^4x the others'):
    its linear projection's cast overflows; the report names the graph's data, not float16.
    The hint offered ``--try drop=1``, which re-ran the step unchanged (the Batch's tensors
    unseen, its graph kept) and said NaN again; now it says a graph cannot be cut from the
    recorded batch, and the try refuses as for a dict of graph tensors."""
    ev, rep = fire(train, "huge", tmp_path, kw={"conv": "gat"}, amp=torch.float16,
                   scale=3e4)
    assert (ev["phase"], ev["module"], ev["samples"]) == ("forward", "conv1.lin", [BAD]), ev
    assert origin(rep) == ("forward", "conv1.lin", "aten._to_copy", [BAD], "overflow"), rep
    assert f"sample(s) {BAD} of batch.x reach" in rep["hint"], rep["hint"]
    assert "--try drop" not in rep["hint"], rep["hint"]
    assert "cannot be cut from the recorded batch" in rep["hint"], rep["hint"]
    tried = nanreplay_json(info_bundle(tmp_path), "--try", f"drop={BAD}")
    assert tried["what_if"][0]["note"].startswith("the samples are graphs of a batch"), tried


def test_an_empty_train_mask_names_the_loss_wrappers_division(tmp_path):
    """Node classification whose mask holds no training node: the loss's sum over the mask
    divided by ``mask.sum()`` = 0 is 0/0; no node is to blame."""
    ev, rep = fire(train_nodes, tmp_path, empty_at=K)
    assert (ev["phase"], ev["module"]) == ("loss", "<loss>"), ev
    assert origin(rep) == ("loss", "<loss>", "aten.div", [], "invalid"), rep
    assert rep["origin"]["source"] == line_of("(per_node * mask).sum() / mask.sum()"), rep
    assert "every element masked" in rep["hint"], rep["hint"]


def test_a_diverging_sum_pool_regression_names_the_learning_rate(tmp_path):
    """GIN with a sum readout, SGD with momentum at a learning rate too high for targets in
    raw units: the weights grow each step until the loss overflows; the hint says the run was
    diverging and to lower the learning rate, not to widen the type."""
    model = M.make_regressor(conv="gin", pool="add")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    crit = torch.nn.MSELoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path, factory=FACTORY,
                            factory_kwargs={"conv": "gin", "pool": "add"}):
            for _ in range(3):
                for data in M.loader():
                    opt.zero_grad()
                    crit(model(data), data.y).backward()
                    opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["kind"]) == (4, "loss", "+inf"), ev
    rep = nanreplay_json(info.value.bundle_path)
    assert origin(rep)[:3] == ("loss", "<loss>", "aten.mse_loss"), rep
    assert rep["cause"] == "overflow", rep
    assert "the run was diverging" in rep["hint"] and "lower the learning rate" in rep["hint"]


def test_a_nan_bond_feature_names_the_graph_of_its_edge(tmp_path):
    """GAT with ``edge_dim``, called as ``model(x, edge_index, edge_attr, batch)``: a bond
    feature the parser could not read is an input event on ``args[2]``, an edge row, named
    by the graph of its nodes."""
    model = M.make_edge_regressor()
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    crit = torch.nn.MSELoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="pyg_stack_models:make_edge_regressor"):
            for data in M.loader("nan_edge", K, BAD):
                opt.zero_grad()
                pred = model(data.x, data.edge_index, data.edge_attr, data.batch)
                crit(pred, data.y).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["samples"]) == (K, "input", [BAD]), ev
    assert "args[2]" in ev["detail"], ev
    rep = nanreplay_json(info.value.bundle_path)
    assert (rep["origin"]["phase"], rep["origin"]["samples"], rep["cause"]) == \
        ("input", [BAD], "input"), rep


def test_a_nan_feature_of_one_node_names_that_node(tmp_path):
    """Node classification: the samples are the graph's nodes, and a NaN feature of node 7
    (a bad record) is an input event naming node 7."""
    data = M.citation_graph()
    model = M.make_node_classifier()
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    crit = M.MaskedNLL()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="pyg_stack_models:make_node_classifier"):
            for step in range(4):
                x = data.x.clone()
                if step == K:
                    x[7, 1] = float("nan")
                opt.zero_grad()
                crit(model(x, data.edge_index), data.y, data.train_mask).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["samples"]) == (K, "input", [7]), ev
    rep = nanreplay_json(info.value.bundle_path)
    assert (rep["origin"]["samples"], rep["cause"]) == ([7], "input"), rep
    assert "sample 7 at feature(s) 1 (of 6)" in rep["hint"], rep["hint"]

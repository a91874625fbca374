"""End to end on hand-written graph transformers (``graph_transformers_models``): dense
batched graphs padded to the largest node count, Graphormer's degree embedding and
shortest-path attention bias with ``-inf`` key-padding masks, GraphGPS's random-walk
structural encoding and GCN branch, a virtual node and a masked-mean readout, trained with
AdamW and gradient clipping. Each planted bug of the domain fires under the recorder and is
replayed with the CLI; the guarded model raises no event and trains bit-identically with and
without the recorder."""

from __future__ import annotations

import contextlib

import graph_transformers_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("graph_transformers_models.py", text)


def batch(g: torch.Generator, bad: int | None, kind: str):
    """Six random graphs of 4 to 8 nodes, collated; graph ``bad`` is planted as ``kind``."""
    graphs, ys = [], []
    for i in range(6):
        n = int(torch.randint(4, 9, (1,), generator=g))
        x, adj = M.random_graph(g, n, isolated=kind == "isolated" and i == bad)
        if kind == "empty" and i == bad:  # a molecule whose atoms were all filtered out
            x, adj = x[:0], adj[:0, :0]
        graphs.append((x, adj))
        ys.append(torch.randn((), generator=g))
    return M.collate(graphs, ys)


def train(make: str, out_dir, kind: str = "", bad: int | None = None, steps: int = 4,
          record: bool = True):
    """AdamW with a warm-up schedule and gradient clipping, as Graphormer trains; the graph
    ``bad`` is planted in the last step's batch. Returns the model."""
    model = getattr(M, make)()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))
    crit = torch.nn.L1Loss()  # ZINC's MAE
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"graph_transformers_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step in range(steps):
            x, adj, mask, spd, y = batch(g, bad if step == steps - 1 else None, kind)
            loss = loss_fn(model(x, adj, mask, spd), y)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
    return model


def fire(make: str, tmp_path, kind: str = "", bad: int | None = None):
    with pytest.raises(NonFiniteError) as info:
        train(make, tmp_path, kind, bad)
    return info.value.event, info.value.bundle_path


def test_padded_nodes_degree_zero_in_the_random_walk_names_the_reciprocal(tmp_path):
    """``1 / deg`` for D^-1 A is +inf at every padded node (degree 0), and ``inv * adj`` is
    0 * inf = NaN there, from the first step. The replay names the reciprocal, its line, the
    graphs that were padded (1 to 4: graphs 0 and 5 have the batch's largest node count), the
    mask multiplied after it, and the eps / skip-the-rows advice."""
    ev, bundle = fire("make_gt", tmp_path)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "forward", "", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["op"], o["made"], o["samples"]) == (
        True, "aten.reciprocal", "+inf", [1, 2, 3, 4]), o
    assert o["source"] == line_of("inv = 1.0 / deg  # the bug"), o
    assert o["chain"][1]["op"] == "aten.mul" and o["chain"][1]["made"] == "nan", o["chain"]
    assert o["chain"][1]["source"] == line_of("walk = inv[..., None] * adj"), o["chain"]
    assert rep["cause"] == "invalid", rep["cause"]
    assert "pole" in rep["hint"] and "clamp_min" in rep["hint"], rep["hint"]
    assert "inf * 0 is NaN" in rep["hint"], rep["hint"]


def test_empty_graph_masked_mean_names_the_division_and_the_empty_sample(tmp_path):
    """A graph with no nodes left (all padding) in the last step: its attention row is fully
    masked (torch's attention gives 0 there, no NaN) and the masked-mean readout divides 0 by a
    node count of 0. The replay names the division, its line, graph 3 only, and the advice to
    filter empty records or floor the count."""
    ev, bundle = fire("make_gt_guard_degree", tmp_path, "empty", bad=3)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"], ev["samples"]) == (
        3, "forward", "", "nan", [3]), ev
    rep = nanreplay_json(bundle, "--try", "drop=3")
    o = rep["origin"]
    assert (rep["reproduced"], o["op"], o["made"], o["samples"]) == (
        True, "aten.div", "nan", [3]), o
    assert o["source"] == line_of("pooled = (h * m).sum(1) / count"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert "empty records: args[1] and args[2] (0/1 data) have no entry" in rep["hint"], rep["hint"]
    assert "count.clamp_min(1)" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


@pytest.mark.parametrize("kind", ["isolated", "empty"])
def test_guarded_graph_transformer_raises_nothing_and_trains_the_same(tmp_path, kind):
    """PyG's gcn_norm guard (an isolated or padded node's 1/deg set to 0) and a floored node
    count: an isolated node (a lone ion) or an empty graph is no event, nor are the ``-inf``
    key-padding masks (a fully masked row included) that stay inside the attention, and the
    weights are bit-identical with and without the recorder."""
    recorded = train("make_gt_guarded", tmp_path, kind, bad=3)
    plain = train("make_gt_guarded", tmp_path, kind, bad=3, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def eigh_backward_rows() -> list[int]:
    """The graphs whose Laplacian gets a non-finite gradient from eigh's backward in the first
    step (without the recorder): whether a padded graph's repeated eigenvalue 1 comes out
    exactly repeated in float32 (an infinite vector derivative) is the CPU's rounding."""
    grads = []
    eigh = torch.linalg.eigh

    def watched(a, *args, **kwargs):
        if a.requires_grad:
            a.register_hook(grads.append)
        return eigh(a, *args, **kwargs)

    model = M.make_gt_lap()
    x, adj, mask, spd, y = batch(torch.Generator().manual_seed(0), None, "")
    torch.linalg.eigh = watched
    try:
        torch.nn.L1Loss()(model(x, adj, mask, spd), y).backward()
    finally:
        torch.linalg.eigh = eigh
    (grad,) = grads
    return (~torch.isfinite(grad)).flatten(1).any(1).nonzero().flatten().tolist()


def test_learned_laplacian_pe_through_eigh_of_padded_graphs_names_eighs_backward(tmp_path):
    """SAN/GraphGPS's Laplacian PE on learned edge weights: ``eigh`` of the normalised
    Laplacian of a padded graph (each padded node isolated, eigenvalue 1 repeated) has an
    infinite vector derivative, so the backward of the first step turns the edge gate's gradient
    NaN (and clip_grad_norm_ then every gradient). The replay names eigh's backward, its line,
    the edge gate's parameters, the padded graphs 1 to 4, and says the graph's isolated or padded
    nodes make the repeated eigenvalues and detaching the matrix removes the term."""
    rows = eigh_backward_rows()  # ([1, 2, 3, 4] on the AMD EPYC, [1, 2, 3] on an Intel Xeon)
    assert rows and 0 not in rows, rows  # (padded graphs only: graph 0 is the largest)
    ev, bundle = fire("make_gt_lap", tmp_path)
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "backward", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["op"], o["params"], o["samples"]) == (
        True, "LinalgEighBackward0", ["edge_gate.weight", "edge_gate.bias"], rows), o
    assert o["source"] == line_of("_, vecs = torch.linalg.eigh(lap)"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "graph Laplacian with isolated or padded nodes" in rep["hint"], rep["hint"]
    assert "detach the matrix" in rep["hint"], rep["hint"]


def test_unreachable_pairs_biased_minus_inf_fill_a_padded_row_names_the_softmax(tmp_path):
    """Graphormer's own attention with unreachable pairs biased ``-inf``: a padded node reaches
    no node and its own key is padding, so its score row is all ``-inf`` and the softmax is NaN
    in the first layer at step 0 (the masked mean then carries it, 0 * NaN). The replay names
    layers.0's softmax, the padded graphs, the SPD fill that put the -inf in, and the advice to
    keep a key per row or mask with a finite number."""
    ev, bundle = fire("make_gt_unreachable", tmp_path)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (
        0, "forward", "layers.0", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["op"], o["made"], o["samples"]) == (
        True, "aten._softmax", "nan", [1, 2, 3, 4]), o
    assert o["source"] == line_of("out = torch.softmax(scores, -1) @ v"), o
    assert o["chain"][0]["source"] == line_of('(spd == MAX_DIST)[:, None], float("-inf")'), o
    assert rep["cause"] == "invalid" and "fully masked row" in rep["hint"], rep["hint"]
    assert "large finite negative number" in rep["hint"], rep["hint"]


def test_isolated_real_node_after_a_padding_only_guard_names_its_graph(tmp_path):
    """A degree guard that only covers padding (``deg.masked_fill(~mask, 1)``) trains three
    steps, then a graph with a lone ion (node 0 of graph 3 has no bond) makes ``1 / deg``
    +inf. The event and the replay name step 3, the reciprocal and graph 3 only; without that
    graph the step is finite."""
    ev, bundle = fire("make_gt_pad_degree", tmp_path, "isolated", bad=3)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "", [3]), ev
    rep = nanreplay_json(bundle, "--try", "drop=3")
    o = rep["origin"]
    assert (rep["reproduced"], o["op"], o["made"], o["samples"]) == (
        True, "aten.reciprocal", "+inf", [3]), o
    assert o["source"] == line_of("inv = 1.0 / deg  # the bug"), o
    assert rep["cause"] == "invalid" and "pole" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


class GraphSet(torch.utils.data.Dataset):
    """Twelve random graphs with regression targets; ``bad`` is planted as ``kind``."""

    def __init__(self, kind: str = "", bad: int | None = None):
        g = torch.Generator().manual_seed(2)
        self.items = []
        for i in range(12):
            n = int(torch.randint(4, 9, (1,), generator=g))
            x, adj = M.random_graph(g, n, isolated=kind == "isolated" and i == bad)
            self.items.append(((x, adj), torch.randn((), generator=g)))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def train_amp(make: str, out_dir, record: bool = True, kind: str = "", bad: int | None = None):
    """bf16 autocast, a DataLoader with the padding collate_fn and two micro-batches per
    optimizer step (gradient accumulation), as GraphGPS's configs train on CPU/bf16."""
    model = getattr(M, make)()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(
        GraphSet(kind, bad), batch_size=3, shuffle=False,
        collate_fn=lambda items: M.collate([a for a, _ in items], [y for _, y in items]))
    rec = FlightRecorder(model, opt, loss_fn=torch.nn.L1Loss(), out_dir=out_dir,
                         factory=f"graph_transformers_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else torch.nn.L1Loss()
        for i, (x, adj, mask, spd, y) in enumerate(loader):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x, adj, mask, spd)
            (loss_fn(out.float(), y) / 2).backward()
            if i % 2 == 1:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                opt.step()
                opt.zero_grad()
    return model


def test_bf16_accumulated_dataloader_training_is_unchanged_by_the_recorder(tmp_path):
    """The guarded model under bf16 autocast with accumulation over a DataLoader, with an
    isolated node in graph 4: no event and bit-identical weights with and without the
    recorder."""
    recorded = train_amp("make_gt_guarded", tmp_path, kind="isolated", bad=4)
    plain = train_amp("make_gt_guarded", tmp_path, record=False, kind="isolated", bad=4)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_bf16_accumulated_isolated_node_names_the_reciprocal_and_its_graph(tmp_path):
    """The padding-only degree guard under the same loop: graph 4 (the second micro-batch's
    graph 1) has a lone node; the replay names the reciprocal and that record."""
    with pytest.raises(NonFiniteError) as info:
        train_amp("make_gt_pad_degree", tmp_path, kind="isolated", bad=4)
    ev = info.value.event
    assert (ev["step"], ev["micro_batch"], ev["phase"], ev["samples"]) == (
        0, 1, "forward", [1]), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], o["op"], o["made"], o["samples"]) == (
        True, "aten.reciprocal", "+inf", [1]), o
    assert o["source"] == line_of("inv = 1.0 / deg  # the bug"), o


def test_unguarded_lap_pe_degree_pole_makes_eigh_raise_and_names_the_rsqrt(tmp_path):
    """``deg.rsqrt()`` for D^-1/2 is +inf at padded nodes, the Laplacian NaN there (0 * inf),
    and ``torch.linalg.eigh`` raises ``LinAlgError`` instead of returning NaN. The recorder
    still leaves a bundle of step 0, and the replay names the rsqrt (not eigh), its line, the
    padded graphs 1 to 4 and the eigh error."""
    with pytest.raises(torch.linalg.LinAlgError):
        train("make_gt_lap_unguarded", tmp_path)
    [bundle] = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["event"]["step"], rep["reproduced"], o["phase"], o["op"], o["made"],
            o["samples"]) == (0, True, "forward", "aten.rsqrt", "+inf", [1, 2, 3, 4]), o
    assert o["source"] == line_of("inv_sqrt = deg.rsqrt()"), o
    assert "linalg.eigh" in o["error"], o
    assert rep["cause"] == "invalid" and "pole" in rep["hint"], rep["hint"]

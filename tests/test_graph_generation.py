"""End to end on hand-written deep graph generation (``graph_generation_models``): GraphVAE
(a dense GCN encoder over ``D^-1/2 (A + I) D^-1/2``, the reparameterisation trick, a KL term
annealed by ``beta``, an edge decoder over the upper triangle, a node-count head, graph
matching by Sinkhorn, a molecular valence penalty, a node-count prior) and GraphRNN (a GRU
over BFS adjacency vectors), graphs of different sizes padded by a DataLoader's collate_fn,
trained with Adam and gradient clipping. Each planted bug of the domain fires under the
recorder and is replayed with the CLI; the healthy runs raise no event and train
bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import graph_generation_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("graph_generation_models.py", text)


def train_vae(out_dir, make: str = "make_vae", kind: str = "", bad: int | None = None,
              at: int = 2, steps: int = 3, hi: int = M.NMAX, eps: float = 1e-8,
              record: bool = True, **loss):
    """GraphVAE with Adam, KL annealing (``beta`` from 0 to 1 over two steps) and gradient
    clipping; the graph ``bad`` of step ``at``'s batch is planted as ``kind``."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=eps)
    crit = M.GraphVAELoss(**loss)
    data = [gr for s in range(steps)
            for gr in M.random_graphs(s + 1, 6, hi=hi, bad=bad if s == at else None, kind=kind)]
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"graph_generation_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step, (x, adj, mask, n) in enumerate(M.loader(data)):
            crit.beta = min(1.0, step / 2)
            loss = loss_fn(model(x, adj, mask), adj, x, mask, n)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    return model


def train_rnn(out_dir, guard: bool, steps: int = 3, nmax: int = 60, record: bool = True):
    """GraphRNN on batches of four graphs of 12, 60, 14 and 58 nodes, padded to 60."""
    model = M.make_rnn()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = M.GraphRNNLoss(guard=guard)
    data = [gr for s in range(steps) for i, n in enumerate((12, nmax, 14, nmax - 2))
            for gr in M.random_graphs(10 * s + i, 1, lo=n, hi=n)]
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory="graph_generation_models:make_rnn") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for _x, adj, mask, _n in M.loader(data, 4, nmax):
            seq = M.bfs_sequences(adj)
            loss = loss_fn(model(seq, mask), seq, mask)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model


def fire(train, *args, **kwargs):
    with pytest.raises(NonFiniteError) as info:
        train(*args, **kwargs)
    return info.value.event, info.value.bundle_path


def test_nan_partial_charge_of_one_atom_is_the_input(tmp_path):
    """A Gasteiger partial charge RDKit left NaN for one atom of graph 3 (step 2): the
    recorder stops at the model's input, and the replay names the tensor and the graph."""
    ev, bundle = fire(train_vae, tmp_path, kind="charge", bad=3)
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == (2, "input", "args[0]", [3]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["tensor"], o["made"], o["samples"]) == (
        True, "input", "args[0]", "nan", [3]), o
    assert rep["cause"] == "input" and "the batch itself holds NaN" in rep["hint"], rep["hint"]


def test_padded_nodes_degree_zero_names_the_pow_and_the_padded_graphs(tmp_path):
    """GCN normalisation without gcn_norm's guard: self-loops go to the real nodes only, so a
    padded node's degree is 0 and ``deg.pow(-0.5)`` is +inf there, then ``inf * 0`` NaN. The
    first batch's graph 0 has ``NMAX`` nodes (no padding): every other graph is named."""
    ev, bundle = fire(train_vae, tmp_path, "make_vae_unguarded", "full", bad=0, at=0)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "forward", "", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["op"], o["made"], o["module"], o["samples"]) == (
        True, "aten.pow", "+inf", "", [1, 2, 3, 4, 5]), o
    assert o["source"] == line_of("d = deg.pow(-0.5)"), o
    assert o["chain"][1]["op"] == "aten.mul" and o["chain"][1]["made"] == "nan", o["chain"]
    assert rep["cause"] == "invalid", rep["cause"]
    assert "deg.clamp(min=1)" in rep["hint"] and "inf * 0 is NaN" in rep["hint"], rep["hint"]
    assert "at a padded node of a dense batch" in rep["hint"], rep["hint"]


def test_out_of_scale_features_overflow_the_reparameterisation_not_the_guarded_pow(tmp_path):
    """gcn_norm's guard fills the padded nodes' ``deg^-1/2`` (+inf) with 0 at every step: an
    exact pole taken back. At step 2 graph 2's features are 1e5x the one-hot scale, and
    ``exp(0.5 * logvar)`` overflows for it. The replay named the guarded pow (its filled
    infinity) as the origin and called it invalid; it names the exp, the overflow and the
    record out of scale."""
    ev, bundle = fire(train_vae, tmp_path, kind="scale", bad=2)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"], ev["samples"]) == (
        2, "forward", "", "nan", [2]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["op"], o["made"], o["module"], o["samples"]) == (
        True, "aten.exp", "+inf", "", [2]), o
    assert o["source"] == line_of("z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)"), o
    assert rep["cause"] == "overflow", rep["cause"]
    assert "sample(s) 2 of args[0] reach 1e+05" in rep["hint"], rep["hint"]
    assert "out of scale" in rep["hint"] and "drop=2" in rep["hint"], rep["hint"]


def test_sinkhorn_matching_with_a_small_temperature_overflows_its_exp(tmp_path):
    """Simonovsky's graph matching: ``exp(S / tau)`` without the row max, tau = 0.005, then
    Sinkhorn's alternating normalisation makes inf / inf. The replay names the exp in the
    loss, overflow, and the log-space Sinkhorn."""
    ev, bundle = fire(train_vae, tmp_path, matching=True, tau=0.005)
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["op"], o["made"], o["module"], o["all_samples"]) == (
        True, "aten.exp", "+inf", "<loss>", True), o
    assert o["source"] == line_of("p = torch.exp(s / self.tau)"), o
    assert rep["cause"] == "overflow", rep["cause"]
    assert "Sinkhorn's, runs in log space with logsumexp" in rep["hint"], rep["hint"]


def test_sinkhorn_over_padded_target_nodes_divides_an_empty_column(tmp_path):
    """Graph matching that masks every real node off a padded target node (``-1e4``) and
    gives the padded node no match of its own: ``exp`` of its column is exactly 0, and the
    column normalisation is 0/0 in every graph of the batch (all are padded). The replay names
    the column's division and the exp it came from, with log-space Sinkhorn as the fix (in
    log space a masked column stays finite)."""
    ev, bundle = fire(train_vae, tmp_path, matching=True, pad_self=False)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "loss", "<loss>", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["op"], o["made"], o["module"], o["all_samples"]) == (
        True, "aten.div", "nan", "<loss>", True), o
    assert o["source"] == line_of("p = p / p.sum(-2, keepdim=True)"), o
    assert rep["cause"] == "underflow", rep["cause"]
    assert "Sinkhorn's K @ v" in rep["hint"] and "compute in log space" in rep["hint"], rep["hint"]


def test_valence_penalty_as_a_sqrt_of_squares_is_nan_in_backward_only(tmp_path):
    """The valence penalty ``sqrt(sum(excess ** 2))`` is 0 for a graph within its valences,
    as every graph is at initialisation: the forward is finite, SqrtBackward0 divides by 0
    and the hand-written ReLU's mask multiplies inf by 0."""
    ev, bundle = fire(train_vae, tmp_path, valence=1.0)
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "backward", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["op"], o["made"], o["module"]) == (
        True, "backward", "SqrtBackward0", "+inf", "<loss>"), o
    assert o["samples"] == [0, 1, 2, 3, 4, 5] and o["all_samples"], o
    assert o["source"] == line_of("(excess ** 2).sum(-1).sqrt()"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "torch.linalg.vector_norm(d, dim=-1)" in rep["hint"], rep["hint"]


def test_node_count_prior_with_an_unseen_size_names_the_histogram(tmp_path):
    """The node-count prior is the training set's size histogram, normalised, then looked up
    by each graph's size: graph 4 of step 2 has 8 nodes, a size the histogram never counted.
    The replay said the record was degenerate (repair the data); it names the loss's buffer,
    its zero entries, and to smooth the counts."""
    hist = torch.tensor([0, 0, 0, 5, 4, 6, 3, 2, 0], dtype=torch.float)
    ev, bundle = fire(train_vae, tmp_path, kind="full", bad=4, hi=M.NMAX - 1, size_hist=hist)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (2, "loss", "<loss>", "+inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["op"], o["made"], o["module"], o["samples"]) == (
        True, "aten.log", "-inf", "<loss>", [4]), o
    assert o["source"] == line_of("loss = loss - torch.log(prior[n])"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "looked up in the buffer <loss>.size_hist" in rep["hint"], rep["hint"]
    assert "exactly 0 at 4 of its 9 entries (0, 1, 2, 8)" in rep["hint"], rep["hint"]
    assert "counts + 1" in rep["hint"] and "degenerate" not in rep["hint"], rep["hint"]


def test_graphrnn_likelihood_as_a_product_underflows(tmp_path):
    """GraphRNN's ``p(G)`` as the product of its edge probabilities (about 0.5 each) is
    finite for the graphs of 12 and 14 nodes and underflows float32 for those of 60 and 58
    nodes (over 220 factors); its log is -inf there."""
    ev, bundle = fire(train_rnn, tmp_path, guard=False)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "loss", "<loss>", "+inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["op"], o["made"], o["module"], o["samples"]) == (
        True, "aten.log", "-inf", "<loss>", [1, 3]), o
    assert o["source"] == line_of("return -torch.log(lik.flatten(1).prod(-1)).mean()"), o
    assert rep["cause"] == "underflow", rep["cause"]
    assert "a product of 240 nonzero factors" in rep["hint"], rep["hint"]
    assert "log prod p = sum log p" in rep["hint"], rep["hint"]


def test_adam_without_eps_divides_zero_by_zero_on_never_updated_weights(tmp_path):
    """Adam with ``eps=0``: an element whose gradient was always 0 (a dead ReLU unit's
    weights) gets m / sqrt(v) = 0/0 at the first update."""
    ev, bundle = fire(train_vae, tmp_path, eps=0.0)
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "optimizer", "nan"), ev
    rep = nanreplay_json(bundle, code=None)
    assert rep["cause"] == "optimizer", rep["cause"]
    assert "with eps=0" in rep["hint"] and "set eps > 0" in rep["hint"], rep["hint"]
    assert rep["origin"]["param"] == "gc1.lin.weight", rep["origin"]
    assert "dec.2.weight" in rep["origin"]["params"], rep["origin"]  # (the diagonal's logits)
    assert "gc1.lin.weight" in rep["hint"], rep["hint"]


def test_healthy_graph_generation_raises_nothing_and_trains_the_same(tmp_path):
    """gcn_norm's guard, the stable KL, a smoothed size histogram, Sinkhorn at tau = 1 and
    GraphRNN's BCE form: no event, and the weights are bit-identical with and without the
    recorder (the guarded pow's +inf at padded nodes included)."""
    hist = torch.tensor([0, 0, 0, 5, 4, 6, 3, 2, 0], dtype=torch.float) + 1
    kw = dict(kind="full", bad=4, matching=True, size_hist=hist)
    pairs = [(train_vae(tmp_path, **kw), train_vae(tmp_path, record=False, **kw)),
             (train_rnn(tmp_path, True), train_rnn(tmp_path, True, record=False))]
    assert not list(tmp_path.glob("*.nan"))
    for recorded, plain in pairs:
        for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
            assert torch.equal(a, b), name

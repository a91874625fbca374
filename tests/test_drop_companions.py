"""``--try drop=N`` where the samples' rows come with inputs that are not batch-major: a sparse
adjacency (COO or CSR) and an additive attention mask over the nodes, whose row AND column
of node N go; sequences packed into one ``(total, F)`` tensor beside their ``cu_seqlens``
boundaries or per-sample counts, whose rows of sample N go and whose boundaries are rebuilt;
and boundaries of rows no input holds, where the try says it cannot tell. Each trains a
``drop_companions_models`` model until sample ``BAD`` of step ``K`` makes a 0/0, then replays
with ``drop=BAD`` (finite) and ``drop=OTHER`` (the control: the step stays non-finite)."""

from __future__ import annotations

import warnings
from pathlib import Path

import drop_companions_models as M
import pytest
import torch
from torch import nn

import replay
from recorder import FlightRecorder, NonFiniteError

K, BAD, OTHER, N = 3, 4, 2, 20

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def _train(tmp: Path, factory: str, batches, kwargs: dict | None = None) -> dict:
    """Train until the plant fires at step K, then replay with the two drops."""
    model = getattr(M, factory)(**(kwargs or {}))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp,
                            factory=f"drop_companions_models:{factory}",
                            factory_kwargs=kwargs):
            for args, y in batches:
                opt.zero_grad()
                crit(model(*args), y).backward()
                opt.step()
    assert info.value.event["step"] == K
    return replay.replay(info.value.bundle_path, tries=[f"drop={BAD}", f"drop={OTHER}"])


def _adjacency(g: torch.Generator, step: int, directed: bool = False) -> torch.Tensor:
    """A random graph with self loops; at step K node BAD has no edge at all."""
    a = (torch.rand(N, N, generator=g) < 0.2).float()
    a = (torch.triu(a) if directed else ((a + a.T) > 0).float()).fill_diagonal_(1.0)
    if step == K:
        a[BAD], a[:, BAD] = 0.0, 0.0
    return a


def _assert_plant_found(rep: dict, op: str) -> None:
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], o["samples"],
            rep["cause"]) == (K, "forward", "", op, [BAD], "invalid"), (o, rep["cause"])
    dropped, other = rep["what_if"]
    assert dropped["try"] == f"drop={BAD}" and dropped["finite"] is True, dropped
    assert other["finite"] is False and other["inconclusive"] is False, other


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_dropping_a_node_cuts_its_row_and_column_from_a_sparse_adjacency(tmp_path, layout):
    """``adj @ h`` with a sparse adjacency: before, the replay itself crashed on the product
    (its underflow watch compared the sparse operand: 'unsupported tensor layout: SparseCsr',
    "Could not run 'aten::ne.Scalar' ... 'SparseCPU'"), and a CSR drop cut crow_indices as a
    row per node ('crow_indices.shape[-1] must be equal to the number of rows + 1'). Now node
    BAD's row and column go and the rest are renumbered."""
    warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, 8, generator=g), torch.randint(0, 3, (N,), generator=g)
    sparse = torch.Tensor.to_sparse if layout == "coo" else torch.Tensor.to_sparse_csr
    batches = (((x, sparse(_adjacency(g, s))), y) for s in range(6))
    _assert_plant_found(_train(tmp_path, "mean_gcn", batches), "aten.div")


def test_dropping_a_node_cuts_its_row_and_column_from_an_additive_attention_mask(tmp_path):
    """A directed graph's additive mask (0 on an edge, -inf elsewhere: neither symmetric nor
    non-negative) lost only its row before ('The size of tensor a (19) must match the size of
    tensor b (20)' in the model's code); its column is the node too."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, 8, generator=g), torch.randint(0, 3, (N,), generator=g)

    def mask(s):
        return torch.zeros(N, N).masked_fill(_adjacency(g, s, directed=True) == 0,
                                             float("-inf"))
    rep = _train(tmp_path, "masked_attention", (((x, mask(s)), y) for s in range(6)))
    _assert_plant_found(rep, "aten._softmax")


def _packed(g: torch.Generator, counts: bool, table: bool = False):
    """Per-sample lengths 1..4, sample BAD's 0 at step K; rows packed into (total, 8)."""
    for s in range(6):
        lens = torch.randint(1, 5, (N,), generator=g)
        if s == K:
            lens[BAD] = 0
        cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
        feats = torch.randn(int(lens.sum()), 8, generator=g)
        args = (cu,) if table else (feats, lens if counts else cu)
        yield args, torch.randint(0, 3, (N,), generator=g)


@pytest.mark.parametrize("counts", [False, True], ids=["cu_seqlens", "counts"])
def test_dropping_a_packed_sequence_cuts_its_rows_and_rebuilds_the_boundaries(tmp_path,
                                                                             counts):
    """Before, ``cu_seqlens`` (N + 1) and the packed rows were left whole while the labels
    lost a row: the forward was still 0/0 at the empty sequence and ``drop=BAD`` read 'not
    finite', the opposite of the truth; with counts, dropping another sample left the rows
    ('split sizes ... sum' mismatch). Now the sample's rows go and the boundaries follow."""
    g = torch.Generator().manual_seed(0)
    rep = _train(tmp_path, "packed_mean", _packed(g, counts), {"counts": counts})
    _assert_plant_found(rep, "aten.div")


def test_boundaries_of_rows_no_input_holds_make_the_drop_say_it_cannot_tell(tmp_path):
    """``cu_seqlens`` over rows of a table the model holds: no input has those rows, so a drop
    cannot be made consistently. Before, ``drop=BAD`` read 'not finite' (only the labels were
    cut); now both drops give no verdict and say why in one line."""
    g = torch.Generator().manual_seed(0)
    rep = _train(tmp_path, "table_pooling", _packed(g, False, table=True))
    assert (rep["origin"]["op"], rep["origin"]["samples"], rep["cause"]) == (
        "aten.div", [BAD], "invalid")
    for tried in rep["what_if"]:
        assert tried["finite"] is None, tried
        assert tried["note"].startswith(f"batch reads as the boundaries of the {N} samples' "
                                        "rows"), tried["note"]
        assert "this try cannot tell" in tried["note"] and "\n" not in tried["note"]

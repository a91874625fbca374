"""End to end: tractable probabilistic models (``probabilistic_circuits_models``: an
EinsumNetworks-style circuit with Gaussian leaves, log-einsum-exp sum layers and missing
features marginalised by a leaf log-likelihood of 0; an HMM trained by the log-space forward
algorithm over masked variable-length sequences; a GMM with Cholesky-parametrised
covariances), fit by minibatch NLL with Adam and gradient clipping under the recorder until a
planted bug of the domain fires, then replayed with the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import probabilistic_circuits_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

BATCH = 32


def line_of(text: str) -> str:
    return source_line("probabilistic_circuits_models.py", text)


def loader(data, batch: int = BATCH, workers: int = 0, shuffle: bool = False) -> DataLoader:
    return DataLoader(TensorDataset(*data), batch_size=batch, num_workers=workers,
                      shuffle=shuffle, generator=torch.Generator().manual_seed(0))


def fit(model, data, opt, loss, rec=None, epochs: int = 1, anneal: float = 1.0, **kw):
    """``epochs`` over ``data`` (the model's inputs: the values, then their masks), the NLL
    clipped to a gradient norm of 10; each step multiplies the sum layers' temperature by
    ``anneal``. The losses seen."""
    call = rec.loss_fn if rec is not None else loss
    losses = []
    for _ in range(epochs):
        for batch in loader(data, **kw):
            for layer in getattr(model, "layers", ()):
                layer.temperature *= anneal
            value = call(model(*batch))
            opt.zero_grad()
            value.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            losses.append(float(value.detach()))
    return losses


def fire(tmp_path: Path, factory: str, data, lr: float = 1e-2, **kw) -> NonFiniteError:
    model = getattr(M, factory)()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    loss = M.NegLogLik()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=loss, out_dir=tmp_path,
                            factory=f"probabilistic_circuits_models:{factory}") as rec:
            fit(model, data, opt, loss, rec, **kw)
    return info.value


def report(err: NonFiniteError, step: int, phase: str) -> tuple[dict, dict]:
    assert (err.event["step"], err.event["phase"]) == (step, phase), err.event
    rep = nanreplay_json(err.bundle_path)
    assert rep["reproduced"] is True, json.dumps(rep, indent=1)
    return rep, rep["origin"]


def found(rep: dict, o: dict) -> tuple:
    return o["module"], o["op"], o["made"], o["samples"], rep["cause"]


@pytest.mark.parametrize("factory,data", [
    ("make_circuit", "tabular"),
    ("make_hmm", "sequences"),
    ("make_gmm", "blobs"),
])
def test_healthy_models_raise_nothing_and_train_bit_identically(tmp_path, factory, data):
    data = {"tabular": M.tabular, "sequences": M.sequences, "blobs": lambda: (M.blobs(),)}[data]()
    runs = []
    for recorded in (False, True):
        model = getattr(M, factory)()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        loss = M.NegLogLik()
        if recorded:
            with FlightRecorder(model, opt, loss_fn=loss, out_dir=tmp_path,
                                factory=f"probabilistic_circuits_models:{factory}") as rec:
                losses = fit(model, data, opt, loss, rec, epochs=2, workers=2, shuffle=True)
        else:
            losses = fit(model, data, opt, loss, epochs=2, workers=2, shuffle=True)
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    (plain, w0), (watched, w1) = runs
    assert plain == watched
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))
    assert not list(tmp_path.glob("*.nan"))


def test_a_nan_feature_not_marked_missing_names_the_mask_that_left_it_out(tmp_path):
    """A reading lost in the export (NaN) while the missingness mask the circuit marginalises
    by was built from the schema (all observed): the report named the scattered NaN as missing
    values to impute, and never the mask beside them that should have marked it. It now says
    args[1], the 0/1 tensor of args[0]'s shape, holds False at that entry as at the observed
    ones: build the mask from the data (x.isnan()) and fill the entry."""
    x, missing = M.tabular()
    x[2 * BATCH + 9, 3] = float("nan")
    loader_ = loader((x, missing), workers=2)
    model = M.make_circuit()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss = M.NegLogLik()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=loss, out_dir=tmp_path,
                            factory="probabilistic_circuits_models:make_circuit") as rec:
            for xb, mb in loader_:
                value = rec.loss_fn(model(xb, mb))
                opt.zero_grad()
                value.backward()
                opt.step()
    err = info.value
    del loader_, info
    rep, o = report(err, 2, "input")
    assert (o["samples"], rep["cause"]) == ([9], "input"), json.dumps(rep, indent=1)
    hint = rep["hint"]
    assert "sample 9 at feature(s) 3 (of 8)" in hint, hint
    assert "args[1], the 0/1 tensor of args[0]'s shape" in hint, hint
    assert "holds False/0 at every one of them" in hint and "x.isnan()" in hint, hint


def test_the_textbook_sum_then_log_underflows_at_an_outlier_record(tmp_path):
    """A sum layer written ``log(einsum(exp(a), exp(b), w))`` with no max-shift: a record 40
    away from every leaf makes each product density exp(-13000), 0 in float32."""
    x, missing = M.tabular(d=16)
    x[BATCH + 7] = 40.0
    err = fire(tmp_path, "make_textbook_circuit", (x, missing))
    rep, o = report(err, 1, "forward")
    assert found(rep, o) == ("layers.0", "aten.log", "-inf", [7], "underflow"), \
        json.dumps(rep, indent=1)
    assert o["source"] == line_of("return torch.log(prob)  # sum, then log")
    assert "logsumexp" in rep["hint"] and "--try drop=7" in rep["hint"], rep["hint"]


def test_a_hand_written_max_shift_of_an_all_masked_step_is_inf_minus_inf(tmp_path):
    """The HMM's padded steps given an emission log-probability of -inf (not 0) and the
    recursion run over the padding: at a short sequence's first padded step every state is
    -inf, the max-shift m is -inf and x - m is NaN (at the final step's log p(x) for a row
    padded only there): the event's samples are the padded rows. Named at the max of the
    first all -inf row, the one sample padded from step 4, with torch.logsumexp as the fix."""
    tokens, mask = M.sequences(short=(5,))
    err = fire(tmp_path, "make_hmm_own_lse_pad_neg_inf", (tokens, mask))
    rep, o = report(err, 0, "forward")
    assert found(rep, o) == ("", "aten.max", "-inf", [5], "invalid"), \
        json.dumps(rep, indent=1)
    assert o["source"] == line_of("m = a.max(dim, keepdim=True).values")
    assert err.event["samples"] == (~mask[:BATCH].all(1)).nonzero().flatten().tolist()
    assert "call torch.logsumexp" in rep["hint"], rep["hint"]


def test_logsumexp_over_an_all_masked_step_is_a_backward_only_nan(tmp_path):
    """The same -inf emissions with torch.logsumexp and ``torch.where`` keeping alpha over the
    padding: the forward is finite, logsumexp's derivative exp(x - result) at a slice all
    -inf is NaN and reaches the parameters through the where's discarded branch."""
    tokens, mask = M.sequences(short=(5,))
    err = fire(tmp_path, "make_hmm_pad_neg_inf", (tokens, mask))
    rep, o = report(err, 0, "backward")
    padded = (~mask[:BATCH].all(1)).nonzero().flatten().tolist()
    assert found(rep, o) == ("", "LogsumexpBackward0", "nan", padded, "invalid"), \
        json.dumps(rep, indent=1)
    assert o["source"] == line_of("return torch.logsumexp(a, dim)")
    assert "instead of -inf" in rep["hint"], rep["hint"]


def test_log_of_annealed_softmax_weights_underflows_in_backward(tmp_path):
    """Mixture weights as ``log(softmax(logits / T))`` with the temperature annealed towards
    hard weights: at step 13 a weight underflows to 0; the forward's einsum takes exp(-inf)
    = 0 and stays finite, the log's backward divides by 0. A weights-only NaN: no samples."""
    err = fire(tmp_path, "make_softmax_circuit", M.tabular(), epochs=2, anneal=0.7)
    rep, o = report(err, 13, "backward")
    assert found(rep, o) == ("layers.1", "LogBackward0", "nan", [], "underflow"), \
        json.dumps(rep, indent=1)
    assert o["source"] == line_of("return torch.log(torch.softmax(flat, -1))")
    assert "log_softmax instead of log(softmax)" in rep["hint"], rep["hint"]


def test_a_cholesky_diagonal_collapsing_on_duplicated_points_leaves_the_log_domain(tmp_path):
    """A GMM whose Cholesky diagonal is trained as is (no exp/softplus), on data where one
    record was duplicated 128 times: a component collapses onto it, its variance is driven
    through 0 and ``log(diag(L))`` is NaN for every sample. The same fit without the
    duplicates raises nothing (the healthy test's data, 400 steps). The report said the
    log's input was made 'from the model's parameters and buffers alone' without naming
    them; it now names those its autograd graph reaches (log_diag, and off, which tril
    keeps off the diagonal)."""
    data = (M.blobs(duplicated=128),)
    err = fire(tmp_path, "make_raw_cholesky_gmm", data, lr=0.2, epochs=10, batch=64,
               shuffle=True)
    rep, o = report(err, 11, "forward")
    assert found(rep, o)[:3] + found(rep, o)[4:] == ("", "aten.log", "nan", "invalid"), \
        json.dumps(rep, indent=1)
    assert o["samples"] == list(range(64))
    assert o["source"] == line_of("log_det = torch.log(torch.diagonal(L")
    hint = rep["hint"]
    assert "parameters and buffers alone (here of the parameters log_diag, off)" in hint, hint
    assert "a Cholesky diagonal learned as is" in hint, hint


def test_a_reading_in_the_wrong_unit_overflows_the_mahalanobis_square(tmp_path):
    """A coordinate recorded as 3e20 (a fill code, a wrong unit): the whitened residual
    ``z = L^-1 (x - mu)`` is finite, ``z * z`` overflows float32 at that record, every
    component's log-density is -inf and so is the mixture's."""
    x = M.blobs()
    x[2 * BATCH + 21, 1] = 3e20
    err = fire(tmp_path, "make_gmm", (x,))
    rep, o = report(err, 2, "forward")
    assert found(rep, o) == ("", "aten.mul", "+inf", [21], "overflow"), \
        json.dumps(rep, indent=1)
    assert o["source"] == line_of("maha = (z * z).sum(-1)")
    assert "--try drop=21" in rep["hint"], rep["hint"]

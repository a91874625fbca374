"""End to end on scVI-style single-cell VAEs written in plain torch
(``single_cell_genomics_models``): an encoder over ``log1p`` counts with batch one-hots, the
observed library ``log(x.sum(1))``, a softmax over genes times the library as the negative
binomial's mean, gene-wise dispersion ``theta = exp(px_r)``, the ZINB log-likelihood written
out, KL warm-up, Adam with weight decay (scVI's ``eps=0.01``), gradient clipping, and
minibatches densified from a sparse count matrix by a DataLoader's collate. Each planted bug
of the domain fires under the recorder and is replayed with the CLI; the healthy versions
raise no event and train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import single_cell_genomics_models as M
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

LOG_MU = "x * (torch.log(mu + eps) - log_theta_mu_eps)"


def line_of(text: str) -> str:
    return source_line("single_cell_genomics_models.py", text)


def train(make: str, out_dir, data: dict, eps: float = 1e-8, epochs: int = 1,
          record: bool = True):
    """scVI's training plan: Adam (weight decay 1e-6, eps 0.01), the KL weight warmed up
    over 6 steps, gradients clipped at 50; 64 cells in minibatches of 16 from the sparse
    matrix, so dataset cell 48 + r is row r of the fourth step's batch. Returns the model."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-6, eps=0.01)
    crit = M.ELBO(eps)
    torch.manual_seed(1)  # (the reparameterisation's randn_like, dropout)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"single_cell_genomics_models:{make}") if record else None
    step = 0
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for _ in range(epochs):
            for x, batch_index in M.loader(*M.counts(**data)):
                crit.kl_weight = min(1.0, step / 6)
                loss = loss_fn(*model(x, batch_index), x)
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 50.0)
                opt.step()
                step += 1
    return model


def fire(make: str, tmp_path, data: dict, eps: float = 1e-8):
    with pytest.raises(NonFiniteError) as info:
        train(make, tmp_path, data, eps)
    return info.value.event, info.value.bundle_path


def test_empty_cell_under_a_likelihood_without_eps_names_the_log_of_mu_and_the_cell(tmp_path):
    """A cell with no UMIs (an empty droplet that passed QC) at row 5 of the fourth batch:
    its observed library ``log(0)`` is -inf, its mean ``exp(library) * px_scale`` is 0 in
    every gene, and a ZINB written without scVI's eps takes ``log(mu)`` = -inf, times its 0
    counts: NaN. A loss event; the replay names that log, its line, the cell, the eps of 0,
    and that the cell holds no counts (filter it); dropping it makes the step finite."""
    ev, bundle = fire("make_scvi", tmp_path, {"zero_cell": 53}, eps=0.0)
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "loss", "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "<loss>", "aten.log", "-inf", [5]), o
    assert o["source"] == line_of(LOG_MU), o
    assert [c["op"] for c in o["chain"]] == ["aten.log", "aten.mul"], o["chain"]
    assert rep["cause"] == "invalid" and "exactly 0" in rep["hint"], rep["hint"]
    assert "Sample(s) 5 hold no counts: args[0] is 0 in every entry" in rep["hint"], rep["hint"]
    assert "min_counts" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_unrecorded_likelihood_without_eps_goes_nan(tmp_path):
    """Without the recorder the same run's weights turn NaN: the event is the bug."""
    model = train("make_scvi", tmp_path, {"zero_cell": 53}, eps=0.0, record=False)
    assert not all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("make,data", [
    ("make_scvi", {"zero_cell": 53}),
    ("make_scvi_panel", {"panel": True, "zero_cell": 53}),
    ("make_scvi_latent_library", {"zero_cell": 53})])
def test_scvi_eps_keeps_an_empty_cell_and_a_masked_panel_finite_without_alarm(
        tmp_path, make, data):
    """With scVI's eps the same empty cell trains: its library -inf goes into the decoder
    (a module's input), ``exp(-inf) = 0``, and ``log(0 + eps)`` stays finite; a targeted
    panel's unmeasured genes filled with -inf before the softmax give mu exactly 0 there.
    The latent library (its KL against a per-batch ``Normal`` prior) over the same cell.
    None is an event, and two epochs train bit-identically with and without the
    recorder."""
    recorded = train(make, tmp_path, data, epochs=2)
    plain = train(make, tmp_path, data, epochs=2, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.isfinite(a).all() and torch.equal(a, b), name


def test_minus_one_sentinel_of_a_failed_merge_names_log1p_and_the_cell(tmp_path):
    """A cell reindexed onto the reference genes with ``fill_value=-1`` for the 20 genes its
    matrix lacked: the encoder's ``log1p`` is -inf there, and BatchNorm spreads the NaN to the
    whole batch's output. The replay names log1p in the root's forward, only that cell, and
    the -1 the batch gave (a missing-value code: impute or drop, not clamp)."""
    ev, bundle = fire("make_scvi", tmp_path, {"sentinel_cell": 53})
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "forward", ""), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.log1p", "-inf", [5]), o
    assert o["source"] == line_of("x_ = torch.log1p(x) if self.log_variational else x"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "args[0] holds -1 at sample(s) 5" in rep["hint"], rep["hint"]
    assert "a code for a missing value" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_gene_standardised_over_a_batch_no_cell_expresses_names_the_gene(tmp_path):
    """Genes standardised over the minibatch, ``(x - mean(0)) / std(0)``, with gene 7
    expressed by no cell: 0/0 in column 7 of every row at step 0. The replay blames no cell
    and says the data holds that column constant (a gene no cell expresses), not a model unit
    that stopped varying: drop such genes or add the eps."""
    ev, bundle = fire("make_scvi_scaled", tmp_path, {"silent_gene": 7})
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "forward", "", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["all_samples"]) == ("", "aten.div", "nan", True), o
    assert o["source"] == line_of("x_ = (x_ - x_.mean(0)) / x_.std(0)"), o
    assert rep["cause"] == "invalid" and "column(s) [7]" in rep["hint"], rep["hint"]
    assert "The data is why: column(s) 7 of args[0] hold 0 in every row" in rep["hint"], rep
    assert "genes expressed in no cell" in rep["hint"], rep["hint"]


def test_dispersion_warm_start_copied_without_its_log_names_px_r_and_its_init(tmp_path):
    """``px_r`` warm-started from the data's method-of-moments dispersion, theta itself
    copied where its log belongs: a Poisson-like ambient gene's theta of 1000 makes
    ``exp(px_r)`` +inf before any update (step 0). The replay names the exp, its line, the
    parameter and its range, and says no update has touched it (fix the initialisation, not
    the learning rate); the ZINB's ``log(theta + eps)`` of that exp is no hand-written
    softplus, ``log(1 + exp(z))``, and the hint does not say so."""
    ev, bundle = fire("make_scvi_moment_init", tmp_path, {})
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "forward", "", "+inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["all_samples"]) == ("", "aten.exp", "+inf", True), o
    assert o["source"] == line_of("theta = torch.exp(px_r)"), o
    assert rep["cause"] == "overflow", rep["cause"]
    assert "the parameter px_r (in [1.118, 1000])" in rep["hint"], rep["hint"]
    assert "has not updated px_r yet" in rep["hint"], rep["hint"]
    assert "learning rate" not in rep["hint"] and "softplus" not in rep["hint"], rep["hint"]


def test_dispersion_warm_start_of_an_under_dispersed_gene_is_the_factorys_nan(tmp_path):
    """The warm start with the log taken but no floor: an ambient gene's variance below its
    mean gives a negative moment estimate, whose log is NaN in ``px_r`` before training: a
    weights event at step 0, which the replay traces to the factory's log and its line (fix
    the initialisation), not to an update."""
    ev, bundle = fire("make_scvi_moment_log", tmp_path, {})
    assert (ev["step"], ev["phase"], ev["params"]) == (0, "weights", ["px_r"]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["param"]) == ("weights", "px_r"), o
    assert rep["cause"] == "weights", rep["cause"]
    assert "the factory builds px_r non-finite: aten.log" in rep["hint"], rep["hint"]
    assert line_of("model.px_r.copy_(torch.log(m.pow(2) / (v - m)))") in rep["hint"], rep


def test_scanvi_batch_of_query_cells_only_names_the_empty_cross_entropy(tmp_path):
    """scANVI's classifier loss over the labelled cells, ``cross_entropy(logits[labelled],
    y[labelled])``, with the unlabelled query cells (-1) appended after the reference and the
    loader not shuffled: the fourth batch holds no labelled cell, and the mean over none is
    NaN. A loss event; the replay names the cross-entropy over an empty selection, no cell,
    and says to skip such batches."""
    model, y = M.make_scanvi(), M.cell_types()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-6, eps=0.01)
    crit = M.SCANVIELBO()
    torch.manual_seed(1)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="single_cell_genomics_models:make_scanvi") as rec:
            for i, (x, batch_index) in enumerate(M.loader(*M.counts())):
                crit.kl_weight = min(1.0, i / 6)
                loss = rec.loss_fn(*model(x, batch_index), x, y[16 * i:16 * (i + 1)])
                opt.zero_grad()
                loss.backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "loss", "nan"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "<loss>", "aten.nll_loss_forward", "nan", []), o
    assert o["source"] == line_of("ce = F.cross_entropy(logits[labelled], y[labelled])"), o
    assert rep["cause"] == "invalid" and "empty tensor" in rep["hint"], rep["hint"]
    assert "skip such batches" in rep["hint"], rep["hint"]


def train_bf16(out_dir, record: bool):
    """scvi-tools' mixed precision: the forward under bf16 autocast, the ZINB in float32,
    AdamW, gradients accumulated over 2 minibatches, ReduceLROnPlateau on the epoch's loss;
    the empty cell in every epoch."""
    model = M.make_scvi()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.6, patience=1)
    crit = M.ELBO()
    torch.manual_seed(1)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory="single_cell_genomics_models:make_scvi") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for _ in range(3):
            for i, (x, batch_index) in enumerate(M.loader(*M.counts(zero_cell=53))):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(x, batch_index)
                loss = loss_fn(*[t.float() for t in out], x) / 2
                loss.backward()
                if i % 2 == 1:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 50.0)
                    opt.step()
                    opt.zero_grad()
            sched.step(loss.item())
    return model


def test_bf16_accumulated_run_with_an_empty_cell_raises_nothing_and_trains_the_same(tmp_path):
    """The empty cell's -inf library under bf16 autocast, accumulation and a plateau
    scheduler: no event, finite and bit-identical weights with and without the recorder."""
    recorded, plain = train_bf16(tmp_path, True), train_bf16(tmp_path, False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.isfinite(a).all() and torch.equal(a, b), name


def test_nan_counts_of_a_cell_in_the_sparse_matrix_are_an_input_event_on_that_cell(tmp_path):
    """A cell whose stored values hold NaN (``normalize_total`` of an all-zero row written
    back into ``.X``), densified by the collate: an input event on ``args[0]``, row 5, before
    the model runs; the replay says the batch holds it and points to the data pipeline."""
    ev, bundle = fire("make_scvi", tmp_path, {"nan_cell": 53})
    assert (ev["step"], ev["phase"], ev["kind"], ev["samples"]) == (3, "input", "nan", [5]), ev
    assert ev["detail"] == "non-finite value in the model's input args[0]", ev
    rep = nanreplay_json(bundle)
    assert (rep["cause"], rep["origin"]["samples"]) == ("input", [5]), rep["origin"]
    assert "division by zero in normalisation" in rep["hint"], rep["hint"]


def test_kl_warmup_over_zero_epochs_names_the_nan_weight_the_loop_set_on_the_loss(tmp_path):
    """The KL warm-up ``min(1, epoch / n_warmup)`` in numpy scalars with ``n_warmup =
    int(0.1 * n_epochs) = 0`` for a short run: 0/0 is NaN with a warning, set on the loss as
    its ``kl_weight`` at step 0. The replay rebuilds the loss with that NaN attribute (it
    failed on the bundle's spelling 'nan' before), names the product with the NaN number on
    the ELBO's line, in every row, and the attribute that holds it."""
    model = M.make_scvi()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-6, eps=0.01)
    crit, n_epochs = M.ELBO(), 5
    n_warmup = int(0.1 * n_epochs)
    torch.manual_seed(1)
    with pytest.raises(NonFiniteError) as info, np.errstate(invalid="ignore"):
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="single_cell_genomics_models:make_scvi") as rec:
            for epoch in range(n_epochs):
                crit.kl_weight = float(np.minimum(1.0, np.float64(epoch) / n_warmup))
                for x, batch_index in M.loader(*M.counts()):
                    loss = rec.loss_fn(*model(x, batch_index), x)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "loss", "nan"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["all_samples"]) == (
        True, "<loss>", "aten.mul", True), o
    assert o["source"] == line_of("return (rec + self.kl_weight * kl_z).mean()"), o
    assert rep["cause"] == "invalid" and "given NaN as a number" in rep["hint"], rep["hint"]
    assert "At this step the loss's kl_weight is NaN, as the loop set it" in rep["hint"], rep


def test_library_prior_of_a_single_cell_batch_names_the_buffer_entry_normal_refused(tmp_path):
    """scVI's latent library: the KL of ``q(l | x)`` against ``Normal(library_log_means[s],
    library_log_vars[s].sqrt())``, the per-batch statistics computed once from the data,
    where dataset cell 53 is alone in batch 2: its variance is exactly 0, and Normal refuses
    the scale of that cell (row 5 of the fourth step): the recorder writes the step's bundle
    and lets the ValueError through. The replay names the lookup on its
    line, the cell, and the buffer's zero entry (fix the table: a group of one cell), not a
    softplus for a value the network makes."""
    model = M.make_scvi_latent_library()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-6, eps=0.01)
    crit = M.ELBO()
    torch.manual_seed(1)
    with pytest.raises(ValueError, match="GreaterThan"):
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="single_cell_genomics_models:make_scvi_latent_library"
                            ) as rec:
            for x, batch_index in M.loader(*M.counts(singleton_batch=53)):
                loss = rec.loss_fn(*model(x, batch_index), x)
                opt.zero_grad()
                loss.backward()
                opt.step()
    [bundle] = tmp_path.glob("*.nan")
    assert bundle.name == "step00000003-rank0.nan", bundle
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.index", "0", [5]), o
    assert o["source"] == line_of("self.library_log_vars[batch_index].sqrt())"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "the buffer library_log_vars" in rep["hint"], rep["hint"]
    assert "exactly 0 at 1 of its 3 entries (2)" in rep["hint"], rep["hint"]
    assert "softplus" not in rep["hint"], rep["hint"]


def test_masked_panel_under_a_likelihood_without_eps_blames_the_eps_not_a_cell(tmp_path):
    """The targeted panel (its unmeasured genes' logits filled with -inf before the softmax,
    so mu is exactly 0 there in every cell) under the ZINB written without eps: ``log(mu)``
    is -inf, times those genes' 0 counts NaN, at step 0. The replay names the log on its line
    in every row, no cell as empty, and the eps of 0 that guarded nothing."""
    ev, bundle = fire("make_scvi_panel", tmp_path, {"panel": True}, eps=0.0)
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "loss", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["all_samples"]) == (
        "<loss>", "aten.log", "-inf", True), o
    assert o["source"] == line_of(LOG_MU), o
    assert rep["cause"] == "invalid" and "exactly 0" in rep["hint"], rep["hint"]
    assert "hold no counts" not in rep["hint"], rep["hint"]


def test_where_guarded_x_log_mu_of_masked_genes_names_log_backward(tmp_path):
    """A negative binomial ELBO "made safe" for the panel's unmeasured genes (mu exactly 0)
    by ``torch.where(x > 0, x * log(mu), 0)``: the forward is finite, but ``LogBackward0``
    divides the dropped branch's 0 gradient by mu = 0. A backward event at step 0; the
    replay names that node in the loss, its line, and says the where still sends the
    gradient through the masked branch (make the input safe before the log)."""
    model = M.make_scvi_panel()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-6, eps=0.01)
    crit = M.NBWhereELBO()
    torch.manual_seed(1)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="single_cell_genomics_models:make_scvi_panel") as rec:
            for x, batch_index in M.loader(*M.counts(panel=True)):
                loss = rec.loss_fn(*model(x, batch_index), x)
                opt.zero_grad()
                loss.backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "backward", "nan"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["all_samples"]) == (
        "backward", "<loss>", "LogBackward0", True), o
    assert o["source"] == line_of("x_log_mu = torch.where(x > 0, x * torch.log(px_rate)"), o
    assert rep["cause"] == "invalid" and "torch.where" in rep["hint"], rep["hint"]
    assert "make the op's input safe before the op" in rep["hint"], rep["hint"]

"""End to end: deep clustering (DEC/IDEC, DeepCluster-v2) and neural topic models (ProdLDA,
a Dirichlet VAE, ETM) written as their repositories write them (``deep_clustering_models``),
trained under the recorder until a planted bug fires, then replayed with the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import deep_clustering_models as M
import pytest
import torch
import torch.nn.functional as F
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("deep_clustering_models.py", text)


def recorded(out_dir, factory: str, model, opt, loss_fn=None):
    return FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir,
                          factory=f"deep_clustering_models:{factory}")


# --------------------------------------------------------------------------------------------
# DEC / IDEC


def train_idec(out_dir, factory: str, far: int | None = None):
    """IDEC-pytorch's loop: centres from k-means on the embeddings (batch by batch, as pt-dec's
    ``predict`` gathers them), the target distribution of the whole data set each step, then
    ``gamma * KL(p || q) + MSE``; ``far``: a record 40 units away from the others."""
    model = getattr(M, factory)()
    g = torch.Generator().manual_seed(0)
    X, _ = M.blobs(g, 32)
    if far is not None:
        X[far] += 40.0
    loader = DataLoader(TensorDataset(X, torch.arange(len(X))), batch_size=M.BATCH)
    with torch.no_grad():
        z = torch.cat([model.ae(x)[1] for x, _ in loader])
        model.assignment.cluster_centers.copy_(M.kmeans(z, M.CLUSTERS))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with recorded(out_dir, factory, model, opt, M.idec_loss) as rec:
        for _epoch in range(2):
            for x, idx in loader:
                with torch.no_grad():
                    p = M.target_distribution(model(X)[1])
                x_bar, q = model(x)
                loss = rec.loss_fn(x_bar, q, x, p[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
    return model


def test_kmeans_singleton_centre_at_a_sqrt_distance_is_exact_not_rounding(tmp_path):
    # a record far from the others is a k-means cluster of its own: its centre is its
    # embedding bit for bit, sqrt(sum((z - mu)**2)) is sqrt(0) and its derivative NaN
    with pytest.raises(NonFiniteError) as info:
        train_idec(tmp_path, "make_idec_euclidean", far=2)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (0, "backward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["samples"]) == (
        True, "assignment", "SqrtBackward0", [2]), rep
    assert o["source"] == line_of("torch.sqrt(norm_squared)"), o["source"]
    # (was: precision, "rounding put the op's input on its pole": the float64 re-run widened
    # the stored centre but recomputed the embedding, so only it was off the pole)
    assert rep["cause"] == "invalid", rep
    hint = rep["hint"]
    assert "row 2 of assignment.cluster_centers equals an activation" in hint, hint
    assert "vector_norm" in hint and "rounding put" not in hint, hint


def test_healthy_idec_with_kmeans_centres_has_no_event(tmp_path):
    # the same loop and k-means without the far record, and the squared distance of pt-dec
    model = train_idec(tmp_path, "make_idec")
    assert not list(tmp_path.glob("*.nan"))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_loops_log_of_an_underflowed_soft_assignment_is_underflow_not_a_mask(tmp_path):
    # pt-dec's loop gives KLDivLoss output.log(): as DKM's alpha anneals up, a far cluster's
    # softmax underflows to 0, its log is -inf, its target 0, and kl_div's 0 * inf is NaN
    model = M.make_dkm()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    X, _ = M.blobs(torch.Generator().manual_seed(0), 32)
    loader = DataLoader(X, batch_size=M.BATCH)
    kl = torch.nn.KLDivLoss(reduction="batchmean")
    with pytest.raises(NonFiniteError) as info, recorded(tmp_path, "make_dkm", model, opt, kl) \
            as rec:
        for epoch in range(3):
            for step, x in enumerate(loader):
                model.assignment.alpha = 10 ** ((4 * epoch + step) / 2)  # the annealing
                x_bar, q = model(x)
                p = M.target_distribution(q).detach()
                loss = rec.loss_fn(q.log(), p) + F.mse_loss(x_bar, x)
                opt.zero_grad()
                loss.backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (3, "loss")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["samples"]) == (
        True, "<loss>", "aten.mul", [1, 4, 7]), rep
    # (was: invalid, "an infinity put in on purpose (a mask...)": nobody masked anything)
    assert rep["cause"] == "underflow", rep
    hint = rep["hint"]
    assert "loss_args[0] is the log of model output 1" in hint, hint
    assert "log_softmax" in hint and "mask" not in hint and "out of scale" not in hint, hint


# --------------------------------------------------------------------------------------------
# DeepCluster-v2


def train_deepcluster(out_dir, empty_epoch: int, balanced: str | None = None,
                      guard: bool = False, epochs: int = 3):
    """swav's ``main_deepclusterv2.py`` loop: each epoch assigns the embeddings to the nearest
    prototype and trains on those pseudo-labels; ``balanced`` weights the cross-entropy by the
    inverse cluster sizes, set in the criterion in place (``"module"``) or passed to the loss
    (``"arg"``), else the prototypes are reset to the clusters' centroids. At ``empty_epoch``
    the assignment leaves the last cluster empty; ``guard``: the empty clusters handled as
    swav does (their old centroid, a count of 1)."""
    model = M.make_deepcluster()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-6)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs)
    X, _ = M.blobs(torch.Generator().manual_seed(0), 24)
    criterion = torch.nn.CrossEntropyLoss(weight=torch.ones(M.CLUSTERS))
    loss_fn = M.balanced_ce if balanced == "arg" else criterion
    with recorded(out_dir, "make_deepcluster", model, opt, loss_fn) as rec:
        for epoch in range(epochs):
            with torch.no_grad():
                emb = torch.nn.functional.normalize(model.backbone(X), dim=1)
                labels = torch.cdist(emb, model.prototypes.weight).argmin(1)
                if epoch == empty_epoch:
                    labels = labels.clamp_max(M.CLUSTERS - 2)  # no point chose the last one
                counts = torch.bincount(labels, minlength=M.CLUSTERS).float()
                w = 1.0 / (counts.clamp_min(1) if guard else counts)
                if balanced == "module":
                    criterion.weight.copy_(w / w.sum())
                elif balanced is None:
                    model.prototypes.weight.copy_(M.deepcluster_centroids(
                        emb, labels, model.prototypes.weight, guard))
            for i in range(0, len(X), M.BATCH):
                logits, y = model(X[i:i + M.BATCH]), labels[i:i + M.BATCH]
                loss = rec.loss_fn(logits, y, w / w.sum()) if balanced == "arg" \
                    else criterion(logits, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
            sched.step()
    return model


def test_class_weights_of_an_empty_cluster_name_the_loss_weight_not_the_inputs(tmp_path):
    # 1 / count is inf for the empty cluster, w / w.sum() is inf / inf: the criterion's weight
    # buffer holds NaN from the epoch's start, and nll_loss's weighted mean is NaN
    with pytest.raises(NonFiniteError) as info:
        train_deepcluster(tmp_path, empty_epoch=1, balanced="module")
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (3, "loss")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    # (was: no op, "invalid", "check the loss inputs (targets out of range, log of zero
    # probabilities)": the model output and targets were fine, the weight was not)
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"]) == (
        True, "weights", "<loss>", "aten.nll_loss_forward"), rep
    hint = rep["hint"]
    assert "the loss's 'weight' holding nan" in hint and "index 0, 2" in hint, hint
    assert "count.clamp_min(1)" in hint, hint


def test_class_weights_passed_to_the_loss_say_which_entries_not_these_samples(tmp_path):
    # the same weights given to F.cross_entropy through the loss's arguments: an input event
    # on a tensor with no row per sample
    with pytest.raises(NonFiniteError) as info:
        train_deepcluster(tmp_path, empty_epoch=1, balanced="arg")
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (3, "input")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["tensor"], o["samples"]) == (
        True, "input", "loss_args[2]", []), rep
    # (was: "fix the data pipeline for these samples", of which there were none)
    hint = rep["hint"]
    assert "no row per sample" in hint and "NaN at index 0, 2 of its 3 values" in hint, hint
    assert "count.clamp_min(1)" in hint and "these samples" not in hint, hint


def test_centroid_of_an_empty_cluster_written_into_the_prototypes(tmp_path):
    # swav's centroid update without its counts > 0 mask: emb_sums / counts is 0/0 for the
    # empty cluster, and its NaN row is copied into the prototypes between two steps
    with pytest.raises(NonFiniteError) as info:
        train_deepcluster(tmp_path, empty_epoch=1)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (3, "weights")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["param"]) == (
        True, "weights", "prototypes", "prototypes.weight"), rep
    hint = rep["hint"]
    assert "the loop wrote it between that update and step 3" in hint, hint
    assert "clamp the count to at least 1" in hint and "row(s) 2 of 3" in hint, hint
    # (was: only federated averages, model soups and EMA copies as the writers it names)
    assert "k-means centroids" in hint and "an empty cluster's centroid" in hint, hint


def test_healthy_deepcluster_epochs_have_no_event(tmp_path):
    # the same epochs, with the empty cluster handled: no false event
    for balanced in (None, "module", "arg"):
        model = train_deepcluster(tmp_path, empty_epoch=1, balanced=balanced, guard=True)
        assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not list(tmp_path.glob("*.nan"))


# --------------------------------------------------------------------------------------------
# topic models


def sparse_bows(batch: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(batch).to_sparse()


def test_empty_document_in_a_sparse_batch_is_named_and_the_replay_is_quiet(tmp_path):
    # ETM's bow_norm in forward: a blank document (every count 0) is 0/0; the batch comes as
    # sparse rows, which the replay rebuilds
    data = M.corpus(torch.Generator().manual_seed(0), 40, empty=[21])
    loader = DataLoader(data, batch_size=M.BATCH, collate_fn=sparse_bows)
    model = M.make_etm()
    opt = torch.optim.Adam(model.parameters(), lr=5e-3, weight_decay=1.2e-6)
    with pytest.raises(NonFiniteError) as info, recorded(tmp_path, "make_etm", model, opt):
        for bows in loader:
            recon_loss, kld_theta = model(bows)
            loss = recon_loss + kld_theta
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (2, "forward")
    # the command a user runs, in a process of its own: its stderr holds no torch warning
    # (was: "Sparse invariant checks are implicitly disabled ...", from rebuilding the batch)
    done = subprocess.run([sys.executable, "-m", "replay", str(err.bundle_path), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    rep = json.loads(done.stdout)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["samples"]) == (
        True, "invalid", "", "aten.div", [5]), rep
    assert o["source"] == line_of("normalized_bows = bows / bows.sum(1"), o["source"]
    assert "skip the rows where it is 0" in rep["hint"], rep["hint"]


def train_dvae(out_dir, long_doc: int | None = None, epochs: int = 1):
    """A Dirichlet VAE's loop over a DataLoader of bags of words; ``long_doc``: a document
    whose counts were never capped (a thousand times the others': a concatenated dump)."""
    g = torch.Generator().manual_seed(0)
    data = M.corpus(g, 40, empty=[3])
    if long_doc is not None:
        data[long_doc] *= 1000
    loader = DataLoader(data, batch_size=M.BATCH, shuffle=long_doc is None, generator=g)
    model = M.make_dvae()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3, betas=(0.99, 0.999))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    with recorded(out_dir, "make_dvae", model, opt, M.dvae_loss) as rec:
        for _epoch in range(epochs):
            for bow in loader:
                log_recon, kl = model(bow)
                loss = rec.loss_fn(log_recon, kl, bow)
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
    return model


def test_dirichlet_kl_at_a_concentration_of_zero_names_lgamma_and_the_document(tmp_path):
    # the long document drives the encoder's softplus below float32's range: a concentration
    # of exactly 0, lgamma(0) = inf inside torch.distributions' Dirichlet KL, then inf - inf
    with pytest.raises(NonFiniteError) as info:
        train_dvae(tmp_path, long_doc=13)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (1, "forward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "underflow", "", "aten.lgamma", "+inf", [5]), rep
    # the user's line that called kl_divergence, not torch/distributions/kl.py
    assert o["source"] == line_of("kl = kl_divergence(posterior"), o["source"]
    hint = rep["hint"]
    assert "clamp the value away from 0" in hint and "out of scale" in hint, hint
    assert "--try drop=5" in hint, hint


def test_healthy_topic_models_with_blank_documents_have_no_event(tmp_path):
    # ProdLDA (Laplace-approximated Dirichlet prior, log(recon + 1e-10)) and the Dirichlet VAE
    # on a corpus with blank documents, two epochs each: no false event
    model = train_dvae(tmp_path, epochs=2)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    loader = DataLoader(M.corpus(g, 48, empty=[3, 17]), batch_size=M.BATCH, shuffle=True,
                        generator=g)
    model = M.make_prodlda()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3, betas=(0.99, 0.999))
    with recorded(tmp_path, "make_prodlda", model, opt, model.loss) as rec:
        for _epoch in range(2):
            for bow in loader:
                recon, mean, logvar = model(bow)
                loss = rec.loss_fn(recon, mean, logvar, bow)
                opt.zero_grad()
                loss.backward()
                opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not list(tmp_path.glob("*.nan"))

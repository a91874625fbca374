"""End to end on learning with noisy labels (``noisy_labels_models``): symmetric cross
entropy, generalized cross entropy, active-passive losses, forward correction by a transition
matrix estimated from a trusted subset and a learned noise adaptation layer, Co-teaching's
exchange of small-loss samples (one optimizer over both peers, or one each), bootstrapping,
DivideMix's GMM on the per-sample losses, label smoothing over -inf masked classes, and
bfloat16 autocast with accumulated micro-batches. Each planted bug of the domain
fires under the recorder and is replayed with the CLI; the healthy versions raise no event and
train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import noisy_labels_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("noisy_labels_models.py", text)


def loader(n: int = 192, batch: int = 32, scale_row: int | None = None):
    """The noisy training set in order (the planted record's index is its place in the
    batches); ``scale_row``: a record whose features were never standardised (x 1000)."""
    x, noisy, _ = M.noisy_dataset(n)
    if scale_row is not None:
        x[scale_row] *= 1000.0
    return DataLoader(TensorDataset(x, noisy), batch_size=batch, shuffle=False)


def transition(trusted_without: int | None = None) -> torch.Tensor:
    """T from the first 60 records' (clean, noisy) pairs, the trusted subset;
    ``trusted_without``: a noisy class left out of it (the subset was drawn before that
    class's records were labelled)."""
    _, noisy, clean = M.noisy_dataset(400, seed=1)
    keep = torch.arange(400) < 60
    if trusted_without is not None:
        keep &= noisy != trusted_without
    return M.estimate_transition(clean[keep], noisy[keep])


def train(make: str, crit, out_dir, data, epochs: int = 1, record: bool = True,
          clip: float = 5.0):
    """SGD with momentum, a step schedule and gradient clipping, as the noisy-label
    repositories train; ``crit`` is called as ``crit(logits, y)``. Returns the model."""
    model = getattr(M, make)()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    torch.manual_seed(1)  # (dropout)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"noisy_labels_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for _ in range(epochs):
            for x, y in data:
                loss = loss_fn(model(x), y)
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                opt.step()
                sched.step()
    return model


def train_coteaching(out_dir, n: int = 192, epochs: int = 2, record: bool = True):
    """Han et al.'s loop: Adam over both peers, the forget rate ramped up over the first
    epoch by ``forget_schedule``, the lr decayed linearly; ``n`` records in batches of 32
    (``drop_last=False``: 193 leaves a last batch of one record)."""
    model = M.make_pair()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    rates = M.forget_schedule(0.2, num_gradual=1, n_epoch=epochs)
    x, noisy, _ = M.noisy_dataset(n)
    data = DataLoader(TensorDataset(x, noisy), batch_size=32, shuffle=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / (epochs * len(data)))
    torch.manual_seed(1)
    rec = FlightRecorder(model, opt, loss_fn=M.coteaching_loss, out_dir=out_dir,
                         factory="noisy_labels_models:make_pair") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else M.coteaching_loss
        for epoch in range(epochs):
            for xb, yb in data:
                logits_1, logits_2 = model(xb)
                loss = loss_fn(logits_1, logits_2, yb, rates[epoch])
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
    return model


def fire(make: str, crit, tmp_path, data):
    with pytest.raises(NonFiniteError) as info:
        train(make, crit, tmp_path, data)
    return info.value.event, info.value.bundle_path


def test_reverse_ce_without_the_clamp_names_the_log_of_the_one_hot_labels(tmp_path):
    """Symmetric CE's reverse term without ``clamp(min=1e-4)`` on the one-hot labels (the
    paper's A = -4): ``log 0`` in every class but the label's, so every row's RCE is +inf at
    the first step. A loss event; the replay names the log on the RCE line, every row, and
    says to clamp its input away from the pole (the paper's clamp)."""
    ev, bundle = fire("make_net", M.SCELoss(clamp=False), tmp_path, loader())
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "loss", "<loss>", "+inf")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "<loss>", "aten.log", "-inf", list(range(32))), o
    assert o["source"] == line_of("rce = -1 * torch.sum(pred * torch.log(label_one_hot)"), o
    assert rep["cause"] == "invalid" and "clamp" in rep["hint"], rep["hint"]


def test_gce_without_the_clamp_names_the_pow_gradient_at_zero_and_the_record(tmp_path):
    """GCE's ``p_y ** q`` without APL's ``clamp(min=1e-7)``: a record whose features were
    never standardised (x 1000) gives logits of ~1e3, its noisy label's softmax probability
    underflows to 0, and ``q p^(q-1)`` is +inf there in backward (the forward stays finite).
    The replay names PowBackward0 on the GCE line, the record's row, underflow, the clamp, and
    the record's out-of-scale data; dropping it makes the step finite."""
    ev, bundle = fire("make_plain_net", M.GCELoss(clamp=False), tmp_path,
                      loader(scale_row=163))
    assert (ev["step"], ev["phase"], ev["kind"]) == (5, "backward", "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=3")
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"]) == (
        "backward", "<loss>", "PowBackward0", [3]), o
    assert o["source"] == line_of("gce = (1.0 - p_y ** self.q) / self.q"), o
    assert rep["cause"] == "underflow", rep["cause"]
    assert "clamp_min(eps)" in rep["hint"] and "out of scale" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_unclamped_gce_without_the_recorder_turns_the_weights_nan(tmp_path):
    """The event above is the bug, not a false alarm: unrecorded, clipping the NaN gradient
    norm leaves NaN in every weight it scales."""
    model = train("make_plain_net", M.GCELoss(clamp=False), tmp_path, loader(scale_row=163),
                  record=False)
    assert not all(torch.isfinite(p).all() for p in model.parameters())


def test_transition_matrix_with_a_zero_column_names_the_log_of_the_corrected_probs(tmp_path):
    """Forward correction with T estimated from a trusted subset that holds no record of
    noisy class 5: T's column 5 is 0, so ``softmax(logits) @ T`` is 0 there and its log is
    -inf, which the NLL picks in every row labelled 5 at the first step. The replay names the
    log on the forward-correction line in the loss, and says the 0 is column 5 of the
    product's right operand, all 0: the matrix to fill, not a log to clamp."""
    ev, bundle = fire("make_net", M.ForwardCorrected(transition(trusted_without=5)), tmp_path,
                      loader())
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "loss", "<loss>", "+inf")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"]) == ("<loss>", "aten.log", "-inf"), o
    assert o["source"] == line_of("return F.nll_loss(torch.log(noisy_prob), noisy_labels)"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "matrix product's column(s) [5], where its right operand (6, 6) holds only 0" in \
        rep["hint"] and "re-estimate the matrix" in rep["hint"], rep["hint"]


def test_coteaching_last_batch_of_one_record_names_the_mean_over_no_sample(tmp_path):
    """193 records in batches of 32 leave a last batch of one; once the forget rate reaches
    0.2, ``int(0.8 * 1) = 0`` samples are remembered and the peer's cross entropy is a mean
    over an empty selection (0/0) at the last step of the second epoch. The replay names the
    NLL on the exchange's line, invalid, the empty selection, a batch of one whose share rounds
down to no sample, and ``drop_last=True`` or keeping at least one."""
    with pytest.raises(NonFiniteError) as info:
        train_coteaching(tmp_path, n=193)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (13, "loss", "<loss>", "nan")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"]) == ("<loss>", "aten.nll_loss_forward", "nan"), o
    assert o["source"] == line_of("loss_1_update = F.cross_entropy(y_1[ind_2_update]"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "an empty selection" in rep["hint"] and "drop_last=True" in rep["hint"], rep["hint"]
    assert "int(remember_rate * n)" in rep["hint"] and "max(1, int(rate * n))" in rep["hint"]


HEALTHY = [("make_net", lambda: M.SCELoss()), ("make_plain_net", lambda: M.GCELoss()),
           ("make_net", lambda: M.NCEandRCE()), ("make_net", lambda: M.BootstrapLoss()),
           ("make_net", lambda: M.ForwardCorrected(transition())),
           ("make_net", lambda: torch.nn.CrossEntropyLoss(label_smoothing=0.1))]


@pytest.mark.parametrize("make,crit", HEALTHY, ids=["sce", "gce", "nce_rce", "bootstrap",
                                                    "forward", "smoothing"])
def test_healthy_losses_raise_nothing_and_train_the_same(tmp_path, make, crit):
    """The clamped SCE and GCE (on the unstandardised record too), APL's NCE+RCE,
    bootstrapping, forward correction by a full T, label smoothing: two epochs, no event,
    bit-identical weights with and without the recorder."""
    data = loader(scale_row=163 if make == "make_plain_net" else None)
    recorded = train(make, crit(), tmp_path, data, epochs=2)
    plain = train(make, crit(), tmp_path, data, epochs=2, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_healthy_coteaching_raises_nothing_and_trains_the_same(tmp_path):
    """192 records (no batch of one): argsort, the exchanged index selections and a forget
    rate ramp; no event, bit-identical peers with and without the recorder."""
    recorded = train_coteaching(tmp_path, n=192)
    plain = train_coteaching(tmp_path, n=192, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def per_sample_losses(model, data) -> torch.Tensor:
    """DivideMix's ``eval_train``: every record's CE under the model in eval mode."""
    model.eval()
    with torch.no_grad():
        losses = torch.cat([torch.nn.functional.cross_entropy(model(x), y, reduction="none")
                            for x, y, _ in data])
    model.train()
    return losses


def train_dividemix(out_dir, reg: float, outlier: int | None = None, epochs: int = 2,
                    record: bool = True):
    """Each epoch begins with the GMM on every record's loss; its clean probability weighs
    each record's label against the model's prediction (``refined_ce``). ``outlier``: a
    record never standardised (x 30), whose loss stands alone."""
    model = M.make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9, weight_decay=5e-4)
    x, noisy, _ = M.noisy_dataset(192)
    if outlier is not None:
        x[outlier] *= 30.0
    data = DataLoader(TensorDataset(x, noisy, torch.arange(192)), batch_size=32)
    torch.manual_seed(1)
    rec = FlightRecorder(model, opt, loss_fn=M.refined_ce, out_dir=out_dir,
                         factory="noisy_labels_models:make_net") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else M.refined_ce
        for _ in range(epochs):
            prob = M.gmm_clean_prob(per_sample_losses(model, data), reg=reg)
            for xb, yb, idx in data:
                loss = loss_fn(model(xb), yb, prob[idx])
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                opt.step()
    return model


def test_dividemix_gmm_without_reg_covar_names_the_clean_probability_argument(tmp_path):
    """The torch GMM without sklearn's ``reg_covar``: the outlier's loss stands alone, the
    high-loss component collapses onto it, its variance is exactly 0 and the E-step's
    ``(x - mu)² / var`` is 0/0, so every clean probability is NaN before the first step. The
    NaN is made by the loop, outside the model and the loss: an input event at step 0 naming
    the loss's argument ``w`` in every row, and the hint sends the user to the loop's code
    that computes it."""
    with pytest.raises(NonFiniteError) as info:
        train_dividemix(tmp_path, reg=0.0, outlier=40)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "input", "<loss>", "nan")
    assert ev["detail"].endswith("loss_args[2]"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["samples"], rep["cause"]) == (
        True, "input", list(range(32)), "input"), rep
    assert "loss_args[2] (w) is an argument of the loss" in rep["hint"], rep["hint"]
    assert "if the loop computes it" in rep["hint"], rep["hint"]


def test_dividemix_with_reg_covar_raises_nothing_and_trains_the_same(tmp_path):
    """DivideMix's ``reg_covar=5e-4`` on the same outlier: no event over two epochs of GMM
    fits, bit-identical weights with and without the recorder."""
    recorded = train_dividemix(tmp_path, reg=5e-4, outlier=40)
    plain = train_dividemix(tmp_path, reg=5e-4, outlier=40, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def train_subsets(out_dir, smoothing: float, record: bool = True, allow_inf=("",)):
    """Records of two sources: the second labels only classes 0-3, so classes 4 and 5 are
    masked out of its logits; AdamW, cross entropy with ``label_smoothing``."""
    model = M.make_subset_net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, noisy, _ = M.noisy_dataset(128)
    source = torch.arange(128) % 2
    noisy = torch.where(source == 1, noisy % 4, noisy)
    valid = torch.ones(128, M.CLASSES, dtype=torch.bool)
    valid[source == 1, 4:] = False
    crit = torch.nn.CrossEntropyLoss(label_smoothing=smoothing)
    torch.manual_seed(1)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory="noisy_labels_models:make_subset_net",
                         allow_inf=list(allow_inf)) if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for xb, vb, yb in DataLoader(TensorDataset(x, valid, noisy), batch_size=32):
            loss = loss_fn(model(xb, vb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model


def test_label_smoothing_over_masked_classes_names_the_sum_and_the_masked_records(tmp_path):
    """Label smoothing spreads 0.1 of every target over all classes, the masked ones too, so
    the records of the second source take ``0.1 / 6 * -inf`` (the -inf mask, allowed, then
    reached the loss): a loss event at the first step. The replay names the loss's sum, the
    masked records (the odd rows) only, and says to give the masked classes zero weight
    (label smoothing over masked classes) or mask with a finite number."""
    with pytest.raises(NonFiniteError) as info:
        train_subsets(tmp_path, smoothing=0.1)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "loss", "<loss>", "+inf")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "<loss>", "aten.sum", "-inf", list(range(1, 32, 2))), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "label smoothing or soft targets spread over masked classes" in rep["hint"], rep
    assert "large finite negative number" in rep["hint"], rep["hint"]


def test_masked_classes_without_smoothing_raise_nothing_and_train_the_same(tmp_path):
    """The same -inf mask (allowed) with plain cross entropy: the NLL reads only the
    records' own (unmasked) targets, so it stays inside; no event, bit-identical weights."""
    recorded = train_subsets(tmp_path, smoothing=0.0)
    plain = train_subsets(tmp_path, smoothing=0.0, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def train_accumulated(crit, out_dir, scale_row: int | None = None, record: bool = True):
    """bfloat16 autocast and two micro-batches of 16 accumulated per update, as a large-batch
    noisy-label recipe on a small device runs; ``scale_row``: a record never standardised."""
    model = M.make_plain_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    torch.manual_seed(1)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory="noisy_labels_models:make_plain_net") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for i, (x, y) in enumerate(loader(scale_row=scale_row, batch=16)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(model(x), y) / 2
            loss.backward()
            if i % 2 == 1:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                opt.step()
                opt.zero_grad()
    return model


def test_gce_under_bf16_accumulation_names_the_micro_batch_and_its_record(tmp_path):
    """The unclamped GCE under bfloat16 autocast with two micro-batches per update: record
    185 is row 9 of the second micro-batch of update 5. The replay names that micro-batch,
    its row, PowBackward0 in bfloat16 on the GCE line, underflow, and the out-of-scale
    record; dropping it makes the step finite."""
    with pytest.raises(NonFiniteError) as info:
        train_accumulated(M.GCELoss(clamp=False), tmp_path, scale_row=185)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["kind"]) == (5, "backward", "nan"), ev
    rep = nanreplay_json(info.value.bundle_path, "--try", "drop=9")
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["micro_batch"], o["samples"]) == (
        "backward", "<loss>", "PowBackward0", 1, [9]), o
    assert o["source"] == line_of("gce = (1.0 - p_y ** self.q) / self.q"), o
    assert rep["cause"] == "underflow" and "in bfloat16" in rep["hint"], rep["hint"]
    assert "sample(s) 9 of batch" in rep["hint"] and "out of scale" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


@pytest.mark.parametrize("crit", [M.GCELoss, M.SCELoss], ids=["gce", "sce"])
def test_bf16_accumulation_of_clamped_losses_raises_nothing_and_trains_the_same(tmp_path,
                                                                                crit):
    """The clamped GCE (on the unstandardised record) and SCE under bfloat16 autocast with
    accumulation: no event, bit-identical weights with and without the recorder."""
    recorded = train_accumulated(crit(), tmp_path, scale_row=185)
    plain = train_accumulated(crit(), tmp_path, scale_row=185, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def train_two_optimizers(out_dir, n: int = 193, epochs: int = 2, record: bool = True):
    """The reference Co-teaching script's layout: two networks, an Adam each, the recorder on
    the first (the second's logits enter its loss as a peer's output)."""
    net1 = M.make_plain_net()
    torch.manual_seed(2)  # (peers start apart)
    net2 = M.Net(norm=False)
    opt1 = torch.optim.Adam(net1.parameters(), lr=1e-3)
    opt2 = torch.optim.Adam(net2.parameters(), lr=1e-3)
    rates = M.forget_schedule(0.2, num_gradual=1, n_epoch=epochs)
    x, noisy, _ = M.noisy_dataset(n)
    data = DataLoader(TensorDataset(x, noisy), batch_size=32)
    torch.manual_seed(1)
    rec = FlightRecorder(net1, opt1, loss_fn=M.coteaching_loss, out_dir=out_dir,
                         factory="noisy_labels_models:make_plain_net") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else M.coteaching_loss
        for epoch in range(epochs):
            for xb, yb in data:
                loss = loss_fn(net1(xb), net2(xb), yb, rates[epoch])
                opt1.zero_grad()
                opt2.zero_grad()
                loss.backward()
                opt1.step()
                opt2.step()
    return net1, net2


def test_coteaching_with_an_optimizer_per_network_replays_the_peer_and_names_the_batch(
        tmp_path):
    """The same batch of one with the recorder on the first network only: the second's
    logits are a peer's output the bundle keeps as a loss argument. The replay reproduces the
    step from it and names the same NLL of the empty selection and the batch of one."""
    with pytest.raises(NonFiniteError) as info:
        train_two_optimizers(tmp_path)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (13, "loss", "<loss>", "nan")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], o["op"], o["batch_size"]) == (
        True, "aten.nll_loss_forward", 1), rep
    assert o["source"] == line_of("loss_1_update = F.cross_entropy(y_1[ind_2_update]"), o
    assert "finite on that sample given twice" in rep["hint"], rep["hint"]


def test_healthy_coteaching_with_two_optimizers_trains_the_same(tmp_path):
    """192 records: no event; both peers bit-identical with and without the recorder."""
    recorded = train_two_optimizers(tmp_path, n=192)
    plain = train_two_optimizers(tmp_path, n=192, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for net_a, net_b in zip(recorded, plain):
        for (name, a), b in zip(net_a.named_parameters(), net_b.parameters()):
            assert torch.equal(a, b), name


def test_noise_adaptation_layer_started_at_log_of_a_zero_column_names_the_factory(tmp_path):
    """The noise adaptation layer's transition logits initialised as ``log(T)`` of the
    estimate with a zero column: the parameter holds -inf before any update. A weights event
    at step 0 naming W; the replay says the factory built it, at the log on the
    initialisation's line, and to keep that log's input (a count) away from 0."""
    ev, bundle = fire("make_noise_adaptation", torch.nn.NLLLoss(), tmp_path, loader())
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "weights", "-inf"), ev
    assert "first W" in ev["detail"], ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["param"], o["op"]) == ("weights", "W", "aten.log"), o
    assert rep["cause"] == "weights", rep["cause"]
    init = line_of("self.W = nn.Parameter(torch.log(transition))")
    assert f"the factory builds W non-finite: aten.log of 0 made -inf at {init}" in \
        rep["hint"], rep["hint"]
    assert "clamp a distance or a count away from 0" in rep["hint"], rep["hint"]

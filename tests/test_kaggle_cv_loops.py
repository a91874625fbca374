"""End to end: competition-style (Kaggle) training loops (``kaggle_cv_loops_models``): K-fold
cross-validation building a fresh model, optimizer, OneCycleLR and FlightRecorder per fold, a
timm-style EMA of the weights evaluated each epoch, SWA (``AveragedModel``, ``SWALR``,
``update_bn``), AMP with a GradScaler, test-time augmentation, pseudo-labels, target encoding
and categorical embeddings. Each planted bug of the domain fires under the recorder and is
replayed with the CLI; the healthy loops raise no event and train bit-identically with and
without the recorder."""

from __future__ import annotations

import json

import kaggle_cv_loops_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch import nn
from torch.optim.swa_utils import SWALR, AveragedModel, update_bn
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("kaggle_cv_loops_models.py", text)


def recorder(model, opt, loss_fn, out_dir, factory: str, **kw):
    return FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir,
                          factory=f"kaggle_cv_loops_models:{factory}", **kw)


def tabular_cv(out_dir, data, factory: str = "make_tabular", folds: int = 2, epochs: int = 2,
               amp: bool = False, record: bool = True) -> list:
    """The tabular notebook's loop: per fold a fresh model (the training fold's category
    frequencies), AdamW, OneCycleLR, an EMA, clipping (after the scaler's unscale under AMP),
    and each epoch the validation fold's predictions of the model and of the EMA."""
    x, cat, mask, ts, y = data
    seen = []
    for fold, (tr, va) in enumerate(M.kfold(len(y), folds)):
        torch.manual_seed(fold)
        model = getattr(M, factory)()
        model.set_frequencies(cat[tr])
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        loader = DataLoader(TensorDataset(x[tr], cat[tr], mask[tr], ts[tr], y[tr]),
                            batch_size=32, shuffle=True,
                            generator=torch.Generator().manual_seed(fold))
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, epochs=epochs,
                                                    steps_per_epoch=len(loader))
        scaler = torch.amp.GradScaler("cpu", enabled=amp)
        loss_fn = nn.BCEWithLogitsLoss()
        ema = M.ModelEmaV2(model)
        rec = recorder(model, opt, loss_fn, out_dir, factory, lr_scheduler=sched,
                       scaler=scaler if amp else None) if record else None
        with rec or torch.enable_grad():
            for _ in range(epochs):
                model.train()
                for xb, cb, mb, tb, yb in loader:
                    with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
                        loss = loss_fn(model(xb, cb, mb, tb), yb)
                    opt.zero_grad()
                    scaler.scale(loss).backward()
                    scaler.unscale_(opt)
                    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    scaler.step(opt)
                    scaler.update()
                    sched.step()
                    ema.update(model)
                    seen.append(float(loss.detach()))
                model.eval()
                with torch.no_grad():
                    seen.append(model(x[va], cat[va], mask[va], ts[va]).sum().item())
                    seen.append(ema(x[va], cat[va], mask[va], ts[va]).sum().item())
        seen += [p.detach().clone() for p in model.parameters()]
    return seen


def image_cv(out_dir, data, loss_fn, epochs: int = 2, record: bool = True,
             step_past_scaler: bool = False) -> list:
    """The image notebook's loop: 2 folds, AMP (float16 autocast) with a GradScaler whose
    scale grows every 2 steps (it overflows, and skips, now and then), OneCycleLR then SWALR
    and an SWA average in the last epoch (``update_bn`` at the fold's end), an EMA evaluated
    with flip TTA each epoch."""
    img, y = data
    seen, skips = [], 0
    for fold, (tr, va) in enumerate(M.kfold(len(y), 2)):
        torch.manual_seed(fold)
        model = M.make_image()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = DataLoader(TensorDataset(img[tr], y[tr]), batch_size=16, shuffle=True,
                            generator=torch.Generator().manual_seed(fold))
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, epochs=epochs,
                                                    steps_per_epoch=len(loader))
        scaler = torch.amp.GradScaler("cpu", growth_interval=2)
        ema, swa = M.ModelEmaV2(model), AveragedModel(model)
        swa_sched = SWALR(opt, swa_lr=1e-3, anneal_epochs=1)
        rec = recorder(model, opt, loss_fn, out_dir, "make_image", scaler=scaler) \
            if record else None
        with rec or torch.enable_grad():
            for epoch in range(epochs):
                model.train()
                for xb, yb in loader:
                    with torch.autocast("cpu", dtype=torch.float16):
                        loss = loss_fn(model(xb), yb)
                    opt.zero_grad()
                    scaler.scale(loss).backward()
                    if step_past_scaler:  # the bug: clipping, then opt.step() itself
                        scaler.unscale_(opt)
                        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                        opt.step()
                    else:
                        scaler.step(opt)
                    before = scaler.get_scale()
                    scaler.update()
                    skips += scaler.get_scale() < before  # (an overflow it skipped)
                    (swa_sched if epoch == epochs - 1 else sched).step()
                    ema.update(model)
                    seen.append(float(loss.detach()))
                if epoch == epochs - 1:
                    swa.update_parameters(model)
                model.eval()
                with torch.no_grad():
                    seen.append(M.tta_predict(ema, img[va]).sum().item())
            update_bn(loader, swa)  # (its loader yields (image, label): it takes the image)
        seen += [p.detach().clone() for p in (*model.parameters(), *swa.parameters())]
    return [skips, *seen]


def fire(run, *args, **kw) -> NonFiniteError:
    with pytest.raises(NonFiniteError) as info:
        run(*args, **kw)
    return info.value


def report(err: NonFiniteError, step: int, phase: str) -> tuple[dict, dict]:
    assert (err.event["step"], err.event["phase"]) == (step, phase), err.event
    rep = nanreplay_json(err.bundle_path)
    assert rep["reproduced"] is True, json.dumps(rep, indent=1)
    return rep, rep["origin"]


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        torch.equal(u, v) if isinstance(u, torch.Tensor) else u == v for u, v in zip(a, b))


@pytest.mark.filterwarnings("ignore:Detected call of")  # (torch's, at a first step skipped)
def test_healthy_fold_loops_raise_nothing_and_train_bit_identically(tmp_path):
    """Both notebooks' loops, with and without a recorder per fold: the image loop's
    GradScaler overflows and skips steps by design, which is no event."""
    data, images = M.tabular(), M.images()
    plain = tabular_cv(tmp_path, data, record=False)
    assert same(plain, tabular_cv(tmp_path, data))
    plain = image_cv(tmp_path, images, M.LabelSmoothingCE(0.1), record=False)
    assert plain[0] > 0  # (steps the scaler skipped)
    assert same(plain, image_cv(tmp_path, images, M.LabelSmoothingCE(0.1)))
    assert not list(tmp_path.glob("*.nan"))


def test_out_of_fold_target_encoding_of_a_rare_category_is_nan_in_the_features(tmp_path):
    """A category with one row: in the out-of-fold target encoding, the folds fitted for that
    row's fold hold no row of it, and its mean target is 0/0. The encoded column goes into
    the feature matrix; the row is sample 17 of the second batch."""
    x, cat, mask, ts, y = M.tabular()
    column = cat[:, 1].clone()
    column[column == 5] = 4
    column[17] = 5
    te = M.oof_target_encoding(column, y)
    assert te.isnan().nonzero().flatten().tolist() == [17]
    err = fire(tabular_cv, tmp_path, (torch.cat([x, te[:, None]], 1), cat, mask, ts, y),
               factory="make_tabular_te")
    rep, o = report(err, 1, "input")
    assert (err.event["tensor"], o["samples"], rep["cause"]) == ("args[0]", [17], "input"), \
        json.dumps(rep, indent=1)
    assert "sample 17 at feature(s) 4 (of 5)" in rep["hint"], rep["hint"]
    assert "a target encoding's mean target of a category absent" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("seed,said", [
    (0, "-Inf alone is as often a log of a 0"),  # (the first batch: one feature's smallest)
    (2, "holds them at most once per feature, each sign"),  # (a smallest and a largest)
])
def test_rank_gauss_without_a_clip_sends_each_features_extremes_to_infinity(
        tmp_path, seed, said):
    """RankGauss by hand: erfinv of ranks scaled to [-1, 1] is -inf at each feature's smallest
    value and +inf at its largest. The hint was the generic 'check the data pipeline (bad
    files, division by zero in normalisation)' for both signs in the batch, and a ratio's zero
    denominator alone for one; it now names the transform's ends and the clip inside the
    interval (and, for -inf alone, a log of a 0)."""
    x, cat, mask, ts, y = M.tabular(seed=seed)
    err = fire(tabular_cv, tmp_path, (M.rank_gauss(x), cat, mask, ts, y))
    rep, o = report(err, 0, "input")
    x_tr = M.rank_gauss(x)[next(M.kfold(len(y), 2))[0]]
    first = next(iter(DataLoader(TensorDataset(x_tr), batch_size=32, shuffle=True,
                                 generator=torch.Generator().manual_seed(0))))[0]
    rows = (~torch.isfinite(first)).any(1).nonzero().flatten().tolist()
    assert (err.event["tensor"], o["samples"], rep["cause"]) == ("args[0]", rows, "input"), \
        json.dumps(rep, indent=1)
    assert said in rep["hint"] and "rank-gauss erfinv" in rep["hint"], rep["hint"]


def test_a_category_only_the_validation_fold_holds_names_the_frequency_table(tmp_path):
    """The category's log frequency in the training fold is a model buffer; a category only
    the validation fold holds is log(0) = -inf there. The validation forward (after the 4
    steps of the first epoch) picks it for rows 3 and 10, and after the first Linear and its
    BatchNorm SiLU makes NaN of the infinity. The chain's start, the lookup of the buffer's
    -inf, was marked intentional (a mask buffer) and the hint said to find the op that made
    the first infinity; it now names the buffer, its entry and the table's fix."""
    x, cat, mask, ts, y = M.tabular()
    cat = cat.clone()
    cat[cat[:, 1] == 5, 1] = 4
    _, va = next(M.kfold(len(y), 2))
    cat[va[[3, 10]], 1] = 5
    err = fire(tabular_cv, tmp_path, (x, cat, mask, ts, y))
    assert err.event["evaluation"] is True
    rep, o = report(err, 4, "forward")
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "mlp.2", "aten.silu", "nan", [3, 10], "invalid"), json.dumps(rep, indent=1)
    start = o["chain"][0]
    assert (start["op"], start["made"], start["intentional"], start["source"]) == (
        "aten.index", "-inf", False, line_of("parts.append(self.log_freq[c][cat[:, c]]"))
    assert rep["hint"].startswith("aten.index (" + start["source"] + ") picked the -inf of "
                                  "buffer 'log_freq' for sample(s) [3, 10], which holds it at "
                                  "1 of its 12 entries: (1, 5)"), rep["hint"]
    assert "smooth its counts" in rep["hint"] and "find the op" not in rep["hint"]


def test_an_inverse_frequency_of_a_category_unseen_in_training_reaches_the_baselines_logit(
        tmp_path):
    """The logistic-regression baseline's inverse category frequencies: 1/0 = +inf for the
    category only the validation fold holds, which the head's addmm folds into +-inf at
    validation rows 3 and 10, and the validation loss takes. The lookup was taken for a
    mask's intended fill (the generic 'an infinity held on purpose' advice)."""
    x, cat, _, _, y = M.tabular()
    cat = cat.clone()
    cat[cat[:, 0] == 5, 0] = 4
    tr, va = next(M.kfold(len(y), 2))
    cat[va[[3, 10]], 0] = 5
    torch.manual_seed(0)
    model, loss_fn = M.make_linear(), nn.BCEWithLogitsLoss()
    model.set_frequencies(cat[tr])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with pytest.raises(NonFiniteError) as info:
        with recorder(model, opt, loss_fn, tmp_path, "make_linear"):
            for b in tr.split(60):
                loss = loss_fn(model(x[b], cat[b]), y[b])
                opt.zero_grad()
                loss.backward()
                opt.step()
            with torch.no_grad():  # (the validation loss: a -inf logit alone is no event)
                loss_fn(model(x[va], cat[va]), y[va])
    rep, o = report(info.value, 2, "forward")
    assert info.value.event["evaluation"] is True
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "", "aten.addmm", "-inf", [3, 10], "invalid"), json.dumps(rep, indent=1)
    assert [(c["op"], c["made"], c["intentional"]) for c in o["chain"]] == [
        ("aten.index", "+inf", False), ("aten.addmm", "-inf", False)], o["chain"]
    assert rep["hint"].startswith("aten.index (" + line_of("rarity = torch.stack(") + ") picked "
                                  "the +inf of buffer 'inv_freq' for sample(s) [3, 10], which "
                                  "holds it at 1 of its 12 entries: (0, 5), and aten.addmm "
                                  "made -inf of it."), rep["hint"]


def test_a_focal_loss_with_gamma_below_1_on_a_leaked_column_is_nan_in_backward(tmp_path):
    """A column leaking the target (x3 = 100 y + noise) and a focal loss whose gamma a sweep
    set to 0.5: the baseline grows confident within a few steps, bce rounds to 0 and pt to 1
    on the leaked positives, and ``(1 - pt) ** 0.5`` has an infinite derivative at 0. The
    samples are the batch's rows where pt is exactly 1, found by the same training run
    without the recorder."""
    x, cat, _, _, y = M.tabular()
    x = x.clone()
    x[:, 3] = y * 100 + torch.randn(len(y), generator=torch.Generator().manual_seed(1))
    loss_fn = M.BinaryFocalLoss(gamma=0.5)

    def train(rec=None, steps=None):
        torch.manual_seed(0)
        model = M.make_linear()
        model.set_frequencies(cat)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        with rec(model, opt) if rec else torch.enable_grad():
            for b in torch.arange(len(y)).split(40)[:steps]:
                loss = loss_fn(model(x[b], cat[b]), y[b])
                opt.zero_grad()
                loss.backward()
                opt.step()
        return model

    with pytest.raises(NonFiniteError) as info:
        train(lambda m, o: recorder(m, o, loss_fn, tmp_path, "make_linear"))
    rep, o = report(info.value, 5, "backward")
    b = torch.arange(len(y)).split(40)[5]
    with torch.no_grad():
        logits = train(steps=5)(x[b], cat[b])
    pt = torch.exp(-nn.functional.binary_cross_entropy_with_logits(logits, y[b], reduction="none"))
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "<loss>", "PowBackward0", "+inf", (pt == 1).nonzero().flatten().tolist(), "precision"), \
        json.dumps(rep, indent=1)
    assert o["source"] == line_of("return (self.alpha * (1 - pt) ** self.gamma * bce).mean()")
    assert "a focal loss's (1 - p) ** gamma with gamma < 1" in rep["hint"], rep["hint"]


def test_an_on_the_fly_standardisation_of_raw_timestamps_cancels_to_a_negative_variance(
        tmp_path):
    """``E[t^2] - E[t]^2`` of unix timestamps (1.6e9 s) in float32: the squares' rounding
    (ulp 2.7e11) swamps the day's variance (6e8), which comes out negative in some batch; its
    sqrt is NaN for every row of that batch (the first fold's third step)."""
    err = fire(tabular_cv, tmp_path, M.tabular(), factory="make_tabular_time")
    rep, o = report(err, 2, "forward")
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "", "aten.sqrt", "nan", list(range(32)), "precision"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("parts.append((ts - mean) / torch.sqrt(var + 1e-6))")
    assert "catastrophic cancellation" in rep["hint"], rep["hint"]


@pytest.mark.filterwarnings("ignore:Detected call of")
def test_an_unscaled_column_overflows_float16_under_autocast(tmp_path):
    """One record's feature left unscaled (1e5) under float16 autocast: the first Linear's
    cast of it is +inf. The report names the cast, the record and its scale."""
    x, cat, mask, ts, y = M.tabular()
    x = x.clone()
    x[50, 2] = 1e5
    err = fire(tabular_cv, tmp_path, (x, cat, mask, ts, y), amp=True)
    rep, o = report(err, 0, "forward")
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "mlp.0", "aten._to_copy", "+inf", [21], "overflow"), json.dumps(rep, indent=1)
    assert "the data of these samples is out of scale" in rep["hint"], rep["hint"]


def test_a_per_time_id_pearson_loss_of_a_one_row_group_is_nan_only_in_backward(tmp_path):
    """The correlation metric of the market-prediction competitions, per ``time_id``, with an
    eps in the denominator: a time_id of one row has deviations of exactly 0, the forward is
    0 / eps, finite, but sqrt's derivative at 0 is NaN in the backward (row 24 of the fourth
    batch, the one-row group appended to it)."""
    x, cat, mask, ts, _ = M.tabular()
    target = x[:, 0] * 0.3 + torch.randn(len(x), generator=torch.Generator().manual_seed(3))
    time_id = torch.arange(len(x)) // 24
    time_id[50] = 99
    loss_fn = M.PearsonLoss()
    torch.manual_seed(0)
    model = M.make_tabular()
    model.set_frequencies(cat)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with pytest.raises(NonFiniteError) as info:
        with recorder(model, opt, loss_fn, tmp_path, "make_tabular"):
            for t in range(10):  # one batch per time_id; the late row joins time_id 3's
                rows = (time_id == t) | (time_id == 99) & (t == 3)
                loss = loss_fn(model(x[rows], cat[rows], mask[rows]), target[rows],
                               time_id[rows])
                opt.zero_grad()
                loss.backward()
                opt.step()
    rep, o = report(info.value, 3, "backward")
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "<loss>", "SqrtBackward0", "nan", [0], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("den = torch.sqrt((vx ** 2).sum())")
    assert "torch.linalg.vector_norm" in rep["hint"], rep["hint"]


def pseudo_label_event(tmp_path, img, probs, loss_fn):
    """The image model trained on soft pseudo-labels ``probs`` under ``loss_fn`` until the
    recorder raises; the pytest exception info."""
    torch.manual_seed(0)
    model = M.make_image()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(NonFiniteError) as info:
        with recorder(model, opt, loss_fn, tmp_path, "make_image"):
            for xb, pb in DataLoader(TensorDataset(img, probs), batch_size=16):
                loss = loss_fn(model(xb), pb)
                opt.zero_grad()
                loss.backward()
                opt.step()
    return info


def test_sharpened_pseudo_labels_of_an_unsure_row_underflow_to_0_over_0(tmp_path):
    """MixMatch's sharpening ``p ** (1/T)`` with T = 0.01 inside the soft-target loss: a
    pseudo-label near uniform (0.34, 0.33, 0.33) is below float32's range in every class,
    and its renormalisation is 0/0 (row 5 of the first batch)."""
    img, y = M.images()
    probs = torch.softmax(nn.functional.one_hot(y, M.N_CLASSES).float() * 3, 1)
    probs[[5, 20]] = torch.tensor([0.34, 0.33, 0.33])
    loss_fn = M.SoftTargetCE(0.01)
    info = pseudo_label_event(tmp_path, img, probs, loss_fn)
    rep, o = report(info.value, 0, "loss")
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "<loss>", "aten.div", "nan", [5], "underflow"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("soft = p / p.sum(1, keepdim=True)")


def test_confident_pseudo_label_mask_empty_in_an_unsure_batch_is_0_over_0(tmp_path):
    """FixMatch's confidence mask over pseudo-labels, the loss averaged over the confident
    rows: a batch of unsure pseudo-labels (the second) has none, and the mean is 0/0. No row
    is to blame; the count is to clamp."""
    img, y = M.images()
    probs = torch.softmax(nn.functional.one_hot(y, M.N_CLASSES).float() * 4, 1)
    probs[16:32] = torch.full((16, M.N_CLASSES), 1 / M.N_CLASSES)
    loss_fn = M.ConfidentPseudoCE(0.95)
    info = pseudo_label_event(tmp_path, img, probs, loss_fn)
    rep, o = report(info.value, 1, "loss")
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "<loss>", "aten.div", "nan", [], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("return (ce * mask).sum() / mask.sum()")
    assert "divide by count.clamp_min(1)" in rep["hint"], rep["hint"]


def test_optimizer_stepped_past_the_grad_scaler_after_unscale_for_clipping(tmp_path):
    """``scaler.unscale_(opt)``, clipping, then ``opt.step()`` instead of
    ``scaler.step(opt)``: the step where the growing scale overflows float16 (by design,
    which the scaler would skip) reaches the optimizer. The hint said to compute the op in
    float32 or rescale its inputs; it now says the loop stepped past the scaler."""
    err = fire(image_cv, tmp_path, M.images(), nn.CrossEntropyLoss(), step_past_scaler=True)
    rep, o = report(err, err.event["step"], "backward")
    assert (o["module"], o["op"], o["made"], rep["cause"]) == (
        "head", "AddmmBackward0", "-inf", "overflow"), json.dumps(rep, indent=1)
    assert "overflowed under the GradScaler's loss scale" in rep["hint"], rep["hint"]
    assert "Call scaler.step(optimizer)" in rep["hint"], rep["hint"]
    assert "compute this op in float32" not in rep["hint"], rep["hint"]


def test_a_nan_max_lr_for_onecyclelr_names_the_schedules_settings(tmp_path):
    """OneCycleLR built with ``max_lr`` NaN (an LR range test's suggestion read off a loss
    curve that went NaN): every lr it derives is NaN, and the first AdamW update makes the
    weights NaN. The hint said to evaluate the scheduler's formula at each step (a division
    by a step count of 0); it now names the param group's max_lr, initial_lr and min_lr,
    NaN as given."""
    x, cat, mask, _, y = M.tabular()
    losses = torch.tensor([0.7, 0.69, 0.6, 0.4, float("nan")])  # the range test diverged
    lrs = torch.logspace(-5, 0, len(losses))
    max_lr = float((lrs[1:] * losses.diff()).sum() / losses.diff().sum())  # (weighted: NaN)
    torch.manual_seed(0)
    model, loss_fn = M.make_tabular(), nn.BCEWithLogitsLoss()
    model.set_frequencies(cat)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=max_lr, total_steps=6)
    with pytest.raises(NonFiniteError) as info:
        with recorder(model, opt, loss_fn, tmp_path, "make_tabular", lr_scheduler=sched):
            for b in torch.arange(len(y)).split(40):
                loss = loss_fn(model(x[b], cat[b], mask[b]), y[b])
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
    assert (info.value.event["step"], info.value.event["phase"]) == (0, "optimizer")
    rep = nanreplay_json(info.value.bundle_path, code=None)
    assert rep["cause"] == "optimizer", json.dumps(rep, indent=1)
    assert "the param group's initial_lr=nan, max_lr=nan, min_lr=nan too, the settings " \
           "OneCycleLR derives every lr from" in rep["hint"], rep["hint"]
    assert "evaluate its formula" not in rep["hint"], rep["hint"]


def test_ema_weights_loaded_back_hold_the_lerp_of_an_unseen_categorys_minus_inf(tmp_path):
    """Stage 2 of the notebook continues from the EMA's weights on pseudo-labelled test rows.
    The training rows never held category 5 of column 1, so the model's log frequency there
    is -inf; the EMA's ``lerp_`` of -inf toward -inf is NaN, and ``load_state_dict`` puts
    that NaN into the model. The test rows 4 and 9 look it up."""
    x, cat, mask, _, y = M.tabular()
    cat = cat.clone()
    cat[cat[:, 1] == 5, 1] = 4
    cat[[204, 209], 1] = 5
    tr, test = torch.arange(200), torch.arange(200, 240)
    torch.manual_seed(0)
    model = M.make_tabular()
    model.set_frequencies(cat[tr])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ema, loss_fn = M.ModelEmaV2(model, decay=0.9), nn.BCEWithLogitsLoss()
    with pytest.raises(NonFiniteError) as info:
        with recorder(model, opt, loss_fn, tmp_path, "make_tabular"):
            for rows, labels in ((tr, y), (tr, y), (test, None)):
                if labels is None:  # stage 2: the EMA's weights, its pseudo-labels
                    model.load_state_dict(ema.module.state_dict())
                    with torch.no_grad():
                        labels = torch.zeros(len(y))
                        labels[test] = torch.sigmoid(ema(x[test], cat[test], mask[test]))
                        labels = labels.nan_to_num(0.5)
                for b in rows.split(50):
                    loss = loss_fn(model(x[b], cat[b], mask[b]), labels[b])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    ema.update(model)
    rep, o = report(info.value, 8, "forward")
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == (
        "", "aten.index", [4, 9], "weights"), json.dumps(rep, indent=1)
    assert "checkpoint loading" in rep["hint"] and "log_freq" in rep["hint"], rep["hint"]

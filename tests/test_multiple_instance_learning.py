"""End to end on multiple-instance learning for computational pathology
(``multiple_instance_learning_models``): bags of precomputed patch embeddings padded to the
longest slide with a mask given to ``forward``, gated attention (ABMIL/CLAM) with ``-inf`` at the
padding, top-k instance pooling, a TransMIL-like encoder with a key padding mask, a Cox survival
loss. Each planted failure of the domain fires under the recorder and is replayed with the CLI;
the healthy versions raise no event and train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import multiple_instance_learning_models as M
import pytest
import torch
import torch.nn.functional as F
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("multiple_instance_learning_models.py", text)


def ce_loss(logits, labels):
    return F.cross_entropy(logits, labels)


def bce_loss(logit, labels):
    return F.binary_cross_entropy_with_logits(logit, labels.float())


LOSSES = {"make_abmil_entropy": M.attention_entropy_loss, "make_discrete": M.discrete_nll, "make_dsmil": M.dsmil_loss, "make_topk": bce_loss, "make_topk_clamped": bce_loss, "make_survival": M.cox_loss}


def batch(make: str, g: torch.Generator, plant):
    """(model args, loss targets) of one step; ``plant(feats, mask, labels, targets)`` breaks
    the last step's batch in place."""
    feats, mask, labels = M.slides(g)
    targets = [labels]
    if make == "make_survival":
        targets = list(M.survival_targets(g))
    if make == "make_discrete":
        time, event = M.survival_targets(g)
        targets = [(time / 15).long().clamp(max=3), 1 - event]  # (bin, censorship)
    if plant is not None:
        plant(feats, mask, labels, targets)
    return (feats, mask), targets


def train(make: str, out_dir, plant=None, steps: int = 4, record: bool = True,
          amp: bool = False):
    """AdamW with weight decay 1e-5, a cosine schedule and gradient clipping, as CLAM and
    TransMIL train, the forward and loss under bfloat16 autocast with ``amp``; ``plant``
    breaks the last step's batch. Returns the model."""
    model = getattr(M, make)()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    crit = LOSSES.get(make, ce_loss)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(1)  # (dropout)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"multiple_instance_learning_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step in range(steps):
            args, targets = batch(make, g, plant if step == steps - 1 else None)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                out = model(*args)
                loss = loss_fn(*(out if isinstance(out, tuple) else (out,)), *targets)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    return model


def fire(make: str, tmp_path, plant):
    with pytest.raises(NonFiniteError) as info:
        train(make, tmp_path, plant)
    return info.value.event, info.value.bundle_path


def empty_slide(feats, mask, labels, targets):
    """Slide 3's tissue detection found no patch: its bag is all padding."""
    mask[3] = False
    feats[3] = 0.0


def dead_feature(feats, mask, labels, targets):
    """Feature 7 of slide 5's embeddings is the same for every patch (a saturated channel)."""
    feats[5, :, 7] = 0.3


def corrupted_tile(feats, mask, labels, targets):
    """Patch 1 of slide 2 was read from a corrupted tile: its embedding is NaN."""
    feats[2, 1] = float("nan")


def small_slide(feats, mask, labels, targets):
    """Slide 4 is a biopsy with two tissue patches, fewer than top-k's k = 4."""
    mask[4, 2:] = False
    feats[4, 2:] = 0.0


def all_censored(feats, mask, labels, targets):
    """Every patient of the batch is censored (alive at last follow-up): no event."""
    targets[1].zero_()


def test_empty_bag_names_the_attention_softmax_over_only_padding(tmp_path):
    """A slide without a tissue patch is a bag of padding only: its attention scores are all
    -inf and the softmax over them is 0/0 in its row. The replay names that softmax, on its
    line, on slide 3 alone, says a fully masked row has no element to pool, and points at
    the blank record, which dropping makes the step finite."""
    ev, bundle = fire("make_abmil", tmp_path, empty_slide)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"], ev["samples"]) == (
        3, "forward", "", "nan", [3]), ev
    rep = nanreplay_json(bundle, "--try", "drop=3")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "", "aten._softmax", "nan", [3]), o
    assert o["source"] == line_of("attn = torch.softmax(scores, dim=1)"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "fully masked row" in rep["hint"] and "keep at least one key" in rep["hint"], rep
    assert "drop=3" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_dsmil_empty_bag_names_the_max_instance_over_only_padding(tmp_path):
    """DSMIL's max-instance stream meets the empty bag first: the max over instance scores
    that are all -inf. The replay names that max (before the critical attention's softmax),
    slide 3, a fully masked row, and the blank record to drop."""
    ev, bundle = fire("make_dsmil", tmp_path, empty_slide)
    assert (ev["step"], ev["phase"], ev["kind"], ev["samples"]) == (3, "forward", "nan", [3])
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.max", "-inf", [3]), o
    assert o["source"] == line_of("max_pred, m_indices = ins.max(1)"), o
    assert rep["cause"] == "invalid" and "fully masked row" in rep["hint"], rep["hint"]
    assert "drop=3" in rep["hint"], rep["hint"]


def test_unrecorded_empty_bag_turns_the_weights_nan(tmp_path):
    """Without the recorder the same run's update writes NaN into the weights: the event
    above is the bug, not a false alarm."""
    model = train("make_abmil", tmp_path, empty_slide, record=False)
    assert not all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("amp", [False, True])
@pytest.mark.parametrize("make", ["make_abmil", "make_transmil", "make_transmil_mean",
                                  "make_dsmil", "make_topk_clamped", "make_survival"])
def test_padded_bags_raise_nothing_and_train_the_same(tmp_path, make, amp):
    """Bags of 5 to 12 patches padded to the longest, in float32 and under bfloat16
    autocast: the -inf at the padding stays inside the attention softmax (ABMIL, DSMIL's
    max-instance and critical attention), the key padding mask (TransMIL: its CLS token keeps
    a key in every row) and the top-k (the clamped mean zeroes what it picked of the padding,
    of a two-patch biopsy too); no event, bit-identical weights with and without the
    recorder. TransMIL without a CLS token meets an empty bag too: torch's attention gives
    a row with every key masked zeros (its safe softmax), and the masked mean divides by
    the count clamped to 1, so nothing non-finite is made."""
    plant = {"make_topk_clamped": small_slide, "make_transmil_mean": empty_slide}.get(make)
    recorded = train(make, tmp_path, plant, amp=amp)
    plain = train(make, tmp_path, plant, record=False, amp=amp)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_constant_feature_under_per_bag_standardisation_names_the_division(tmp_path):
    """Per-bag standardisation without eps divides a feature constant over a slide's patches
    by its std of 0: 0/0. The replay names the division on its line, slide 5, and says the
    eps is 0; the same run with eps = 1e-6 raises nothing."""
    ev, bundle = fire("make_abmil_norm", tmp_path, dead_feature)
    assert (ev["step"], ev["phase"], ev["kind"], ev["samples"]) == (3, "forward", "nan", [5]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.div", "nan", [5]), o
    assert o["source"] == line_of("return (feats - mean) / (var.sqrt() + eps)"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert "eps added to that input is exactly 0" in rep["hint"], rep["hint"]
    train("make_abmil_norm_eps", tmp_path / "eps", dead_feature)
    assert not list((tmp_path / "eps").glob("*.nan"))


def test_corrupted_tile_names_the_input_element_not_a_standardisation(tmp_path):
    """One patch embedding of slide 2 is NaN (a corrupted tile). The recorder stops on the
    model's input; the replay names slide 2 and the patch, says it is a real element of the
    padded bag (by the mask, args[1]) whose precomputed features are corrupt, not missing
    values the mask marks nor a channel's standardisation."""
    ev, bundle = fire("make_abmil", tmp_path, corrupted_tile)
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == (3, "input", "args[0]", [2])
    rep = nanreplay_json(bundle)
    assert (rep["cause"], rep["origin"]["tensor"], rep["origin"]["samples"]) == (
        "input", "args[0]", [2]), rep["origin"]
    hint = rep["hint"]
    assert "sample 2 at index 1 of dim 1" in hint and "real element by args[1]" in hint, hint
    assert "re-extract or drop" in hint and "marks a value missing" not in hint, hint
    assert "standardisation of each channel" not in hint, hint


def test_top_k_over_a_bag_smaller_than_k_names_topk_and_the_bag_size(tmp_path):
    """Top-k pooling with k = 4 over a two-patch biopsy picks two -inf of the padding; their
    mean is the slide's logit, -inf. The replay names the topk on its line, slide 4, and says
    the row holds fewer real entries than k, to select at most min(k, n)."""
    ev, bundle = fire("make_topk", tmp_path, small_slide)
    assert (ev["step"], ev["phase"], ev["kind"], ev["samples"]) == (3, "forward", "-inf", [4])
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.topk", "-inf", [4]), o
    assert o["source"] == line_of("top = scores.topk(self.k, dim=1).values"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "fewer entries left unmasked than the k" in rep["hint"], rep["hint"]
    assert "min(k, n)" in rep["hint"], rep["hint"]


def test_cox_loss_over_a_batch_without_events_names_the_division_by_the_event_count(tmp_path):
    """A batch of censored patients only: the Cox partial likelihood's sum over events is 0
    and so is its count. The replay names the loss's division, no sample (no record is to
    blame), and says to clamp the count or skip such batches."""
    ev, bundle = fire("make_survival", tmp_path, all_censored)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (3, "loss", "<loss>", "nan")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["made"], o["samples"]) == (
        "loss", "<loss>", "aten.div", "nan", []), o
    assert o["source"] == line_of("return -((risk - log_risk_set) * event).sum() / event.sum()")
    assert rep["cause"] == "invalid" and "no event among the batch" in rep["hint"], rep["hint"]
    assert "clamp_min(1)" in rep["hint"] and "skip such batches" in rep["hint"], rep["hint"]


def train_slides(make: str, out_dir, plant=None, steps: int = 3, accum: int = 4,
                 record: bool = True, tile: tuple[int, int, int] | None = None):
    """CLAM's loop: one slide at a time (batch size 1, no padding), the loss divided by the
    ``accum`` slides whose gradients accumulate before each AdamW step; ``plant(step, i)``
    gives micro-batch i's patch count (None: its own); ``tile``: (step, i, patch) of a
    corrupted tile's NaN embedding. Returns the model."""
    model = getattr(M, make)()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4, weight_decay=1e-5)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(1)
    rec = FlightRecorder(model, opt, loss_fn=ce_loss, out_dir=out_dir,
                         factory=f"multiple_instance_learning_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else ce_loss
        for step in range(steps):
            opt.zero_grad()
            for i in range(accum):
                size = plant(step, i) if plant is not None else None
                feats, mask, label = M.slides(g, n=1, sizes=None if size is None else [size])
                if tile is not None and tile[:2] == (step, i):
                    feats[0, tile[2]] = float("nan")
                loss = loss_fn(model(feats, mask), label) / accum
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    return model


def one_patch_biopsy(step: int, i: int):
    return 1 if (step, i) == (2, 2) else None


@pytest.mark.filterwarnings("ignore:std\\(\\). degrees of freedom:UserWarning")
def test_single_patch_slide_names_the_unbiased_std_and_its_micro_batch(tmp_path):
    """Slide by slide with gradient accumulation, per-slide standardisation by torch's
    unbiased std: a biopsy of one patch has n - 1 = 0 degrees of freedom, its std is NaN
    (the eps after it guards nothing). The event and the replay name the third slide of the
    last step (micro-batch 2) and the std."""
    with pytest.raises(NonFiniteError) as info:
        train_slides("make_abmil_slide_norm", tmp_path, one_patch_biopsy)
    ev, bundle = info.value.event, info.value.bundle_path
    assert (ev["step"], ev["phase"], ev["micro_batch"], ev["kind"]) == (2, "forward", 2, "nan")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["micro_batch"], o["module"], o["op"], o["made"]) == (2, "", "aten.std", "nan"), o
    assert o["source"] == line_of("feats.std(1, keepdim=True) + eps"), o
    assert rep["cause"] == "invalid" and "n - correction = 0" in rep["hint"], rep["hint"]
    assert "pass correction=0" in rep["hint"], rep["hint"]


def test_training_set_std_of_zero_names_the_buffer_and_its_feature(tmp_path):
    """Features standardised by the training set's statistics, kept as buffers: a ReLU unit of
    the extractor that never fired on tissue has std 0 there, so the first batch divides by 0
    in every slide. The replay names the division on its line, every sample, the buffer
    ``feat_std`` at entry 11, and says to floor the statistic, not to drop records."""
    ev, bundle = fire("make_standardised", tmp_path, None)
    assert (ev["step"], ev["phase"], ev["kind"], ev["samples"]) == (
        0, "forward", "nan", list(range(8))), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["all_samples"]) == ("", "aten.div", True), o
    assert o["source"] == line_of("feats = (feats - self.feat_mean) / self.feat_std"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "the buffer feat_std as the code keeps it, 0 at entry 11" in rep["hint"], rep["hint"]
    assert "no record is to blame" in rep["hint"] and "clamp_min(eps)" in rep["hint"], rep


def unnormalised_slide(feats, mask, labels, targets):
    """Slide 6's embeddings were saved without the extractor's final normalisation (x40)."""
    feats[6] *= 40.0


def test_discrete_survival_nll_under_bf16_names_the_log_of_a_rounded_survival(tmp_path):
    """The discrete-time survival NLL without its clamp(min=eps), under bfloat16 autocast: an
    out-of-scale slide's hazards round to 1, its survival cumprod(1 - h) to 0, and the log of
    it is -inf (float64 keeps it above 0). The replay names the log in the loss, slide 6, in
    bfloat16, as precision, and points at logsigmoid for log(1 - sigmoid(z))."""
    with pytest.raises(NonFiniteError) as info:
        train("make_discrete", tmp_path, unnormalised_slide, amp=True)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "loss", "nan"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["op"], o["made"], o["samples"]) == ("loss", "aten.log", "-inf", [6]), o
    assert o["source"] == line_of("uncensored = -(1 - c) * (torch.log(S_padded.gather(1, y))"), o
    assert o["chain"][0]["dtype"] == "bfloat16", o["chain"]
    assert rep["cause"] == "precision" and "logsigmoid" in rep["hint"], rep["hint"]
    train("make_discrete", tmp_path / "f32", unnormalised_slide)  # (float32: no event)
    assert not list((tmp_path / "f32").glob("*.nan"))


def slide_loader(ds):
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True, generator=g,
                                       collate_fn=M.collate_bags)


def test_dataloader_of_slide_files_names_the_corrupted_tile_by_keyword(tmp_path):
    """A DataLoader over per-slide feature files, shuffled, padded by its collate_fn into a
    dict given to forward by keyword: slide 13's patch 2 is NaN in its file. The event and the
    replay name the batch and row it landed at (found here by walking the same loader) and
    the element, by the keyword names of the features and the mask."""
    ds = M.SlideBags(corrupt=(13, 2))
    step, row = next((s, int(torch.isnan(b["feats"]).any(2).any(1).nonzero()[0]))
                     for s, b in enumerate(slide_loader(ds)) if torch.isnan(b["feats"]).any())
    model = M.make_abmil()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4, weight_decay=1e-5)
    with pytest.raises(NonFiniteError) as info, FlightRecorder(
            model, opt, loss_fn=ce_loss, out_dir=tmp_path,
            factory="multiple_instance_learning_models:make_abmil") as rec:
        for b in slide_loader(ds):
            loss = rec.loss_fn(model(feats=b["feats"], mask=b["mask"]), b["label"])
            opt.zero_grad()
            loss.backward()
            opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == (
        step, "input", 'kwargs["feats"]', [row]), ev
    rep = nanreplay_json(info.value.bundle_path)
    assert (rep["cause"], rep["origin"]["samples"]) == ("input", [row]), rep["origin"]
    assert f"sample {row} at index 2 of dim 1" in rep["hint"], rep["hint"]
    assert 'real element by kwargs["mask"]' in rep["hint"], rep["hint"]


def test_empty_bag_under_per_bag_standardisation_names_the_mean_over_no_patch(tmp_path):
    """With per-bag standardisation (eps on the std), the empty slide meets the mean first:
    a sum over no patch divided by its patch count, 0/0. The replay names that division,
    slide 3, and says the mask has no entry in that row: filter the record or floor the
    count, not an eps."""
    ev, bundle = fire("make_abmil_norm_eps", tmp_path, empty_slide)
    assert (ev["step"], ev["phase"], ev["kind"], ev["samples"]) == (3, "forward", "nan", [3])
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.div", "nan", [3]), o
    assert o["source"] == line_of("mean = (feats * m).sum(1, keepdim=True) / n"), o
    assert rep["cause"] == "invalid" and "empty records: args[1]" in rep["hint"], rep["hint"]
    assert "count.clamp_min(1)" in rep["hint"] and "drop=3" in rep["hint"], rep["hint"]


def test_attention_entropy_over_padding_names_p_log_p_and_the_padded_slides(tmp_path):
    """An entropy penalty on the attention map, ``-(attn * log(attn)).sum(1)``: the padding's
    attention is exactly 0, so log gives -inf and 0 * -inf is NaN in every slide shorter than
    the longest, at the first step. The replay names the log in the loss, those slides (not
    the longest), and points at xlogy with a clamped argument."""
    _, mask, _ = M.slides(torch.Generator().manual_seed(0))
    padded = torch.nonzero(~mask.all(1)).flatten().tolist()
    ev, bundle = fire("make_abmil_entropy", tmp_path, None)
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "loss", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["op"], o["made"], o["samples"]) == (
        "loss", "aten.log", "-inf", padded), o
    assert padded == [0, 2, 3, 4, 5, 6], padded
    assert o["source"] == line_of("entropy = -(attn * torch.log(attn)).sum(1)"), o
    assert rep["cause"] == "invalid" and "0 * -inf is NaN" in rep["hint"], rep["hint"]
    assert "torch.special.xlogy(p, p.clamp_min(tiny))" in rep["hint"], rep["hint"]


def test_slide_by_slide_accumulation_raises_nothing_and_trains_the_same(tmp_path):
    """CLAM's batch-size-1 loop with four slides' gradients accumulated per step and
    per-slide standardisation, every slide of 5 patches or more: no event, bit-identical
    weights with and without the recorder."""
    recorded = train_slides("make_abmil_slide_norm", tmp_path)
    plain = train_slides("make_abmil_slide_norm", tmp_path, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_corrupted_tile_of_an_unpadded_slide_is_named_as_an_element(tmp_path):
    """Slide by slide (batch size 1, a mask of True only): patch 3 of the third slide of the
    last step is NaN. The event and the replay name micro-batch 2 and that patch as a real
    element of the bag by the boolean mask, not a channel's standardisation."""
    with pytest.raises(NonFiniteError) as info:
        train_slides("make_abmil", tmp_path, tile=(2, 2, 3))
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["micro_batch"], ev["tensor"]) == (
        2, "input", 2, "args[0]"), ev
    rep = nanreplay_json(info.value.bundle_path)
    assert (rep["cause"], rep["origin"]["micro_batch"]) == ("input", 2), rep["origin"]
    hint = rep["hint"]
    assert "sample 0 at index 3 of dim 1" in hint and "real element by args[1]" in hint, hint
    assert "standardisation of each channel" not in hint, hint

"""End to end on regulatory-genomics sequence-to-function models
(``regulatory_genomics_models``): BPNet (dilated residual convs, a profile head under the
multinomial NLL of the reads normalised by their total, a count head on ``log(1 + total)``)
trained with reverse-complement augmentation, gradient clipping and accumulation from a
DataLoader; Basenji's binned coverage under a Poisson NLL on softplus rates under bf16
autocast; a bias-factorised ChromBPNet in float16 whose frozen bias model adds its logits.
Each planted failure of the domain fires under the recorder and is replayed with the CLI; the
healthy versions raise no event and train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import pytest
import regulatory_genomics_models as M
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("regulatory_genomics_models.py", text)


def bpnet_batches(bad: dict, steps: int, n: int = 8) -> DataLoader:
    """Peak regions from a DataLoader, the data condition ``bad`` (keywords of ``peak_batch``)
    in the last batch."""
    g = torch.Generator().manual_seed(0)
    parts = [M.peak_batch(g, n, **(bad if step == steps - 1 else {})) for step in range(steps)]
    data = TensorDataset(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
    return DataLoader(data, batch_size=n, shuffle=False)


def train_bpnet(make: str, crit, out_dir, bad: dict | None = None, steps: int = 4,
                weights: bool = False, record: bool = True, accumulate: int = 1,
                augment: bool = True):
    """Adam with a one-cycle schedule and gradient clipping, as BPNet trains; a batch's
    reverse complement added to it (``augment``); ``weights``: per-track weights, the inverse
    of each track's mean coverage in the batch, handed to the loss."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=4e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=4e-3, total_steps=steps)
    torch.manual_seed(1)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"regulatory_genomics_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for seq, counts in bpnet_batches(bad or {}, steps):
            opt.zero_grad()
            for part in range(accumulate):  # micro-batches of the region batch
                s, c = seq[part::accumulate], counts[part::accumulate]
                if augment:  # (the strands swap: a track's weight would be the other's)
                    rs, rc = M.reverse_complement(s, c)
                    s, c = torch.cat([s, rs]), torch.cat([c, rc])
                extra = (1 / c.mean((0, 2)),) if weights else ()
                (loss_fn(model(s), c, *extra) / accumulate).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    return model


def fire(*args, **kwargs):
    with pytest.raises(NonFiniteError) as info:
        train_bpnet(*args, **kwargs)
    return info.value.event, info.value.bundle_path


def origin_of(rep: dict) -> tuple:
    o = rep["origin"]
    return rep["reproduced"], o["phase"], o["module"], o["op"], o["made"], o["samples"]


def test_region_with_no_read_in_a_track_names_the_profile_normalisation_and_a_floored_total(
        tmp_path):
    """Region 3 of the last batch has no read in track 1: its profile, counts over their
    total, is 0/0. The replay names the division on its line at that region (and its reverse
    complement, row 11) and, since the counts are whole numbers, says a region with no read is
    an ordinary record and to floor the total (clamp_min(1)), not to drop it."""
    ev, bundle = fire("make_bpnet", M.BPNetLoss(floor=0.0), tmp_path, bad={"empty": (3, 1)})
    assert (ev["step"], ev["phase"]) == (3, "loss"), ev
    rep = nanreplay_json(bundle)
    assert origin_of(rep) == (True, "loss", "<loss>", "aten.div", "nan", [3, 11]), rep["origin"]
    assert rep["origin"]["source"] == line_of("profile = counts / (total.clamp_min"), rep["origin"]
    assert rep["cause"] == "invalid", rep
    assert "total.clamp_min(1)" in rep["hint"] and "ordinary record" in rep["hint"], rep["hint"]
    assert "an eps there would train toward a made-up target" not in rep["hint"], rep["hint"]


def test_log_of_a_total_of_zero_without_the_pseudo_count_says_log1p(tmp_path):
    """The count head's target written ``log(total)``: region 5 with no read in track 0 makes
    -inf. The replay names the log at that region and advises log1p, not dropping it."""
    ev, bundle = fire("make_bpnet", M.BPNetLoss(log1p=False), tmp_path, bad={"empty": (5, 0)})
    assert (ev["step"], ev["phase"]) == (3, "loss"), ev
    rep = nanreplay_json(bundle)
    assert origin_of(rep) == (True, "loss", "<loss>", "aten.log", "-inf", [5, 13]), rep["origin"]
    assert rep["origin"]["source"] == line_of("else torch.log(total)"), rep["origin"]
    assert rep["cause"] == "invalid", rep
    assert "torch.log1p(count)" in rep["hint"] and "don't drop it" in rep["hint"], rep["hint"]


def test_n_bases_reaching_the_per_position_normalisation_name_the_division_at_that_region(
        tmp_path):
    """A region with a run of N bases (all-zero one-hot columns) reaches the model's rescaling
    of each position's base channels to sum to 1: 0/0 in the root module's own forward at that
    region and its reverse complement, inputs finite, an eps or skipping such rows."""
    ev, bundle = fire("make_bpnet_pwm", M.BPNetLoss(), tmp_path, bad={"n_run": 2})
    assert (ev["step"], ev["phase"]) == (3, "forward"), ev
    rep = nanreplay_json(bundle)
    assert origin_of(rep) == (True, "forward", "", "aten.div", "nan", [2, 10]), rep["origin"]
    assert rep["origin"]["source"] == line_of("seq = seq / seq.sum(1, keepdim=True)")
    assert rep["cause"] == "invalid", rep
    assert "add an eps to the denominator" in rep["hint"], rep["hint"]


def test_track_weight_of_an_empty_track_is_named_as_a_weight_argument_no_sample_owns(tmp_path):
    """A track with no read in any region of the batch (a failed replicate): its weight
    ``1 / mean coverage`` is +inf and the weighted loss is infinite. The recorder stops at the
    loss's argument; the replay names its index, blames no sample, and says to make the
    weight finite where it is made (a floored count, a weight of 0)."""
    ev, bundle = fire("make_bpnet", M.BPNetLoss(), tmp_path, bad={"empty_track": 1},
                      weights=True, augment=False)
    assert (ev["step"], ev["phase"], ev["tensor"]) == (3, "input", "loss_args[2]"), ev
    rep = nanreplay_json(bundle)
    assert origin_of(rep)[:2] == (True, "input"), rep["origin"]
    assert rep["origin"]["samples"] == [], rep["origin"]
    assert rep["cause"] == "input", rep
    assert "index 1 of its 2 values" in rep["hint"] and "clamp_min(1)" in rep["hint"], rep["hint"]


def test_blacklisted_positions_masked_with_minus_inf_times_zero_reads_name_the_product(
        tmp_path):
    """Unmappable positions' logits filled with -inf before log_softmax, and the NLL written
    ``counts * logp`` over every position: their 0 reads times -inf is NaN from the first step.
    The replay names that product (the -inf fill as intentional) and says to leave the masked
    entries out of it or fill with a finite number; zeroing them after log_softmax trains."""
    with pytest.raises(NonFiniteError) as info:
        train_masked(M.MaskedBPNetLoss(zero_masked=False), tmp_path)
    assert (info.value.event["step"], info.value.event["phase"]) == (0, "loss")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], len(o["samples"])) == (
        "<loss>", "aten.mul", "nan", 8), o
    assert o["source"] == line_of("nll = -(counts * logp).sum(-1)"), o
    assert rep["cause"] == "invalid", rep
    assert "torch.finfo(dtype).min" in rep["hint"] and "leave the masked" in rep["hint"]
    train_masked(M.MaskedBPNetLoss(zero_masked=True), tmp_path / "ok")


def train_masked(crit, out_dir, steps: int = 3):
    model = M.make_bpnet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
    g = torch.Generator().manual_seed(0)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                        factory="regulatory_genomics_models:make_bpnet") as rec:
        for _ in range(steps):
            seq, counts = M.peak_batch(g)
            mask = M.unmappable_mask(len(seq))
            loss = rec.loss_fn(model(seq), counts.masked_fill(mask, 0), mask)
            opt.zero_grad()
            loss.backward()
            opt.step()


def train_basenji(make: str, crit, out_dir, steps: int = 3, record: bool = True):
    """AdamW under bf16 autocast (the loss in float32), as Basenji/Enformer train."""
    model = getattr(M, make)()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"regulatory_genomics_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for _ in range(steps):
            seq, cov = M.coverage_batch(g)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                rate = model(seq)
            loss = loss_fn(rate.float(), cov)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model


def test_poisson_nll_of_a_softplus_rate_that_underflowed_names_the_log_and_an_eps(tmp_path):
    """A checkpoint whose head drove one track's softplus rate below float32's range (the
    Poisson loss keeps lowering a rate whose target is 0): the hand-written Poisson NLL's
    ``log(rate)`` without an eps is -inf in every region. The replay names the log, the
    underflow, and a clamp before the log; F.poisson_nll_loss's eps trains."""
    with pytest.raises(NonFiniteError) as info:
        train_basenji("make_basenji_drifted", M.poisson_nll, tmp_path)
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (info.value.event["step"], o["module"], o["op"], o["made"], o["samples"]) == (
        0, "<loss>", "aten.log", "-inf", list(range(8))), o
    assert o["source"] == line_of("return (rate - target * torch.log(rate)).mean()"), o
    assert rep["cause"] == "underflow", rep
    assert "was rounded to 0" in rep["hint"] and "clamp_min(eps)" in rep["hint"], rep["hint"]
    train_basenji("make_basenji_drifted", M.poisson_nll_eps, tmp_path / "ok")


def test_float16_profile_written_with_exp_over_sum_names_the_overflow_and_log_softmax(
        tmp_path):
    """A bias-factorised ChromBPNet in float16 whose frozen bias model's logits drifted to an
    offset of 12 (log_softmax never sees it): the profile loss written ``exp / sum`` overflows
    float16 at once. The replay names exp in the loss, an overflow, and log_softmax."""
    model = M.make_chrombpnet()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3,
                          momentum=0.9)
    seq, counts = M.peak_batch(torch.Generator().manual_seed(0))
    with pytest.raises(NonFiniteError) as info, FlightRecorder(
            model, opt, loss_fn=M.chrombpnet_loss, out_dir=tmp_path,
            factory="regulatory_genomics_models:make_chrombpnet") as rec:
        loss = rec.loss_fn(model(seq.half()), counts.half())
        opt.zero_grad()
        loss.backward()
        opt.step()
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], len(o["samples"])) == (
        "<loss>", "aten.exp", "+inf", 8), o
    assert o["source"] == line_of("e = torch.exp(logits)"), o
    assert rep["cause"] == "overflow", rep
    assert "float16" in rep["hint"] and "log_softmax" in rep["hint"], rep["hint"]


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values()))


def test_healthy_bpnet_with_accumulation_trains_bit_identically_with_and_without_the_recorder(
        tmp_path):
    """Regions with no read in a track under the floored total and log1p, reverse-complement
    augmentation, two micro-batches a step: no event, and the recorder changes nothing."""
    bad = {"empty": (3, 1)}
    kw = {"bad": bad, "steps": 5, "accumulate": 2}
    recorded = train_bpnet("make_bpnet", M.BPNetLoss(), tmp_path, **kw)
    plain = train_bpnet("make_bpnet", M.BPNetLoss(), tmp_path, record=False, **kw)
    assert same_weights(recorded, plain)
    assert not list(tmp_path.glob("*.nan"))


def test_healthy_basenji_under_bf16_trains_bit_identically_with_and_without_the_recorder(
        tmp_path):
    recorded = train_basenji("make_basenji", M.poisson_nll_eps, tmp_path)
    plain = train_basenji("make_basenji", M.poisson_nll_eps, tmp_path, record=False)
    assert same_weights(recorded, plain)
    assert not list(tmp_path.glob("*.nan"))


def test_zero_coverage_region_in_the_second_micro_batch_is_named_there(tmp_path):
    """Under two micro-batches (rows 0::2 and 1::2, each with its reverse complement), region
    3 of the batch is row 1 of micro-batch 1, and row 5 its reverse complement."""
    ev, bundle = fire("make_bpnet", M.BPNetLoss(floor=0.0), tmp_path, bad={"empty": (3, 1)},
                      accumulate=2)
    assert (ev["step"], ev["phase"], ev["micro_batch"]) == (3, "loss", 1), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["micro_batch"], o["op"], o["samples"], o["batch_size"]) == (
        1, "aten.div", [1, 5], 8), o
    assert "total.clamp_min(1)" in rep["hint"], rep["hint"]


def test_counts_advice_is_only_for_whole_counts_over_their_own_total():
    """The count advice needs whole numbers >= 0 with some above 1 (not a 0/1 mask, not
    fractions) and, for a quotient, a divisor that is the dividend's own sum over a dim."""
    from replay import data_counts

    counts = torch.tensor([[0.0, 0.0, 0.0], [2.0, 0.0, 3.0]])
    total = counts.sum(-1, keepdim=True)
    assert data_counts.marked("aten.log", [total]) == data_counts.LOG
    assert data_counts.marked("aten.div.Tensor", [counts, total]) == data_counts.NORMALISED
    assert data_counts.marked("aten.log", [total / 7]) == ""  # (fractions)
    assert data_counts.marked("aten.log", [(counts > 0).float()]) == ""  # (a 0/1 mask)
    other = torch.tensor([[0.0], [4.0]])  # (a box's area over another's: not its own total)
    assert data_counts.marked("aten.div.Tensor", [counts, other]) == ""
    assert data_counts.marked("aten.sqrt", [total]) == ""


def test_poisson_nll_loss_with_its_eps_set_to_zero_names_the_eps(tmp_path):
    """The same underflowed rate through ``F.poisson_nll_loss(..., log_input=False, eps=0)``:
    the replay names the log inside it and says the eps added is exactly 0."""
    with pytest.raises(NonFiniteError) as info:
        train_basenji("make_basenji_drifted", M.poisson_nll_no_eps, tmp_path)
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], len(o["samples"])) == (
        "<loss>", "aten.log", "-inf", 8), o
    assert o["source"] == line_of("log_input=False, eps=0.0)"), o
    assert rep["cause"] == "underflow", rep
    assert "the eps added to that input is exactly 0" in rep["hint"], rep["hint"]


def test_healthy_float32_chrombpnet_with_a_frozen_bias_model_trains_bit_identically(tmp_path):
    """The bias model frozen (its logits' offset of 12 harmless under log_softmax), the main
    model trained with reverse-complement augmentation: no event, nothing changed."""
    recorded = train_bpnet("make_chrombpnet_fp32", M.BPNetLoss(), tmp_path, steps=3)
    plain = train_bpnet("make_chrombpnet_fp32", M.BPNetLoss(), tmp_path, steps=3, record=False)
    assert same_weights(recorded, plain)
    assert not list(tmp_path.glob("*.nan"))

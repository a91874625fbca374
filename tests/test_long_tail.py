"""End to end on long-tailed and multi-label recognition (``long_tail_models``): the
class-balanced loss's effective number, LDAM's margins, balanced softmax / logit adjustment,
focal loss on a cosine classifier, ASL under bfloat16 autocast, BCEWithLogitsLoss's
``pos_weight`` from label counts, cRT's tau-normalised classifier, mixup, and class-aware
sampling through ``WeightedRandomSampler`` in a DataLoader with workers. Each planted bug of
the domain fires under the recorder and is replayed with the CLI; the healthy versions raise
no event and train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import long_tail_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

ALL = list(range(32))


def line_of(text: str) -> str:
    return source_line("long_tail_models.py", text)


def long_tail_loader(counts: torch.Tensor | None = None):
    """The long-tailed training split (100 records of the head class down to 1 of the tail),
    shuffled in batches of 32."""
    x, y = M.long_tail_data(M.class_counts() if counts is None else counts)
    return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True,
                      generator=torch.Generator().manual_seed(0))


def multilabel_loader(absent=(), scale: float = 1.0, repeat: int = 1):
    x, y = M.multilabel_data(absent=absent)
    return list(DataLoader(TensorDataset(scale * x, y), batch_size=32)) * repeat


def train(make: str, crit, out_dir, data, record: bool = True, adam_eps: float | None = None,
          bf16: bool = False, mix: float | None = None, clip: float | None = 5.0, watch=None):
    """SGD with momentum and gradient clipping (or Adam with ``adam_eps``), the model under
    bfloat16 autocast where ``bf16``, mixup with ``Beta(mix, mix)`` where ``mix``; ``crit`` is
    called as ``crit(out, y)``; ``watch(step, out, loss)``, where given, sees each step's
    output and loss before the backward. Returns the model."""
    model = getattr(M, make)()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9) if adam_eps is None else \
        torch.optim.Adam(params, lr=1e-2, eps=adam_eps)
    torch.manual_seed(1)  # (mixup's Beta)
    gen = torch.Generator().manual_seed(2)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"long_tail_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step, (x, y) in enumerate(data):
            if mix is not None:
                x, y_a, y_b, lam = M.mixup(x, y, mix, gen)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                out = model(x)
            if mix is not None:
                loss = M.mixup_criterion(loss_fn, out, y_a, y_b, lam)
            else:
                loss = loss_fn(out, y)
            if watch is not None:
                watch(step, out, loss)
            opt.zero_grad()
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(params, clip)
            opt.step()
    return model


def fire(make: str, crit, tmp_path, data, code: int = 0, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(make, crit, tmp_path, data, **kw)
    return info.value.event, nanreplay_json(info.value.bundle_path, code=code)


def test_class_balanced_weight_of_an_absent_class_names_the_effective_number(tmp_path):
    """Cui et al.'s weights ``(1 - beta) / (1 - beta**n)`` over counts where the rarest class
    has no record in the training split: ``1 - beta**0 = 0``, its weight 1/0, the normalised
    weights inf/inf. A loss event at the first step; the replay names the reciprocal on the
    weights' line, no samples, invalid, the counts buffer's entry 5 and the floor."""
    ev, rep = fire("make_net", M.ClassBalancedLoss(M.class_counts(absent=(5,))), tmp_path,
                   long_tail_loader())
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "loss", "<loss>", "nan")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "<loss>", "aten.reciprocal", "+inf", []), o
    assert o["source"] == line_of("weights = (1.0 - self.beta) / effective_num"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "buffer <loss>.counts alone" in rep["hint"] and "entry 5" in rep["hint"] \
        and "counts.clamp_min(1)" in rep["hint"], rep["hint"]


def test_ldam_margin_of_an_absent_class_names_the_margins_buffer(tmp_path):
    """LDAM's margins ``n**-0.25`` scaled by ``max_m / max(m)``: a class of count 0 has an
    infinite margin and the scaling makes it inf * 0 = NaN when the loss is built. The replay
    says the loss's ``m_list`` held NaN at index 5 as the step began: made before the step,
    where the counts are."""
    ev, rep = fire("make_net", M.LDAMLoss(M.class_counts(absent=(5,))), tmp_path,
                   long_tail_loader())
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "loss", "<loss>"), ev
    o = rep["origin"]
    assert (o["module"], o["made"], o["samples"]) == ("<loss>", "nan", []), o
    assert o["source"] == line_of("batch_m = self.m_list[None, :] @ index.float().t()"), o
    assert rep["cause"] == "weights", rep["cause"]
    assert "'m_list' holding nan at index 5, as the step began" in rep["hint"] and \
        "count.clamp_min(1)" in rep["hint"], rep["hint"]


def test_drw_weights_of_an_absent_class_name_the_plain_weight_attribute(tmp_path):
    """LDAM-DRW's deferred re-weighting computed in numpy over counts with a class of 0
    (numpy warns of the 1/0 and the 0/0 and goes on): 1/0 then inf/inf, the weights [0, ..., 0, nan], kept as the
    loss's plain ``self.weight`` attribute (no buffer) and given to ``F.cross_entropy``. The
    replay re-runs it and names the NLL taking the loss's 'weight', NaN at index 5, made
    before the step."""
    with pytest.warns(RuntimeWarning, match="encountered in divide"):
        weight = M.drw_weights(M.class_counts(absent=(5,)))
    ev, rep = fire("make_net", M.LDAMLoss(M.class_counts(), weight=weight), tmp_path,
                   long_tail_loader())
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "loss", "<loss>", "nan")
    o = rep["origin"]
    assert (rep["reproduced"], o["op"], o["made"], o["samples"]) == (
        True, "aten.nll_loss_forward", "nan", []), o
    assert o["source"] == line_of("return F.cross_entropy(self.s * output, target, weight="), o
    assert rep["cause"] == "weights", rep["cause"]
    assert "'weight' holding nan at index 5, as the step began" in rep["hint"], rep["hint"]


def test_balanced_softmax_prior_of_an_absent_class_names_the_prior_buffer(tmp_path):
    """Balanced softmax's ``logits + log(prior)`` with a class absent from the training split:
    ``log 0 = -inf`` in that class's column of every row, which label smoothing takes into
    every sample's loss (+inf at the first step). The replay names the log on the prior's
    line, no samples, invalid, and says the -inf is exactly where the loss's ``prior`` buffer
    is 0 (entry 5) and to smooth the counts, not a parametrisation's pole."""
    crit = M.BalancedSoftmax(M.class_counts(absent=(5,)), label_smoothing=0.1)
    ev, rep = fire("make_net", crit, tmp_path, long_tail_loader())
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "loss", "<loss>", "+inf")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "<loss>", "aten.log", "-inf", []), o
    assert o["source"] == line_of("adjusted = logits + self.tau * torch.log(self.prior)"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert rep["hint"].startswith("aten.log of 0: its input is the buffer <loss>.prior as the "
                                  "code keeps it, 0 at entry 5 of its shape (6,)"), rep["hint"]
    assert "(counts + 1) / (counts.sum() + C)" in rep["hint"], rep["hint"]
    assert "parametrisation" not in rep["hint"], rep["hint"]


def test_logit_adjustment_in_the_model_head_names_the_models_prior_buffer(tmp_path):
    """The same log of a zero prior inside the model's ``forward`` (a training-time logit
    adjustment in the head): a forward event in the root module at step 0, every row's logit
    of class 5 -inf. The replay names the log on the head's line and the model's ``prior``
    buffer at entry 5."""
    ev, rep = fire("make_adjusted_net", torch.nn.CrossEntropyLoss(label_smoothing=0.1),
                   tmp_path, long_tail_loader())
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "forward", "", "-inf")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.log", "-inf", ALL), o
    assert o["source"] == line_of("return super().forward(x) + self.tau * torch.log(self.prior)")
    assert rep["cause"] == "invalid", rep["cause"]
    assert rep["hint"].startswith("aten.log of 0: its input is the buffer prior as the code "
                                  "keeps it, 0 at entry 5 of its shape (6,)"), rep["hint"]


def test_adam_without_eps_names_the_rows_of_the_class_no_loss_reaches(tmp_path):
    """The same absent class without smoothing: its logit's -inf adjustment leaves its
    classifier row a gradient of exactly 0, and Adam with ``eps=0`` divides ``0 / sqrt(0)``.
    An optimizer event at step 0; the replay names eps and row 5 of classifier.weight."""
    ev, rep = fire("make_net", M.BalancedSoftmax(M.class_counts(absent=(5,))), tmp_path,
                   long_tail_loader(), code=1, adam_eps=0.0)
    assert (ev["step"], ev["phase"], ev["params"][0]) == (0, "optimizer", "classifier.weight")
    assert (rep["cause"], rep["reproduced"]) == ("optimizer", False), rep["cause"]
    assert "set eps > 0" in rep["hint"] and "row(s) 5 of 6 of classifier.weight" in \
        rep["hint"] and "a class no label names" in rep["hint"], rep["hint"]


def test_focal_gamma_below_one_on_a_cosine_classifier_names_the_pow_gradient(tmp_path):
    """Focal loss with ``gamma = 0.5`` on a cosine classifier of scale 64: confident records'
    CE rounds to 0, ``1 - p_t`` is exactly 0 and ``0.5 * 0**-0.5`` is inf in backward (the
    forward stays finite) at step 2. The replay names PowBackward0 on the focal line, the
    rows whose p_t rounded to 1, precision, and the floor of the base."""
    ev, rep = fire("make_cosine_net", M.FocalLoss(gamma=0.5), tmp_path,
                   list(long_tail_loader()) * 2)
    assert (ev["step"], ev["phase"], ev["kind"]) == (2, "backward", "nan"), ev
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"]) == ("backward", "<loss>", "PowBackward0"), o
    # (the rows whose CE is exactly 0 at step 2, counted without the recorder)
    assert o["samples"] == [0, 1, 2, 3, 6, 7, 8, 11, 12, 14, 15, 16, 17, 22, 24, 25, 31], o
    assert o["source"] == line_of("loss = self.alpha * (1 - p_t) ** self.gamma * ce"), o
    assert rep["cause"] == "precision", rep["cause"]
    assert "focal loss's (1 - p) ** gamma with gamma < 1" in rep["hint"], rep["hint"]


class Saturated(Exception):
    """Raised by ``first_bf16_saturated_sigmoid``'s watch at the first non-finite loss."""


def first_bf16_saturated_sigmoid(data, tmp_path) -> tuple[int, list[int]]:
    """(step, rows) of ASL without eps trained under bfloat16 autocast without the recorder
    (the same ``train``): the first step whose loss is non-finite, and the rows holding a
    bfloat16 sigmoid of exactly 0 there. The step follows the CPU's rounding (step 22, row
    0 on an AMD EPYC with its vectorised kernels; step 26, row 9 with
    ``ATEN_CPU_CAPABILITY=default``)."""
    def watch(step, out, loss):
        assert torch.isfinite(out).all(), step  # (the output stays finite: the loss starts it)
        if not torch.isfinite(loss):
            zero = torch.sigmoid(out) == 0
            raise Saturated(step, zero.any(1).nonzero().flatten().tolist())

    with pytest.raises(Saturated) as info:
        train("make_net", M.AsymmetricLoss(eps=None), tmp_path, data, record=False,
              bf16=True, clip=None, watch=watch)
    return info.value.args


def test_asl_without_eps_under_bf16_names_the_log_of_the_saturated_sigmoid(tmp_path):
    """ASL without its ``clamp(min=eps)`` on the model's bfloat16 logits: a confident negative
    label's sigmoid underflows and ``log`` of it is -inf after some 20 steps (then times
    ``y = 0``: NaN; the step and the rows found without the recorder). The replay names the
    log on ASL's positive line, those records, underflow, and the clamp or a log-space form."""
    data = multilabel_loader(scale=8.0, repeat=10)
    step, rows = first_bf16_saturated_sigmoid(data, tmp_path / "plain")
    assert step >= 4 and rows, (step, rows)  # (past the first epoch's 4 batches)
    ev, rep = fire("make_net", M.AsymmetricLoss(eps=None), tmp_path, data, bf16=True,
                   clip=None)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (
        step, "loss", "<loss>", "nan")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "<loss>", "aten.log", "-inf", rows), o
    assert o["source"] == line_of("los_pos = y * torch.log(xs_pos)"), o
    assert rep["cause"] == "underflow", rep["cause"]
    assert "clamp_min(eps)" in rep["hint"] and "logsigmoid" in rep["hint"], rep["hint"]


def asl_fp16_loop(data, model, opt, scaler, loss_fn):
    """Yields each step's (model output, loss) of ASL's training under float16 autocast with
    a GradScaler (SGD with momentum), the loop the test records."""
    for x, y in data:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
            loss = loss_fn(out, y)
        yield out, loss
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def asl_fp16_setup():
    model = M.make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, opt, torch.amp.GradScaler("cpu")


def first_saturated_sigmoid(data) -> tuple[int, list[int]]:
    """(step, rows) of the same training without the recorder: the first step whose loss is
    non-finite, and the rows holding a float16 sigmoid of exactly 0 there. Where the
    trajectory first saturates a sigmoid depends on the CPU's rounding (step 33 on an Intel
    Xeon; 28 or 32 on an AMD EPYC by ``ATEN_CPU_CAPABILITY``)."""
    model, opt, scaler = asl_fp16_setup()
    crit = M.AsymmetricLoss()
    for step, (out, loss) in enumerate(asl_fp16_loop(data, model, opt, scaler, crit)):
        assert torch.isfinite(out).all(), step  # (the output stays finite: the loss starts it)
        if not torch.isfinite(loss):
            zero = torch.sigmoid(out) == 0
            return step, zero.any(1).nonzero().flatten().tolist()
    raise AssertionError("no non-finite loss")


def test_asl_default_eps_under_fp16_and_a_grad_scaler_names_the_lost_eps(tmp_path):
    """ASL as shipped (``eps=1e-8``) trained under float16 autocast with a GradScaler: the
    clamp's 1e-8 is 0 in float16, so the saturated sigmoids of confident negatives stay 0 and
    their log is -inf, after some 30 steps (the step and the rows found without the recorder).
    The replay names the log, those rows, underflow, and the eps float16 rounds to 0."""
    data = multilabel_loader(scale=8.0, repeat=10)
    step, rows = first_saturated_sigmoid(data)
    assert step >= 4 and rows, (step, rows)  # (past the first epoch's 4 batches)
    model, opt, scaler = asl_fp16_setup()
    with pytest.raises(NonFiniteError) as info, FlightRecorder(
            model, opt, loss_fn=M.AsymmetricLoss(), out_dir=tmp_path, scaler=scaler,
            factory="long_tail_models:make_net") as rec:
        for _ in asl_fp16_loop(data, model, opt, scaler, rec.loss_fn):
            pass
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (step, "loss", "<loss>", "nan")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"]) == ("aten.log", "-inf", rows)
    assert o["source"] == line_of("los_pos = y * torch.log(xs_pos)"), o
    assert rep["cause"] == "underflow", rep["cause"]
    assert "the eps 1e-08 added to that input is 0 in float16" in rep["hint"], rep["hint"]


def test_cb_sigmoid_focal_over_a_batch_without_positives_names_the_normaliser(tmp_path):
    """The class-balanced sigmoid focal loss normalised by ``torch.sum(labels)``, in batches
    of two high-resolution records: records 10 and 11 carry no label, so batch 5 has no
    positive and the loss is x/0 = +inf. The replay names the division on the return line,
    no rows, invalid, a 0-d count of 0 in this step and its floor."""
    x, y = M.multilabel_data()
    data = list(DataLoader(TensorDataset(x, y), batch_size=2))
    assert [i for i, (_, b) in enumerate(data) if b.sum() == 0][0] == 5
    ev, rep = fire("make_net", M.CBFocalSigmoid(torch.ones(M.CLASSES)), tmp_path, data)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (5, "loss", "<loss>", "+inf")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("<loss>", "aten.div", "+inf", []), o
    assert o["source"] == line_of("return torch.sum(weighted) / torch.sum(labels)"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "0 in this step" in rep["hint"] and "count.clamp_min(1)" in rep["hint"], rep["hint"]


def test_pos_weight_of_a_label_without_positives_names_the_loss_buffer(tmp_path):
    """BCEWithLogitsLoss's ``pos_weight = negatives / positives`` over a split where one label
    has no positive: inf, times its target 0 inside the loss: NaN at the first step. The
    replay names the fused BCE op, every row, and the loss's pos_weight made before the step."""
    x, y = M.multilabel_data(absent=(5,))
    crit = torch.nn.BCEWithLogitsLoss(pos_weight=M.pos_weight_from_counts(y.sum(0), len(y)))
    ev, rep = fire("make_net", crit, tmp_path, multilabel_loader(absent=(5,)))
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "loss", "<loss>", "nan")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "<loss>", "aten.binary_cross_entropy_with_logits", "nan", ALL), o
    assert rep["cause"] == "weights", rep["cause"]
    assert "'pos_weight' holding inf at index 5" in rep["hint"], rep["hint"]


def test_crt_zero_initialised_tau_norm_classifier_names_the_division(tmp_path):
    """cRT re-trains a classifier re-initialised to 0 on the frozen backbone; tau-normalising
    its rows divides 0 by ``||0||**tau = 0``. A forward event in ``classifier`` at step 0; the
    replay names the division on the tau-norm line, every sample, invalid, and the parameter
    0 everywhere: its initialisation (it said 'a parametrisation reached the op's pole')."""
    ev, rep = fire("make_taunorm_zero", torch.nn.CrossEntropyLoss(), tmp_path,
                   long_tail_loader())
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "forward", "classifier"), ev
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "classifier", "aten.div", "nan", ALL), o
    assert o["source"] == line_of("w = self.weight / torch.pow(norms, self.tau)"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert rep["hint"].startswith("aten.div of 0 by 0 (0/0) in every entry: the parameter "
                                  "classifier.weight is 0 everywhere as this step began"), \
        rep["hint"]
    assert "initialise it nonzero" in rep["hint"] and "parametrisation" not in rep["hint"]


def test_class_aware_sampler_repeats_a_corrupt_tail_record_named_as_one_record(tmp_path):
    """A tail-class record (index 161) decoded to NaN in one feature; the class-aware
    ``WeightedRandomSampler`` (replacement, weights 1/count) draws it three times into the
    first batch of a DataLoader with two workers. The replay says input, the three rows, and
    that they are copies of one record the sampler repeated, not a value computed per group
    of records (the same feature 0 in all three is the record's own)."""
    x, y = M.long_tail_data(M.class_counts())
    ds = M.LongTailSet(x, y, corrupt=161)
    sampler = WeightedRandomSampler(ds.sample_weights(), num_samples=len(ds),
                                    generator=torch.Generator().manual_seed(0))
    data = DataLoader(ds, batch_size=32, sampler=sampler, num_workers=2)
    order = list(WeightedRandomSampler(ds.sample_weights(), num_samples=len(ds),
                                       generator=torch.Generator().manual_seed(0)))[:32]
    rows = [i for i, r in enumerate(order) if r == 161]
    with pytest.raises(NonFiniteError) as info:
        train("make_net", torch.nn.CrossEntropyLoss(), tmp_path, data)
    del data
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["samples"]) == (0, "input", rows) == (
        0, "input", [5, 19, 30]), ev
    rep = nanreplay_json(info.value.bundle_path)
    assert (rep["cause"], rep["origin"]["samples"]) == ("input", rows), rep["origin"]
    assert "copies of one record: samples 5, 19, 30 (3 copies)" in rep["hint"] and \
        "entry 3 of 16" in rep["hint"] and "WeightedRandomSampler" in rep["hint"], rep["hint"]
    assert "per group" not in rep["hint"], rep["hint"]


HEALTHY = [
    ("make_net", lambda: M.ClassBalancedLoss(M.class_counts()), {}),
    ("make_net", lambda: M.LDAMLoss(M.class_counts()), {}),
    ("make_net", lambda: M.BalancedSoftmax(M.class_counts(), label_smoothing=0.1),
     {"mix": 0.2}),
    ("make_cosine_net", lambda: M.FocalLoss(gamma=2.0), {}),
    ("make_taunorm", lambda: torch.nn.CrossEntropyLoss(), {"adam_eps": 1e-8}),
    ("make_net", lambda: M.AsymmetricLoss(), {"bf16": True}),
    ("make_net", lambda: M.CBFocalSigmoid(torch.ones(M.CLASSES)), {}),
]


@pytest.mark.parametrize("make,crit,kw", HEALTHY,
                         ids=["cb", "ldam", "balanced_mixup", "focal", "crt", "asl",
                              "cb_focal_sigmoid"])
def test_healthy_long_tail_losses_raise_nothing_and_train_the_same(tmp_path, make, crit, kw):
    """Every class counted, gamma = 2, ASL with its eps, cRT from a random classifier, mixup:
    no event, bit-identical weights with and without the recorder."""
    multi = isinstance(crit(), (M.AsymmetricLoss, M.CBFocalSigmoid))
    data = multilabel_loader(scale=8.0, repeat=3) if multi else list(long_tail_loader()) * 3
    recorded = train(make, crit(), tmp_path, data, **kw)
    plain = train(make, crit(), tmp_path, data, record=False, **kw)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name

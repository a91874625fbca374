"""End to end on network intrusion detection over flow records (``intrusion_detection_models``):
CIC-IDS-style flows from a ``DataLoader`` with a ``WeightedRandomSampler``, mixup between flows,
a class-balanced focal loss, Adam, clipping. Planted: the CSV's ``bytes / duration`` rate of a
zero-duration flow (inf in the batch), a class absent from the training split (its effective
number ``(1 - beta^0) / (1 - beta)`` is 0), a beta so close to 1 that float32 rounds ``beta^n``
to 1, a column constant over the training split z-scored with ``eps=0``, counts z-scored
without ``log1p`` past float16 under autocast, an autoencoder's anomaly probability whose
sigmoid underflows into a hand-written BCE's log, a GRU's std pooling over a one-packet flow
(NaN in backward only), and Adam with ``eps=0`` on the weights of an ICMP column the split
never fills. Each is replayed with the CLI; the fixed versions raise no event and train
bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import intrusion_detection_models as M
import pytest
import torch
import torch.nn.functional as F
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

B = 16


def line_of(text: str) -> str:
    return source_line("intrusion_detection_models.py", text)


def dataset(steps: int, plant, icmp: bool) -> TensorDataset:
    """``steps * B`` labelled flows (no infiltration), their packets and padding masks;
    ``plant(num, proto, labels, lengths)`` edits them in place before the packets are made."""
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 3, (steps * B,), generator=g)
    num, proto = M.flows(g, y, icmp=icmp)
    lengths = torch.randint(2, M.PKTS + 1, (steps * B,), generator=g)
    if plant is not None:
        plant(num, proto, y, lengths)
    pkts, mask = M.packets(g, steps * B, lengths)
    return TensorDataset(num, proto, y, pkts, mask)


def train(make: str, out_dir, plant=None, kind: str = "det", steps: int = 3,
          record: bool = True, amp: bool = False, eps: float = 1e-8, beta: float = 0.999,
          min_count: float = 1.0, icmp: bool = True, mixup: bool = True):
    """Adam, clipping at 1.0, batches drawn by a class-balanced ``WeightedRandomSampler``;
    ``kind``: ``det`` (the MLP on flow features, with mixup of each flow and a permuted one at
    lam 0.7, the class-balanced focal loss), ``gru`` (the packet GRU, the same loss) or ``ae``
    (the autoencoder's anomaly probability, the BCE against attack/benign). Returns the model."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=eps)
    crit = M.AnomalyBCE() if kind == "ae" else M.ClassBalancedFocal(beta=beta,
                                                                     min_count=min_count)
    ds = dataset(steps, plant, icmp)
    count = torch.bincount(ds.tensors[2], minlength=M.CLASSES).float()
    weights = (1.0 / count.clamp_min(1))[ds.tensors[2]]
    sampler = WeightedRandomSampler(weights, len(weights),
                                    generator=torch.Generator().manual_seed(0))
    loader = DataLoader(ds, batch_size=B, sampler=sampler)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"intrusion_detection_models:{make}") if record else None
    torch.manual_seed(0)
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for num, proto, y, pkts, mask in loader:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
                if kind == "ae":
                    loss = loss_fn(model(num).float(), (y > 0).float())
                else:
                    t = F.one_hot(y, M.CLASSES).float()
                    if mixup:
                        perm = torch.randperm(len(y))
                        num, proto = 0.7 * num + 0.3 * num[perm], 0.7 * proto + 0.3 * proto[perm]
                        t = 0.7 * t + 0.3 * t[perm]
                    out = model(pkts, mask) if kind == "gru" else model(num, proto)
                    loss = loss_fn(out.float(), t)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    return model


def fire(make: str, tmp_path, plant=None, **how):
    with pytest.raises(NonFiniteError) as info:
        train(make, tmp_path, plant, **how)
    return info.value.event, info.value.bundle_path


def zero_duration(num, proto, y, lengths):
    num[2 * B + 5, 5] = float("inf")   # Flow Bytes/s of a zero-duration flow, as exported


def bulk_transfers(num, proto, y, lengths):
    num[2 * B::4, 0] *= 1e5            # backup jobs: fwd bytes in the hundreds of MB
    num[1::4, 5] = num[1::4, :2].sum(1) / 1e-4   # sub-ms flows: rates of 1e8 bytes/s


def one_packet(num, proto, y, lengths):
    lengths[2 * B + 4] = 1             # a flow of a single packet (a SYN with no reply)


def origin(rep):
    o = rep["origin"]
    return (rep["reproduced"], o["phase"], o["module"], o["op"], o["made"], o["samples"])


def test_zero_duration_rate_in_the_csv_is_named_as_the_input(tmp_path):
    """The export's rate of a zero-duration flow is +inf; mixup carries it into a second row:
    the recorder stops at the input of step 1, samples 3 and 4, cause input, and the hint
    names feature 5 of each and a ratio with a denominator of 0 (it said only 'check the data
    pipeline for these samples (bad files, division by zero in normalisation, ...)')."""
    ev, bundle = fire("make_detector", tmp_path, zero_duration)
    assert (ev["step"], ev["phase"], ev["kind"], ev["samples"]) == (1, "input", "+inf", [3, 4])
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["tensor"], o["made"], o["samples"]) == (
        "input", "args[0]", "+inf", [3, 4]), o
    h = rep["hint"]
    assert rep["cause"] == "input" and "holds Inf and no NaN" in h, h
    assert "sample 3 at feature(s) 5 (of 6); sample 4 at feature(s) 5 (of 6)" in h, h
    assert "denominator of 0" in h and "zero-duration flow" in h, h


def test_class_absent_from_the_split_names_the_loss_buffers_zero_count(tmp_path):
    """No infiltration flow in the training split: its effective number is 0 and the weight
    ``1.0 / eff`` (``aten.reciprocal``) is +inf at the first step. The replay names the
    reciprocal in the loss on its line, and the loss's buffer ``counts`` 0 at entry 3 (it
    said 'a parametrisation reached the op's pole ... as S4 and Mamba parametrise A')."""
    ev, bundle = fire("make_detector", tmp_path, min_count=0.0)
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    assert origin(rep) == (True, "loss", "<loss>", "aten.reciprocal", "+inf", []), rep["origin"]
    assert rep["origin"]["source"] == line_of("w = 1.0 / eff"), rep["origin"]
    h = rep["hint"]
    assert rep["cause"] == "invalid" and "the buffer <loss>.counts alone" in h, h
    assert "is 0 at entry 3 of its shape (4,)" in h and "counts.clamp_min(1)" in h, h
    assert "parametrisation" not in h and "Mamba" not in h, h


def test_beta_rounded_to_one_names_precision(tmp_path):
    """beta = 1 - 1e-8 is 1.0 in float32: ``beta ** n`` is 1 for every class, the effective
    number 0 and its reciprocal +inf; float64 holds 9e3. The replay says precision."""
    ev, bundle = fire("make_detector", tmp_path, beta=1 - 1e-8)
    assert (ev["step"], ev["phase"]) == (0, "loss"), ev
    rep = nanreplay_json(bundle)
    assert origin(rep) == (True, "loss", "<loss>", "aten.reciprocal", "+inf", []), rep["origin"]
    assert rep["cause"] == "precision" and "rounding" in rep["hint"], rep["hint"]


def test_column_constant_over_the_split_names_the_scalers_std_and_its_zero_eps(tmp_path):
    """A column whose training std is 0, z-scored with ``eps=0``: the replay names the division
    in ``scale``, column 5 of every row, the buffer ``scale.std`` and the eps of 0, and no
    longer advises the batch statistic's fix (it went on 'a feature was constant over the
    batch (a dead ReLU unit...)' after naming the kept buffer)."""
    ev, bundle = fire("make_detector_const", tmp_path)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "forward", "scale", "+inf")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["all_samples"]) == (
        "scale", "aten.div", "+inf", True), o
    assert o["source"] == line_of("return (x - self.mean) / (self.std + self.eps)"), o
    h = rep["hint"]
    assert rep["cause"] == "invalid" and "at column(s) [5]" in h and "scale.std" in h, h
    assert "StandardScaler" in h and "guarded nothing" in h, h
    assert "constant over the batch" not in h and "dead ReLU" not in h, h


def test_counts_without_log1p_overflow_float16_under_autocast(tmp_path):
    """A bulk transfer's byte count z-scored raw reaches 9.4e4 in sample 3 of the first batch:
    autocast's cast for ``fc1`` is +inf. The replay names the cast, sample 3, overflow, and
    feature 0 of the batch standing out, with log1p for a heavy-tailed count: sub-ms flows'
    rates of 1e8 are every row's largest value, so the row-wise outlier check found nothing
    and the hint ended on 'points hundreds of metres out ... or keep this op in float32'."""
    ev, bundle = fire("make_detector_raw", tmp_path, bulk_transfers, amp=True, mixup=False)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (0, "forward", "fc1", [3])
    rep = nanreplay_json(bundle)
    assert origin(rep) == (True, "forward", "fc1", "aten._to_copy", "+inf", [3]), rep["origin"]
    h = rep["hint"]
    assert rep["cause"] == "overflow" and "float16" in h and "data alone" in h, h
    assert "sample(s) 3 of args[0] stand out in feature(s) 0" in h, h
    assert "log1p" in h and "keep this op in float32" not in h, h


def test_anomaly_probability_underflows_into_the_bce_log(tmp_path):
    """``sigmoid((err - 5) / 0.01)`` of reconstruction errors near 1 is 0 in float32: the
    hand-written BCE's ``log(p)`` is -inf for every flow. Underflow, log space advised."""
    ev, bundle = fire("make_ae", tmp_path, kind="ae")
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["all_samples"]) == (
        "<loss>", "aten.log", "-inf", True), o
    assert o["source"] == line_of("return -(y * torch.log(p) + (1 - y) * torch.log(1 - p))"), o
    assert rep["cause"] == "underflow" and "BCEWithLogitsLoss" in rep["hint"], rep["hint"]


def test_std_pooling_of_a_one_packet_flow_names_sqrt_backward(tmp_path):
    """A one-packet flow's GRU states equal their mean: the pooled variance is exactly 0 and
    ``sqrt``'s derivative is infinite there, NaN in backward only. The replay names
    SqrtBackward0 on its line, sample 10 of step 2, and the variance floor."""
    ev, bundle = fire("make_gru", tmp_path, one_packet, kind="gru")
    assert (ev["step"], ev["phase"], ev["kind"]) == (2, "backward", "nan"), ev
    rep = nanreplay_json(bundle)
    assert origin(rep) == (True, "backward", "", "SqrtBackward0", "+inf", [10]), rep["origin"]
    assert rep["origin"]["source"] == line_of("torch.sqrt(var)"), rep["origin"]
    h = rep["hint"]
    assert rep["cause"] == "invalid" and "sqrt(var.clamp(min=eps))" in h, h


def test_adam_without_eps_names_the_never_seen_protocol(tmp_path):
    """ICMP filtered out of the split: fc1's weights reading the ICMP one-hot column (8 of its
    input, after the 6 scaled counts) never get a gradient, and Adam with ``eps=0`` makes them
    0/0 at the first update, beside 6 entries of units active only on UDP flows. The hint
    names column 8 of fc1.weight and fc1's input 0 there (it named no column: no root input
    is 9 wide, and the NaN were not whole columns alone)."""
    ev, bundle = fire("make_detector", tmp_path, eps=0.0, icmp=False, mixup=False)
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "optimizer", "nan"), ev
    rep = nanreplay_json(bundle, code=None)
    h = rep["hint"]
    assert rep["cause"] == "optimizer" and "fc1.weight" in h and "eps=0" in h, h
    assert "include whole column(s) 8 of fc1.weight" in h, h
    assert "feature(s) 8 of fc1's input, which hold 0 in every sample" in h, h
    assert "the 6 other non-finite entr(ies)" in h, h


@pytest.mark.parametrize(("make", "plant", "kind"), [
    ("make_detector", None, "det"), ("make_ae_wide", None, "ae"),
    ("make_gru_floor", one_packet, "gru")])
def test_fixed_models_raise_nothing_and_train_the_same(tmp_path, make, plant, kind):
    """The fixed versions (the counts floored at 1, the anomaly temperature at 1, the pooled
    variance floored) on the same planted data, with mixup and the weighted sampler: no
    event, and the weights bit-identical with and without the recorder."""
    recorded = train(make, tmp_path, plant, kind=kind)
    plain = train(make, tmp_path, plant, kind=kind, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.isfinite(a).all() and torch.equal(a, b), name

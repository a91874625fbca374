"""End to end on associative memories and energy-based attention
(``associative_memory_models``): a modern Hopfield layer with a large inverse temperature, Hopfield
pooling over padded and masked bags of instances for multiple-instance learning (a DataLoader
with a padding collate function, the mask an extra argument of ``forward``, gradient
accumulation), Krotov & Hopfield's dense associative memory with its rectified polynomial
energy, and retrieval by gradient descent on the Hopfield energy inside ``forward``
(``autograd.grad`` with ``create_graph=True``). Each planted bug of the domain fires under the
recorder and is replayed with the CLI; the healthy versions raise no event and train
bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import associative_memory_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("associative_memory_models.py", text)


def batches(kind: str, steps: int, bad: int | None):
    """(model args, loss args) per micro-batch, as lists per step; ``bad`` is planted in the
    last step (for the bags: the index of the bag left empty)."""
    if kind == "mil":  # 8 bags a micro-batch, 2 micro-batches a step
        loader = torch.utils.data.DataLoader(M.Bags(n=16 * steps, empty=bad), batch_size=8,
                                             collate_fn=M.pad_bags)
        it = iter(loader)
        for _ in range(steps):
            yield [((x, mask), (y,)) for x, mask, y in (next(it), next(it))]
        return
    if kind == "cloob":  # 16 pairs a step; 48 + bad pairs leave a last batch of bad
        loader = torch.utils.data.DataLoader(M.Pairs(16 * (steps - 1) + (bad or 16)),
                                             batch_size=16)
        yield from ([((img, txt), ())] for img, txt in loader)
        return
    g = torch.Generator().manual_seed(0)
    make = M.pixel_batch if kind == "dense" else M.pattern_batch
    for step in range(steps):
        x, y = make(g, bad if step == steps - 1 else None)
        yield [((x,), (y,))]


LOSSES = {"dense": M.dense_am_loss, "mil": torch.nn.BCEWithLogitsLoss(),
          "cloob": M.cloob_loss}


def train(kind: str, make: str, out_dir, bad: int | None = None, steps: int = 4,
          record: bool = True, amp: bool = False):
    """AdamW with a cosine schedule and gradient clipping, as hopfield-layers' examples
    train; the loss of each micro-batch divided by their number; ``amp``: the forward and
    the loss under bfloat16 autocast. Returns the model."""
    model = getattr(M, make)()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    crit = LOSSES.get(kind, torch.nn.CrossEntropyLoss())
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"associative_memory_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for micro in batches(kind, steps, bad):
            opt.zero_grad()
            for args, targets in micro:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                    out = model(*args)
                    loss = loss_fn(*(out if isinstance(out, tuple) else (out,)), *targets)
                (loss / len(micro)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    return model


def fire(kind: str, make: str, tmp_path, bad: int | None, amp: bool = False):
    with pytest.raises(NonFiniteError) as info:
        train(kind, make, tmp_path, bad, amp=amp)
    return info.value.event, info.value.bundle_path


@pytest.mark.parametrize("amp", [False, True])
def test_hopfield_softmax_by_hand_names_the_exp_and_the_loud_record(tmp_path, amp):
    """softmax(beta * xi K^T) written as exp over its row sum with beta = 8: a record at 30x
    the others' scale makes beta * score pass 88, the exp overflows and inf / inf is NaN in
    the Hopfield layer. The replay names the exp on its line, the record, overflow, the row
    max to subtract before exp, and the record's out-of-scale data; under bfloat16 autocast
    too, where the scores' matmul, hence the exp, is bfloat16."""
    ev, bundle = fire("hop", "make_hopfield_by_hand", tmp_path, bad=5, amp=amp)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        3, "forward", "hopfield", [5]), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "hopfield", "aten.exp", "+inf", [5]), o
    assert o["source"] == line_of("e = torch.exp(scores)"), o
    assert o["dtype"] == ("bfloat16" if amp else "float32"), o
    assert rep["cause"] == "overflow", rep["cause"]
    assert "subtract the row max before exp" in rep["hint"], rep["hint"]
    assert "sample(s) 5" in rep["hint"] and "out of scale" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


@pytest.mark.parametrize("make,module,text", [
    ("make_mil", "pool", "attn = scores.softmax(-1)  # a bag with every"),
    ("make_pma", "pool.mha", "out, _ = self.mha(q, x, x, key_padding_mask=~mask)")])
def test_pooling_of_an_empty_bag_names_the_softmax_and_the_bag(tmp_path, make, module, text):
    """A slide whose tiles were all filtered out as background: its bag pads to a row of
    False, the -inf mask fills every score, and the softmax of a row of -inf is NaN (in
    hopfield-layers' HopfieldPooling by hand, and in torch's MultiheadAttention given the
    key_padding_mask with a learned query: set transformers' PMA). Bag 13 is the sixth of the
    step's second micro-batch: the replay names the softmax in the pooling, micro-batch 1,
    sample 5, and says to keep one key per row or mask with a finite number."""
    ev, bundle = fire("mil", make, tmp_path, bad=13)
    assert (ev["step"], ev["phase"], ev["module"], ev["micro_batch"], ev["samples"]) == (
        0, "forward", module, 1, [5]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["micro_batch"], o["samples"], rep["cause"]) == (
        module, "aten._softmax", 1, [5], "invalid"), rep
    assert o["source"] == line_of(text), o
    assert "fully masked row" in rep["hint"] and "keep at least one key" in rep["hint"], \
        rep["hint"]


def test_dense_am_polynomial_energy_names_the_power_and_its_normalisation(tmp_path):
    """relu(x) ** 40 with memories at unit scale: x passes 9.2 for most records at the first
    step and the power overflows, inf - inf is NaN in the label update. The replay names the
    pow on its line and its records, overflow, and the power's own fix (divide the base by
    its largest value before the power), not the exponential's row max before exp."""
    ev, bundle = fire("dense", "make_dense_am_high_power", tmp_path, bad=None)
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "forward", ""), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "", "aten.pow", "+inf", ev["samples"]), o
    assert len(o["samples"]) > 8 and not o["all_samples"], o
    assert o["source"] == line_of("plus = F.relu(base[:, :, None] + 2 * xi_c[None]) ** self.n")
    assert rep["cause"] == "overflow", rep["cause"]
    assert "power of 40: divide it by its largest value before the power" in rep["hint"], \
        rep["hint"]
    assert "before exp" not in rep["hint"], rep["hint"]


def test_dense_am_image_in_0_255_names_the_power_and_the_record(tmp_path):
    """An image read as 0..255 among images scaled to [-1, 1]: relu(x) ** 20 overflows on
    that record only. The replay names the pow, sample 5, the power's normalisation and the
    record's out-of-scale data; dropping it makes the step finite."""
    ev, bundle = fire("dense", "make_dense_am", tmp_path, bad=5)
    assert (ev["step"], ev["module"], ev["samples"]) == (3, "", [5]), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (o["op"], o["samples"], rep["cause"]) == ("aten.pow", [5], "overflow"), rep
    assert "power of 20" in rep["hint"] and "sample(s) 5" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_dense_am_derivative_overflow_is_an_overflow_not_a_pole(tmp_path):
    """relu(x) ** 40 with x up to 9.0: the forward's 1.6e38 fits float32, its derivative
    40 * x ** 39 does not, and a saturated tanh's 0 gradient times it is NaN: a backward event
    at the first step. The replay names the power's backward node on its line and overflow,
    with the power's normalisation, where it said 'precision: rounding put the op's input on
    its pole' (the ReLU's exact 0s, where x ** 40 has no pole)."""
    ev, bundle = fire("dense", "make_dense_am_steep", tmp_path, bad=None)
    assert (ev["step"], ev["phase"], ev["params"]) == (0, "backward", ["mem"]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["made"]) == (
        "backward", "", "PowBackward0", "nan"), o
    assert o["source"] == line_of("minus = F.relu(base[:, :, None]) ** self.n"), o
    assert rep["cause"] == "overflow", (rep["cause"], rep["hint"])
    assert "the derivative 40 * x ** 39 of x ** 40" in rep["hint"], rep["hint"]
    assert "divide it by its largest value before the power" in rep["hint"], rep["hint"]
    assert "pole, where" not in rep["hint"], rep["hint"]


def test_unrecorded_dense_am_goes_nan_silently(tmp_path):
    """Without the recorder the overflowing run's weights turn NaN: the event is the bug."""
    model = train("dense", "make_dense_am_high_power", tmp_path, record=False)
    assert not torch.isfinite(model.mem).all()


def test_energy_descent_with_too_large_a_step_says_the_iterates_diverged(tmp_path):
    """Retrieval by gradient descent on E = -lse(beta, X^T xi) + xi.xi / 2 with step 12: the
    quadratic term's curvature is 1, so xi - lr * grad multiplies xi by about -11 each step and
    the energy of the batch, summed for autograd.grad, overflows at the 19th step of the very
    first forward. The replay names that sum on its line, every record, overflow, and that the
    loop's iterates were diverging, with a descent's step-size bound as the fix."""
    ev, bundle = fire("hop", "make_energy_big_step", tmp_path, bad=None)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        0, "forward", "", list(range(16))), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["all_samples"], o["line_run"]) == (
        "", "aten.sum", "+inf", True, 19), o
    assert o["source"] == line_of("grad, = torch.autograd.grad(self.energy(xi).sum()"), o
    assert rep["cause"] == "overflow", rep["cause"]
    assert "iterates of a loop were diverging" in rep["hint"], rep["hint"]
    assert "lr below 2 / its curvature" in rep["hint"], rep["hint"]


def test_infoloob_of_a_last_batch_of_one_says_the_batch_not_an_eps(tmp_path):
    """CLOOB's InfoLOOB divides each positive pair by the sum over the batch's other samples;
    49 pairs in batches of 16 leave a last batch of one, whose sum of no negatives is 0: the
    loss is +inf at step 3. The replay names the division on its line and that the loss is
    finite on that sample given twice: the batch of one, fixed by drop_last, not an eps."""
    ev, bundle = fire("cloob", "make_cloob", tmp_path, bad=1)
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["op"], o["made"], o["samples"], o["batch_size"]) == (
        "loss", "aten.div", "+inf", [0], 1), o
    assert o["source"] == line_of("return -torch.log(pos / neg).mean()"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "finite on that sample given twice" in rep["hint"], rep["hint"]
    assert "drop_last=True" in rep["hint"], rep["hint"]


def test_class_energies_by_hand_name_the_exp_and_logsumexp(tmp_path):
    """Each class's logit the negative Hopfield energy lse(beta, M_c q), written as
    log(sum(exp(beta s))) with beta = 40: the exp overflows for most records at the first
    step. The replay names the exp on its line, the records the recorder named, overflow, and
    torch.logsumexp as the fix rather than clamping the exponent."""
    ev, bundle = fire("hop", "make_class_memories", tmp_path, bad=None)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "forward", "", "+inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "", "aten.exp", "+inf", ev["samples"]), o
    assert 8 < len(o["samples"]) < 16, o
    assert o["source"] == line_of("return torch.log(torch.exp(self.beta * s).sum(-1))"), o
    assert rep["cause"] == "overflow" and "torch.logsumexp(x, dim)" in rep["hint"], rep["hint"]


def test_memory_bank_of_zeros_names_the_division_and_the_buffer(tmp_path):
    """A Hopfield lookup into a FIFO queue of past embeddings (a buffer written in forward),
    the queue started as zeros and L2-normalised by hand: 0/0 in every empty slot at the first
    step, NaN keys every query reads. The replay names the division on its line, every
    record, invalid, the bank buffer all 0 as the step began and a nonzero start."""
    ev, bundle = fire("hop", "make_bank", tmp_path, bad=None)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        0, "forward", "", list(range(16))), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["all_samples"]) == (
        "", "aten.div", "nan", True), o
    assert o["source"] == line_of("keys = self.bank / self.bank.norm(dim=-1, keepdim=True)"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "buffer bank, all 0 as the step began" in rep["hint"], rep["hint"]
    assert "start it nonzero" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("kind,make,bad,amp", [
    ("hop", "make_hopfield", 5, False), ("mil", "make_mil", None, False),
    ("dense", "make_dense_am", None, False), ("hop", "make_energy", None, False),
    ("mil", "make_mil_guarded", 13, False), ("cloob", "make_cloob", None, False),
    ("hop", "make_bank_random", None, False), ("hop", "make_hopfield", 5, True),
    ("mil", "make_mil_guarded", 13, True), ("mil", "make_pma", None, False)])
def test_healthy_runs_raise_nothing_and_train_the_same(tmp_path, kind, make, bad, amp):
    """The Hopfield layer's own softmax on the same loud record, the pooling over padded bags
    (-inf in every padded score, inside the softmax), the dense memory on scaled images, the
    energy descent (autograd.grad with create_graph=True inside forward), the pooling that
    zeroes an empty bag's NaN attention (nan_to_num: NaN made inside, none out, none in the
    gradients), CLOOB on full batches and the queue of embeddings started as MoCo starts it
    (written in place in forward): no event, bit-identical weights with and without the
    recorder; the Hopfield layer and the guarded pooling under bfloat16 autocast too."""
    recorded = train(kind, make, tmp_path, bad=bad, steps=3, amp=amp)
    plain = train(kind, make, tmp_path, bad=bad, steps=3, record=False, amp=amp)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name

"""Gated recurrent and linear-attention models (``gated_recurrence_models``: xLSTM's sLSTM and
mLSTM, RetNet's retention, chunkwise gated linear attention) trained as their reference code
is: AdamW with a linear warmup, gradient clipping, bf16 autocast, a truncated-BPTT loop over a
DataLoader of consecutive segments with the state detached between them; the recorder on the
loop, then ``nanreplay``."""

from __future__ import annotations

import json
from pathlib import Path

import gated_recurrence_models as G
import pytest
import torch
import torch.nn.functional as F
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

MODELS = "gated_recurrence_models.py"
MAX_EXP = 88.72  # log of float32's largest value: exp overflows above it

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def warmup_adamw(model, lr: float):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))


def train_lm(model, factory: str | None, batches, out_dir: Path, lr: float = 3e-3,
             bf16: bool = False):
    """Next-token training; ``factory=None`` trains without the recorder."""
    opt, sched = warmup_adamw(model, lr)

    def step(ids, loss_fn):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(ids)
        loss_fn(logits, ids).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()

    if factory is None:
        for ids in batches:
            step(ids, G.lm_loss)
        return model
    with FlightRecorder(model, opt, loss_fn=G.lm_loss, out_dir=out_dir,
                        factory=f"gated_recurrence_models:{factory}") as rec:
        for ids in batches:
            step(ids, rec.loss_fn)
    return model


class Segments(torch.utils.data.Dataset):
    """Consecutive truncated-BPTT segments of B parallel token streams (a DataLoader of them,
    unshuffled, ``batch_size=None``: each item already holds the batch)."""

    def __init__(self, streams: torch.Tensor, t: int):
        self.streams, self.t = streams, t

    def __len__(self):
        return (self.streams.shape[1] - 1) // self.t

    def __getitem__(self, i):
        s = self.streams[:, i * self.t:(i + 1) * self.t + 1]
        return s[:, :-1], s[:, 1:]


def train_tbptt(model, factory: str | None, out_dir: Path, began: list,
                segments: int = 12, t: int = 32) -> None:
    """The sLSTM LM over ``segments`` segments, its state carried (detached) between them;
    ``began`` gets each step's segment and the state it began with."""
    streams = torch.randint(0, G.VOCAB, (4, segments * t + 1),
                            generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(Segments(streams, t), batch_size=None)
    opt, sched = warmup_adamw(model, 1e-3)
    state = model.init_state(4)

    def loop(loss_fn):
        nonlocal state
        for x, y in loader:
            began.append((x, state))
            opt.zero_grad()
            out = model(x, state)
            loss_fn(out, y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            state = tuple(s.detach() for s in out[1])

    if factory is None:
        loop(G.segment_loss)
    else:
        with FlightRecorder(model, opt, loss_fn=G.segment_loss, out_dir=out_dir,
                            factory=f"gated_recurrence_models:{factory}") as rec:
            loop(rec.loss_fn)


def same_weights(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values()))


@pytest.mark.parametrize("bf16", [False, True])
def test_healthy_long_sequences_raise_no_event_and_train_bit_identically(tmp_path, bf16):
    """mLSTM (stabilized, normalizer max(|n^T q|, exp(-m))), RetNet's decay mask (+inf above
    the diagonal, exp of -inf, nan_to_num) and chunkwise GLA (pairwise decays, -inf above the
    diagonal) over 256-token sequences with right padding, fp32 and bf16 autocast: the
    intended infinities inside the modules are no event, and the weights are those of the
    same training without the recorder."""
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(3):
        ids = torch.randint(1, G.VOCAB, (2, 256), generator=g)
        ids[1, 200:] = 0
        batches.append(ids)
    recorded = train_lm(G.make_hybrid(), "make_hybrid", batches, tmp_path, bf16=bf16)
    plain = train_lm(G.make_hybrid(), None, batches, tmp_path, bf16=bf16)
    assert not list(tmp_path.rglob("*.nan"))
    assert same_weights(recorded, plain)


def test_healthy_stabilized_slstm_over_many_segments_raises_no_event(tmp_path):
    """The stabilized sLSTM with forget gates above 1 over 12 segments (384 steps): its
    ``m`` carries the growth in log space across the segments, ``c`` and ``n`` stay bounded;
    no event, the same weights as without the recorder."""
    recorded, plain = G.make_slstm(), G.make_slstm()
    began: list = []
    train_tbptt(recorded, "make_slstm", tmp_path, began)
    train_tbptt(plain, None, tmp_path, [])
    assert not list(tmp_path.rglob("*.nan"))
    assert same_weights(recorded, plain)
    assert float(began[-1][1][2].max()) > MAX_EXP  # (m past exp's range: the log space helps)


def test_an_slstm_without_its_stabilizer_is_an_overflow_of_the_carried_state(tmp_path):
    """The sLSTM's exponential gates without the stabilizer ``m_t``: ``n`` grows by
    ``exp(f~) > 1`` a step, segment after segment through the detached state, until
    ``f * n`` overflows a few hundred steps in. The report named the overflow but read the
    rows whose carried ``n`` grew fastest as out-of-scale data records (``--try drop=`` of
    them); now it says the state the model returned and the loop passed back grew across the
    segments, with the stabilizer as the fix, and suggests no drop."""
    model, began = G.make_slstm_unstabilized(), []
    with pytest.raises(NonFiniteError) as info:
        train_tbptt(model, "make_slstm_unstabilized", tmp_path, began)
    err = info.value
    step = err.event["step"]
    assert (err.event["phase"], err.event["module"]) == ("forward", "cell"), err.event
    rep = nanreplay_json(err.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (o["phase"], o["module"], o["call"], o["op"], o["made"], rep["cause"]) == \
        ("forward", "cell", 0, "aten.mul", "+inf", "overflow"), json.dumps(rep, indent=1)
    assert o["source"] == source_line(MODELS, "n = f * n + i"), o["source"]
    assert step >= 3 and len(began) == step + 1, step  # (more than 100 time steps in)
    # the rows whose n overflows, recomputed in float64 from the state the step began with
    rows, first = overflowing_slstm_rows(model, *began[step])
    assert o["samples"] == rows != [], o["samples"]
    # the loop's time step it overflowed at: line_run is 1-based (the line runs once a step)
    assert o["line_run"] == first + 1 > 1, (o["line_run"], first)
    assert "recurrent state args[1][1]" in rep["hint"] and "stabilizer" in rep["hint"], \
        rep["hint"]
    assert "out of scale" not in rep["hint"], rep["hint"]
    assert not [t for t in rep["what_if"] if t["try"].startswith("drop=")], rep["what_if"]


def overflowing_slstm_rows(model, x, state) -> tuple[list[int], int]:
    """Rows whose ``f * n`` passes float32's range at any time step of a float64 run of the
    event step (the model holds the weights that step ran with: the recorder raised before
    the update; the rows are independent, each overflows at a step of its own), and the
    first time step where one does."""
    cell = model.cell.double()
    with torch.no_grad():
        u = model.norm.double()(model.emb.double()(x))
        c, n, _, h = (s.double() for s in state)
        bad, first = torch.zeros(x.shape[0], dtype=torch.bool), []
        for t in range(x.shape[1]):
            zt, ft, it, ot = (cell.w(u[:, t]) + cell.r(h)).chunk(4, -1)
            f, i = ft.exp(), it.exp()
            bad |= (f * n).abs().amax(1) > torch.finfo(torch.float32).max
            first += [t] if bad.any() and not first else []
            c, n = f * c + i * zt.tanh(), f * n + i
            h = ot.sigmoid() * c / n
    return torch.nonzero(bad).flatten().tolist(), first[0]


def test_an_mlstm_without_its_normalizer_is_0_by_0_at_the_padded_rows(tmp_path):
    """mLSTM's ``h = C q / max(|n^T q|, exp(-m))`` written as ``C q / (n^T q)``: the padding
    token's embedding is 0, the bias-free LayerNorm and projections keep it 0, so ``q = 0``
    and the division is 0/0 at the padded positions (step 2, the first batch with padding),
    named at the division in the timestep loop, on the padded rows, as invalid. The report
    named the line only; now also which run of it (the loop's time step) made the NaN."""
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(1, G.VOCAB, (4, 48), generator=g) for _ in range(4)]
    batches[2][1, 40:] = 0
    batches[2][3, 30:] = 0
    with pytest.raises(NonFiniteError) as info:
        train_lm(G.make_mlstm_unnormalized(), "make_mlstm_unnormalized", batches, tmp_path)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (2, "forward"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["call"], o["op"], o["made"], rep["cause"]) == \
        ("blocks.0.mixer", 0, "aten.div", "nan", "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == source_line(MODELS, "hs.append(num / den)"), o["source"]
    padded = torch.nonzero((batches[2] == 0).any(1)).flatten().tolist()
    assert o["samples"] == padded == [1, 3], o["samples"]
    # the time step of the first padded position (row 3's 30): the line's 31st run
    assert o["line_run"] == 31, o["line_run"]
    assert "0 by 0" in rep["hint"], rep["hint"]


def test_a_chunk_exp_of_minus_cumsum_of_log_gates_is_an_overflow_at_that_exp(tmp_path):
    """Chunkwise GLA with the keys scaled by ``exp(-b)`` (``b`` the chunk's cumsum of log
    gates) instead of ``exp(b_last - b)``: once the gates close, a 64-token chunk's log gates
    sum below -88 and exp overflows; named at that exp, on the rows whose chunk sum passed
    exp's range, as an overflow. The advice was the generic one (subtract the row max before
    exp); now it names the cumsum the exp took and the differences that keep it in range."""
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(1, G.VOCAB, (4, 128), generator=g) for _ in range(40)]
    model = G.make_gla_unstable()
    with pytest.raises(NonFiniteError) as info:
        train_lm(model, "make_gla_unstable", batches, tmp_path, lr=3e-2)
    err = info.value
    step = err.event["step"]
    assert err.event["phase"] == "forward", err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["call"], o["op"], o["made"], rep["cause"]) == \
        ("blocks.0.mixer", 0, "aten.exp", "+inf", "overflow"), json.dumps(rep, indent=1)
    assert o["source"] == source_line(MODELS, "ki = k[:, i] * torch.exp(-bi)"), o["source"]
    rows, chunk = overflowing_gla_rows(model, batches[step])
    assert o["samples"] == rows != [], o["samples"]
    assert o["line_run"] == chunk + 1, (o["line_run"], chunk)  # (the line runs once a chunk)
    made = source_line(MODELS, "transpose(2, 3).cumsum(-2)")
    assert f"took a cumulative sum (made at {made})" in rep["hint"] and \
        "exp(b_last - b)" in rep["hint"], rep["hint"]


def overflowing_gla_rows(model, ids) -> tuple[list[int], int]:
    """Rows whose chunk cumsum of log gates reaches below -88.72 anywhere, and the first
    chunk where one does."""
    block = model.blocks[0]
    mixer = block.mixer
    with torch.no_grad():
        x = block.norm(model.emb(ids))
        gates = F.logsigmoid(mixer.gk(x)).double() / mixer.normalizer
        b, t, d = gates.shape
        sums = gates.view(b, t // mixer.chunk, mixer.chunk, d).cumsum(2)
    over = (-sums).amax((2, 3)) > MAX_EXP  # (b, chunks)
    return torch.nonzero(over.any(1)).flatten().tolist(), int(over.any(0).nonzero()[0])


def left_padded(g: torch.Generator) -> list[torch.Tensor]:
    batches = [torch.randint(1, G.VOCAB, (4, 40), generator=g) for _ in range(3)]
    batches[1][2, :10] = 0
    batches[1][0, :3] = 0
    return batches


@pytest.mark.parametrize("factory,op,line", [
    ("make_rwkv", "aten.div", "out.append((e1 * aa + e2 * vt) / (e1 * bb + e2))"),
    ("make_rwkv_inf_start", "aten.sub", "e1, e2 = torch.exp(pp - p), torch.exp(ww - p)")])
def test_rwkv_keys_masked_with_minus_inf_at_left_padding_are_named_on_the_padded_rows(
        tmp_path, factory, op, line):
    """RWKV-4's WKV with the keys of padded positions set to -inf (no weight in the
    average): a left-padded row has nothing to average at its first positions. With the
    reference's ``pp = -1e38`` start, ``e2 = exp(-inf) = 0`` and ``bb = 0`` make the output
    0/0; with ``pp = -inf``, the running max is -inf too and ``pp - p`` is -inf - -inf. Both
    are named at their op's line, on the left-padded rows, at the loop's first time step, as
    invalid; the subtraction's NaN comes from the mask alone."""
    batches = left_padded(torch.Generator().manual_seed(0))
    with pytest.raises(NonFiniteError) as info:
        train_lm(getattr(G, factory)(), factory, batches, tmp_path)
    err = info.value
    assert (err.event["step"], err.event["module"]) == (1, "mixers.0"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["call"], o["op"], o["made"], rep["cause"]) == \
        ("mixers.0", 0, op, "nan", "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == source_line(MODELS, line), o["source"]
    assert o["samples"] == [0, 2] and o["line_run"] == 1, o
    if op == "aten.sub":
        assert o["chain"][0]["intentional"] and "masked (-inf)" in rep["hint"], rep["hint"]


def test_a_retnet_decay_mask_multiplied_in_after_its_exp_overflows_above_the_diagonal(
        tmp_path):
    """RetNet's decay mask written as ``exp((i - j) * log gamma) * tril``: above the diagonal
    the exponent is positive and grows with the length, so a 512-token batch after shorter
    ones overflows at the exp, and the mask's 0 makes inf * 0 = NaN. Named at the exp, every
    row (the mask is the same for all), as an overflow; the hint only said to rescale the
    exp's input; now it says the product after it multiplied every infinity by the mask's 0,
    and to mask the exponent before the exp."""
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(1, G.VOCAB, (2, t), generator=g) for t in (64, 64, 96, 512)]
    with pytest.raises(NonFiniteError) as info:
        train_lm(G.make_retnet_masked_after(), "make_retnet_masked_after", batches, tmp_path)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (3, "forward"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], rep["cause"]) == \
        ("blocks.0.mixer", "aten.exp", "+inf", "overflow"), json.dumps(rep, indent=1)
    assert o["source"] == source_line(MODELS, "mask = torch.exp((index[:, None]"), o["source"]
    assert o["all_samples"] is True, o
    product = source_line(MODELS, "mask = mask * torch.tril")
    assert f"then aten.mul ({product}) multiplied every infinity it made by a mask's 0" in \
        rep["hint"] and "fill it with -inf" in rep["hint"], rep["hint"]

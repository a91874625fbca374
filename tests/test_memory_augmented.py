"""End to end: memory-augmented networks (``memory_augmented_models``: an NTM whose memory the
loop carries between truncated-BPTT chunks, an end-to-end memory network over padded stories,
a pointer network decoding padded sequences), trained under the recorder until a planted bug
fires, then replayed with the CLI; and their healthy runs, which must run through."""

from __future__ import annotations

import memory_augmented_models as M
import pytest
import torch
from bundles import line_number, nanreplay_json
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError

B, T = 4, 7  # the NTM's batch and chunk length (time-major: (T, B, bits))


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> int:
    return line_number("memory_augmented_models.py", text)


# ---------------------------------------------------------------------------------------------
# NTM: a copy task in chunks, the state (controller, memory, head weights) carried between them


def reset(h, done):
    """``h`` with the rows of the ended streams zeroed: along dim 0, or dim 1 of an nn.LSTM
    state (layers, B, H)."""
    at = 1 if h.shape[0] != B else 0
    shape = [1] * h.dim()
    shape[at] = B
    return h * (1 - done).view(shape)


def train_ntm(out_dir, factory: str, done_at: dict[int, list[int]], steps: int = 5,
              zero_memory: bool = False):
    """pytorch-ntm's copy-task loop, time-major, with the state carried across chunks
    (detached, as ``repackage_hidden`` does); the streams whose episode ended get a fresh
    state the way stateful loops reset one, multiplying it by ``1 - done`` (:func:`reset`)."""
    model = getattr(M, factory)()
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-4, momentum=0.9, alpha=0.95)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    crit = torch.nn.BCEWithLogitsLoss()
    g = torch.Generator().manual_seed(0)
    hidden = model.init_hidden(B, zero_memory=zero_memory)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                        factory=f"memory_augmented_models:{factory}"):
        for step in range(steps):
            x = torch.randint(0, 2, (T, B, M.IN_BITS), generator=g).float()
            hidden = M.repackage_hidden(hidden)
            if step in done_at:
                done = torch.zeros(B)
                done[done_at[step]] = 1.0
                hidden = tuple(reset(h, done) for h in hidden)
            out, hidden = model(x, hidden)
            loss = crit(out, x.roll(1, 0))
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_value_(model.parameters(), 10)
            opt.step()
            sched.step()


@pytest.mark.parametrize("factory", ["make_ntm_no_delta", "make_dnc_no_delta"])
def test_a_memory_reset_for_an_ended_episode_names_that_stream_not_time_steps(tmp_path, factory):
    # DNC's cosine θ without its δ: the memory of stream 1, zeroed as its episode ended, is
    # 0 / 0 against every key. The batch is time-major, (T=7, B=4, bits), and the loss
    # compares (T, B, bits) with (T, B, bits): the samples were taken along T (the report
    # said [0, 1], and drop=0,1 stayed NaN); the carried state (B, ...) says where B is,
    # beside an nn.LSTM controller's (layers, B, H) too
    with pytest.raises(NonFiniteError) as info:
        train_ntm(tmp_path, factory, {3: [1]})
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "memory", [1])
    rep = nanreplay_json(info.value.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (rep["cause"], o["module"], o["call"], o["op"], o["made"], o["samples"]) == (
        "invalid", "memory", 0, "aten.div", "nan", [1]), rep
    assert o["batch_size"] == B, o
    assert o["source"] == f"memory_augmented_models.py:{line_of('torch.bmm(mag_a, mag_b')}"
    assert "add an eps to the denominator" in rep["hint"], rep["hint"]
    [t] = rep["what_if"]
    assert (t["try"], t["finite"]) == ("drop=1", True), t


def test_a_memory_of_zeros_read_by_cosine_similarity_is_no_event(tmp_path):
    # the DNC's memory starts at zeros; F.cosine_similarity clamps the norms, so the NTM's
    # first reads are finite, and so are their gradients: the run must go through
    train_ntm(tmp_path, "make_ntm_cosine", {2: [0, 3]}, zero_memory=True)
    assert not list(tmp_path.glob("*.nan"))


# ---------------------------------------------------------------------------------------------
# MemN2N: bAbI-like stories of up to SENTS sentences, padded with sentences of word 0


def stories(n: int, empty: list[int], g):
    story = torch.randint(1, M.VOCAB, (n, M.SENTS, M.WORDS), generator=g)
    lengths = torch.randint(1, M.SENTS + 1, (n,), generator=g)
    story[torch.arange(M.SENTS)[None] >= lengths[:, None]] = 0
    story[empty] = 0  # a question asked before any sentence of its story
    return (story, torch.randint(1, M.VOCAB, (n, M.WORDS), generator=g),
            torch.randint(1, M.VOCAB, (n,), generator=g))


def train_memn2n(out_dir, factory: str, amp: bool = False, batch: int = 6):
    """nmhkahn/MemN2N-pytorch's loop (SGD, gradient norm clipped at 40) over a DataLoader;
    the 21st story has no sentence (the 3rd of step 3's batch); ``amp``: float16 autocast
    with a GradScaler."""
    g = torch.Generator().manual_seed(0)
    loader = DataLoader(TensorDataset(*stories(5 * batch, [20], g)), batch_size=batch)
    model = getattr(M, factory)()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", enabled=amp)
    crit = torch.nn.CrossEntropyLoss()
    with FlightRecorder(model, opt, loss_fn=crit, scaler=scaler, out_dir=out_dir,
                        factory=f"memory_augmented_models:{factory}"):
        for story, query, answer in loader:
            with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
                loss = crit(model(story, query), answer)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 40.0)
            scaler.step(opt)
            scaler.update()


def test_a_story_without_sentences_is_a_fully_masked_softmax(tmp_path):
    with pytest.raises(NonFiniteError) as info:
        train_memn2n(tmp_path, "make_memn2n")
    assert (info.value.event["step"], info.value.event["phase"]) == (3, "forward")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "invalid", "", "aten._softmax", "nan", [2]), rep
    assert o["source"] == f"memory_augmented_models.py:{line_of('prob = F.softmax(scores')}"
    assert [(c["op"], c["intentional"]) for c in o["chain"]] == [
        ("aten.masked_fill", True), ("aten._softmax", False)], o["chain"]
    assert "fully masked row" in rep["hint"] and "at least one key" in rep["hint"], rep["hint"]


def test_a_mask_value_float16_cannot_hold_is_named_as_the_constant(tmp_path):
    # scores + (1 - mask) * -1e9: in float32 the empty story's row is uniform (no event), under
    # float16 autocast -1e9 is -inf and the row is NaN. The hint said "compute this op in
    # float32 ... or rescale its inputs"; the fix is the constant, taken from the type
    train_memn2n(tmp_path / "fp32", "make_memn2n_additive")
    assert not list((tmp_path / "fp32").glob("*.nan"))
    with pytest.raises(NonFiniteError) as info:
        train_memn2n(tmp_path / "fp16", "make_memn2n_additive", amp=True)
    assert (info.value.event["step"], info.value.event["phase"]) == (3, "forward")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["module"], o["op"], o["made"], o["samples"], o["dtype"]) == (
        "overflow", "", "aten.mul", "-inf", [2], "float16"), rep
    assert o["source"] == f"memory_augmented_models.py:{line_of('* self.mask_value')}"
    assert [c["op"] for c in o["chain"]] == ["aten.mul", "aten._softmax"], o["chain"]
    assert "the constant -1e+09" in rep["hint"], rep["hint"]
    assert "torch.finfo(x.dtype).min" in rep["hint"], rep["hint"]
    assert "rescale its inputs" not in rep["hint"], rep["hint"]


# ---------------------------------------------------------------------------------------------
# pointer network: sort the values of zero-padded sequences of true length ``lengths``


def sort_batch(g, short: dict[int, int]):
    x = torch.rand(5, M.PN_LEN, 1, generator=g)
    lengths = torch.full((5,), M.PN_LEN)
    for i, n in short.items():
        lengths[i] = n
    pad = torch.arange(M.PN_LEN)[None] >= lengths[:, None]
    x = x.masked_fill(pad[..., None], 0.0)
    return x, lengths, x[..., 0].masked_fill(pad, 2.0).argsort(1)  # padding pointed at last


def train_pointer(out_dir, factory: str, short_at: int = 2):
    """Five steps of Adam over the trainable parameters (shiretzet/PointerNet's
    ``filter(lambda p: p.requires_grad, ...)``); sequence 3 of step ``short_at`` has 4 values.
    The decoder runs max-length steps and masks each position it pointed at: at decode step 4
    every position of that sequence is masked."""
    model = getattr(M, factory)()
    opt = torch.optim.Adam(filter(lambda p: p.requires_grad, model.parameters()), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with FlightRecorder(model, opt, loss_fn=M.pointer_loss, out_dir=out_dir,
                        factory=f"memory_augmented_models:{factory}") as rec:
        for step in range(5):
            x, lengths, target = sort_batch(g, {3: 4} if step == short_at else {})
            loss = rec.loss_fn(model(x, lengths), target, lengths)
            opt.zero_grad()
            loss.backward()
            opt.step()


def assert_decoded_past_the_end(err):
    assert (err.event["step"], err.event["phase"]) == (2, "forward"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["phase"], o["module"], o["call"], o["op"], o["samples"]) == (
        "invalid", "forward", "attention", 4, "aten._softmax", [3]), rep
    assert o["source"] == f"memory_augmented_models.py:{line_of('alpha = F.softmax(att')}"
    assert "fully masked row" in rep["hint"], rep["hint"]


def test_decoding_past_a_short_sequence_points_at_a_fully_masked_row(tmp_path):
    with pytest.raises(NonFiniteError) as info:
        train_pointer(tmp_path, "make_pointer_net")
    assert_decoded_past_the_end(info.value)


def test_a_frozen_parameter_holding_the_mask_value_is_no_bad_weight(tmp_path):
    # shiretzet/PointerNet: self._inf = Parameter(FloatTensor([-inf]), requires_grad=False),
    # att[mask] = self.inf[mask]. The event was 'weights' (attention._inf, first seen at
    # step 2) and the hint sent the user to an EMA update's momentum: the -inf is the mask
    train_pointer(tmp_path / "healthy", "make_pointer_net_inf_param", short_at=-1)
    assert not list((tmp_path / "healthy").glob("*.nan"))
    with pytest.raises(NonFiniteError) as info:
        train_pointer(tmp_path / "short", "make_pointer_net_inf_param")
    assert info.value.event["params"] == [], info.value.event
    assert_decoded_past_the_end(info.value)


# ---------------------------------------------------------------------------------------------
# pytorch-ntm's own loop: init_sequence, then one root forward per time step


def train_encapsulated(out_dir, factory: str, steps: int = 3):
    """pytorch-ntm ``train_batch``: ``net.init_sequence(B)``, ``net(X[i])`` for each input
    step, ``y_out[i], _ = net()`` for each output step, ``BCELoss`` on the sigmoid outputs,
    gradients clipped by value, RMSprop (its copy task's settings)."""
    model = getattr(M, factory)()
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-4, momentum=0.9, alpha=0.95)
    crit = torch.nn.BCELoss()
    g = torch.Generator().manual_seed(0)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                        factory=f"memory_augmented_models:{factory}"):
        for _ in range(steps):
            seq = torch.randint(0, 2, (T, B, M.IN_BITS), generator=g).float()
            x = torch.zeros(T + 1, B, M.IN_BITS)
            x[:T], x[T, :, -1] = seq, 1.0  # the delimiter
            opt.zero_grad()
            model.init_sequence(B)
            for i in range(T + 1):
                model(x[i])
            y_out = torch.zeros(seq.size())
            for i in range(T):
                y_out[i], _ = model()
            loss = crit(y_out, seq)
            loss.backward()
            torch.nn.utils.clip_grad_value_(model.parameters(), 10)
            opt.step()


def test_pytorch_ntm_state_set_by_init_sequence_is_named_not_a_failed_replay(tmp_path):
    # the memory starts at zeros and θ has no δ: 0/0 in the first addressing. BCELoss refuses
    # the NaN (its RuntimeError ends the loop; the recorder wrote the bundle first). The
    # rebuilt model's previous_state is None (init_sequence sets it): the replay said
    # "replay failed (TypeError: cannot unpack non-iterable NoneType object)". (With its
    # uniform mem_bias and δ the same loop trains through)
    train_encapsulated(tmp_path / "healthy", "make_encapsulated_ntm")
    assert not list((tmp_path / "healthy").glob("*.nan"))
    with pytest.raises(RuntimeError, match="between 0 and 1"):
        train_encapsulated(tmp_path, "make_encapsulated_ntm_zeros_no_delta")
    [bundle] = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle, code=1)
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["module"], o["micro_batch"]) == (
        False, "forward", "memory.addressing", 0), rep
    where = f"memory_augmented_models.py:{line_of('= self.previous_state')}"
    assert f"raised TypeError (cannot unpack non-iterable NoneType object) at {where}" \
        in rep["hint"], rep["hint"]
    assert "previous_state is None in the model the factory builds" in rep["hint"], rep["hint"]
    assert "call that method there" in rep["hint"], rep["hint"]
    # and that fix works: a factory that calls init_sequence replays the step
    rep = nanreplay_json(bundle, "--factory",
                         "memory_augmented_models:make_encapsulated_ntm_zeros_no_delta_ready")
    o = rep["origin"]
    assert (rep["cause"], o["module"], o["micro_batch"], o["op"], o["samples"]) == (
        "invalid", "memory.addressing", 0, "aten.div", list(range(B))), rep
    assert "add an eps to the denominator" in rep["hint"], rep["hint"]

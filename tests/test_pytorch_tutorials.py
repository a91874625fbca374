"""The official PyTorch tutorials' training loops (``pytorch_tutorials_models``) under the
flight recorder, as their readers would add it: seq2seq translation with two optimizers, the
char-RNN generator's hand-written SGD, the nn.Transformer language model (clipping, StepLR),
DQN (SmoothL1Loss, clip_grad_value_, AdamW amsgrad, soft target update), the spatial
transformer, the custom autograd Function's polynomial fit by hand under ``torch.no_grad()``,
and EmbeddingBag text classification. Healthy runs raise nothing; each planted bug is named
by its step, module, op, samples and cause."""

from __future__ import annotations

import pytest
import pytorch_tutorials_models as M
import torch
from bundles import nanreplay_json, source_line
from torch import nn

from recorder import FlightRecorder, NonFiniteError

MODELS = "pytorch_tutorials_models.py"

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def event_of(fn, *args, **kw) -> NonFiniteError:
    with pytest.raises(NonFiniteError) as info:
        fn(*args, **kw)
    return info.value


def recorder(out_dir, model, opt, loss_fn, factory, scaler=None):
    if out_dir is None:
        return None
    return FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir, scaler=scaler,
                          factory=f"pytorch_tutorials_models:{factory}").attach()


def run(rec, loop):
    try:
        loop()
    finally:
        if rec is not None:
            rec.detach()


# ----------------------------------------------------------------------------- loops


def train_seq2seq(out_dir, *, factory="make_seq2seq", empty=None, epochs=2):
    """``train_epoch``: encoder and decoder Adams, NLLLoss of the log-probabilities of every
    target position (padding included, as the tutorial does); the recorder is given the
    encoder's Adam, stepped first."""
    model = getattr(M, factory)()
    enc_opt = torch.optim.Adam(model.encoder.parameters(), lr=0.001)
    dec_opt = torch.optim.Adam(model.decoder.parameters(), lr=0.001)
    criterion = nn.NLLLoss()
    loader = torch.utils.data.DataLoader(M.sentence_pairs(empty=empty), batch_size=8)
    rec = recorder(out_dir, model, enc_opt, criterion, factory)

    def loop():
        for _ in range(epochs):
            for input_tensor, target_tensor in loader:
                enc_opt.zero_grad()
                dec_opt.zero_grad()
                decoder_outputs = model(input_tensor, target_tensor)
                loss = criterion(decoder_outputs.view(-1, decoder_outputs.size(-1)),
                                 target_tensor.view(-1))
                loss.backward()
                enc_opt.step()
                dec_opt.step()
    run(rec, loop)
    return model


def train_encoder_decoder(out_dir, *, record="decoder", empty=None, masked=True, epochs=2):
    """The tutorial's own structure: ``encoder`` and ``decoder`` two modules, called in turn by
    ``train_epoch``, one of them recorded with its own Adam (the decoder with the loss); the
    source padding mask passed to the decoder."""
    encoder, decoder = M.make_encoder_decoder()
    enc_opt = torch.optim.Adam(encoder.parameters(), lr=0.001)
    dec_opt = torch.optim.Adam(decoder.parameters(), lr=0.001)
    criterion = nn.NLLLoss()
    loader = torch.utils.data.DataLoader(M.sentence_pairs(empty=empty), batch_size=8)
    rec = (recorder(out_dir, decoder, dec_opt, criterion, "make_decoder") if record == "decoder"
           else recorder(out_dir, encoder, enc_opt, None, "make_encoder"))

    def loop():
        for _ in range(epochs):
            for input_tensor, target_tensor in loader:
                enc_opt.zero_grad()
                dec_opt.zero_grad()
                encoder_outputs, encoder_hidden = encoder(input_tensor)
                decoder_outputs, _, _ = decoder(encoder_outputs, encoder_hidden, target_tensor,
                                                pad_mask=input_tensor == 0 if masked else None)
                loss = criterion(decoder_outputs.view(-1, decoder_outputs.size(-1)),
                                 target_tensor.view(-1))
                loss.backward()
                enc_opt.step()
                dec_opt.step()
    run(rec, loop)
    return decoder


def train_char_rnn(out_dir, *, factory="make_char_rnn", lr=0.0005, steps=6):
    """The generation tutorial's ``train``: one name a step, the NLLLoss of each letter summed
    over the name's ``rnn`` calls, then ``p.data.add_(p.grad.data, alpha=-learning_rate)``."""
    rnn = getattr(M, factory)()
    criterion = nn.NLLLoss()
    rec = recorder(out_dir, rnn, None, criterion, factory)

    def loop():
        for step in range(steps):
            category_tensor, input_line_tensor, target_line_tensor = M.random_name(step % 3)
            hidden = rnn.initHidden()
            rnn.zero_grad()
            loss = torch.Tensor([0])
            for i in range(input_line_tensor.size(0)):
                output, hidden = rnn(category_tensor, input_line_tensor[i], hidden)
                loss += criterion(output, target_line_tensor[i])
            loss.backward()
            for p in rnn.parameters():
                p.data.add_(p.grad.data, alpha=-lr)
    run(rec, loop)
    return rnn


def train_transformer(out_dir, *, clip=True, epochs=2, amp=False, watch=None):
    """``train``: SGD lr 5, CrossEntropyLoss of the flattened logits, clip_grad_norm_(0.5)
    (``clip``), StepLR(1, gamma=0.95) each epoch; the last batch's mask cut to its length.
    With ``amp``, the AMP recipe's float16 autocast and GradScaler (unscale_ before the
    clipping). ``watch``: called with the model before training (a test's own hooks)."""
    model = M.make_transformer_lm()
    if watch is not None:
        watch(model)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=5.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1.0, gamma=0.95)
    scaler = torch.amp.GradScaler("cpu", enabled=amp)
    train_data = M.batchify()
    rec = recorder(out_dir, model, optimizer, criterion, "make_transformer_lm",
                   scaler if amp else None)

    def loop():
        model.train()
        src_mask = M.generate_square_subsequent_mask(M.BPTT)
        for _ in range(epochs):
            for i in range(0, train_data.size(0) - 1, M.BPTT):
                data, targets = M.get_batch(train_data, i)
                seq_len = data.size(0)
                if seq_len != M.BPTT:  # only on last batch
                    src_mask = src_mask[:seq_len, :seq_len]
                with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
                    output = model(data, src_mask)
                    loss = criterion(output.view(-1, M.NTOKENS), targets)
                optimizer.zero_grad()
                scaler.scale(loss).backward()
                if clip:
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                scaler.step(optimizer)
                scaler.update()
            scheduler.step()
            src_mask = M.generate_square_subsequent_mask(M.BPTT)
    run(rec, loop)
    return model


def train_dqn(out_dir, *, eps=1e-8, steps=5, action=None, nan_reward=None):
    """``optimize_model`` then the soft update: Q(s, a) gathered, the target network's max over
    the next states (0 at terminal ones), SmoothL1Loss, clip_grad_value_(100), AdamW(amsgrad);
    the target's state_dict blended with TAU = 0.005."""
    policy_net, target_net = M.make_dqn(), M.make_dqn()
    target_net.load_state_dict(policy_net.state_dict())
    optimizer = torch.optim.AdamW(policy_net.parameters(), lr=1e-4, amsgrad=True, eps=eps)
    criterion = nn.SmoothL1Loss()
    rec = recorder(out_dir, policy_net, optimizer, criterion, "make_dqn")
    GAMMA, TAU = 0.99, 0.005

    def loop():
        for step in range(steps):
            state, act, nxt, done, reward = M.transitions(step, action=action)
            if nan_reward is not None and step == nan_reward[0]:
                reward[nan_reward[1]] = float("nan")
            non_final_mask = ~done
            state_action_values = policy_net(state).gather(1, act)
            next_state_values = torch.zeros(len(state))
            with torch.no_grad():
                next_state_values[non_final_mask] = target_net(nxt[non_final_mask]).max(1).values
            expected_state_action_values = (next_state_values * GAMMA) + reward
            loss = criterion(state_action_values, expected_state_action_values.unsqueeze(1))
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_value_(policy_net.parameters(), 100)
            optimizer.step()
            target_net_state_dict = target_net.state_dict()
            policy_net_state_dict = policy_net.state_dict()
            for key in policy_net_state_dict:
                target_net_state_dict[key] = (policy_net_state_dict[key] * TAU
                                              + target_net_state_dict[key] * (1 - TAU))
            target_net.load_state_dict(target_net_state_dict)
    run(rec, loop)
    return policy_net


def train_stn(out_dir, *, corrupt=None, epochs=1):
    """``train``: SGD lr 0.01, ``F.nll_loss`` of the log-probabilities, batches of 16."""
    model = M.make_stn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(M.Digits(corrupt=corrupt), batch_size=16)
    rec = recorder(out_dir, model, optimizer, nn.NLLLoss(), "make_stn")

    def loop():
        model.train()
        for _ in range(epochs):
            for data, target in loader:
                optimizer.zero_grad()
                output = model(data)
                loss = torch.nn.functional.nll_loss(output, target)
                loss.backward()
                optimizer.step()
    run(rec, loop)
    return model


def train_polynomial(out_dir, *, learning_rate=5e-6, steps=20):
    """``polynomial_custom_function.py``'s loop: the sum of squared errors, backward, each
    parameter moved by hand under ``torch.no_grad()`` and its gradient set to None."""
    model = M.make_polynomial()
    x, y = M.sine_points()
    loss_fn = M.SumSquaredError()
    rec = recorder(out_dir, model, None, loss_fn, "make_polynomial")

    def loop():
        for _ in range(steps):
            loss = loss_fn(model(x), y)
            loss.backward()
            with torch.no_grad():
                for p in (model.a, model.b, model.c, model.d):
                    p -= learning_rate * p.grad
                    p.grad = None
    run(rec, loop)
    return model


def train_text(out_dir, *, factory="make_text_classifier", unknown=None, epochs=2):
    """``train``: SGD lr 5, CrossEntropyLoss, clip_grad_norm_(0.1), StepLR(1, gamma=0.1),
    batches of 8 made by ``collate_batch``."""
    model = getattr(M, factory)()
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=5)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1.0, gamma=0.1)
    loader = torch.utils.data.DataLoader(M.news_items(unknown=unknown), batch_size=8,
                                         collate_fn=M.collate_batch)
    rec = recorder(out_dir, model, optimizer, criterion, factory)

    def loop():
        model.train()
        for _ in range(epochs):
            for label, text, offsets in loader:
                optimizer.zero_grad()
                predicted_label = model(text, offsets)
                loss = criterion(predicted_label, label)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
                optimizer.step()
            scheduler.step()
    run(rec, loop)
    return model


# ----------------------------------------------------------------------------- healthy


def _same_weights(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("train", [train_seq2seq, train_encoder_decoder, train_char_rnn,
                                   train_transformer, train_dqn, train_stn, train_polynomial,
                                   train_text])
def test_healthy_tutorial_trains_bit_identically_without_an_event(tmp_path, train):
    """Each tutorial's loop as written (dropout, teacher forcing, two Adams, hand-written SGD,
    clipping, StepLR, the DQN's soft update, the Function's hand updates): no bundle, and the
    weights are those of the same run without the recorder."""
    recorded = train(tmp_path)
    plain = train(None)
    assert list(tmp_path.rglob("*.nan")) == []
    _same_weights(recorded, plain)


def test_healthy_variants_of_the_planted_models_raise_no_event(tmp_path):
    """The padding mask over sentences that all hold a word, the hand-written norm of texts
    with a known token: no event."""
    train_seq2seq(tmp_path, factory="make_masked_seq2seq")
    train_text(tmp_path, factory="make_text_classifier_with_norm")
    assert list(tmp_path.rglob("*.nan")) == []


# ----------------------------------------------------------------------------- planted


def test_padding_mask_over_an_empty_source_sentence_is_a_fully_masked_softmax(tmp_path):
    """Pair 13 (batch 1, row 5) has a blank source line: every position is padding, the
    masked scores are all -inf and the attention's softmax is 0/0 there."""
    err = event_of(train_seq2seq, tmp_path, factory="make_masked_seq2seq", empty=13)
    assert (err.event["step"], err.event["phase"]) == (1, "forward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    assert (o["op"], o["module"], o["made"], o["samples"]) == \
        ("aten._softmax", "decoder.attention", "nan", [5])
    assert o["source"].startswith(source_line(MODELS, "weights = F.softmax(scores, dim=-1)"))
    assert "fully masked row" in rep["hint"] and "--try drop=5" in rep["hint"]


def test_empty_source_sentence_with_the_decoder_recorded_alone(tmp_path):
    """The tutorial's two modules, the decoder recorded with its Adam and the loss: the same
    softmax, module and row; its inputs are the encoder's outputs, so no blank record is
    named, only the fully masked row."""
    err = event_of(train_encoder_decoder, tmp_path, empty=13)
    assert (err.event["step"], err.event["phase"]) == (1, "forward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    assert (o["op"], o["module"], o["made"], o["samples"]) == \
        ("aten._softmax", "attention", "nan", [5])
    assert "pad_mask is True (masked) at every position of samples [5]" in rep["hint"]


def test_empty_source_sentence_with_the_encoder_recorded_alone_points_downstream(tmp_path):
    """Recorded on the encoder alone, the NaN enters its outputs' gradient from the decoder's
    attention, row 5. The hint only said to pass the loss as loss_fn, which would not re-run
    the decoder between the encoder and the loss; it now says the value may be a network's
    that the loop ran on the model's output, and to record a module holding both."""
    err = event_of(train_encoder_decoder, tmp_path, record="encoder", empty=13)
    assert (err.event["step"], err.event["phase"]) == (1, "backward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert rep["reproduced"] is True and rep["cause"] is None
    assert (o["phase"], o["samples"]) == ("loss", [5])
    assert "the seq2seq tutorial's decoder on the encoder's outputs" in rep["hint"]
    assert "record a module that holds both" in rep["hint"]


def test_log_of_softmax_in_the_char_rnn_generator_is_an_underflow(tmp_path):
    """lr 0.5 in the hand-written update makes the generator confident within three names; its
    ``log(softmax)`` then takes the log of a probability rounded to 0. Without an optimizer
    each of the RNN's per-letter calls is a step (docs/guide.md), so the event's step counts
    letters: the 17th call, the first letter of the fourth name."""
    err = event_of(train_char_rnn, tmp_path, factory="make_char_rnn_log_softmax", lr=0.5)
    assert (err.event["step"], err.event["phase"]) == (16, "forward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert rep["reproduced"] is True and rep["cause"] == "underflow"
    assert (o["op"], o["module"], o["made"], o["samples"]) == ("aten.log", "", "-inf", [0])
    assert o["source"].startswith(source_line(MODELS, "torch.log(F.softmax(output, dim=1))"))
    assert "log_softmax instead of log(softmax)" in rep["hint"]
    # (names 0-2 took 3, 6 and 6 calls: backwards ended steps 2, 8 and 14; the note says the
    # step numbers count calls and where in its name the event is)
    assert any("step numbers count the model's calls, not the loop's iterations; step 16 is "
               "call 2 since the last backward, which ended step 14" in p
               for p in rep["problems"]), rep["problems"]


def test_transformer_lm_without_clipping_diverges_and_says_so(tmp_path):
    """The tutorial's SGD at lr 5 without ``clip_grad_norm_(0.5)``: the gradient norm jumps at
    step 4 and the first layer norm overflows in its sum of squares at step 11; the hint says
    the run was diverging (lower the lr or clip), not only to widen the type."""
    err = event_of(train_transformer, tmp_path, clip=False, epochs=3)
    assert (err.event["step"], err.event["phase"]) == (11, "forward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert rep["reproduced"] is True and rep["cause"] == "overflow"
    assert (o["op"], o["module"], o["made"]) == \
        ("aten.native_layer_norm", "transformer_encoder.layers.0.norm1", "nan")
    # (columns of the [seq_len, batch] input; which of them overflow first is chaos: [1, 3]
    # with conftest's one thread, all 4 with more)
    assert o["samples"] and set(o["samples"]) <= {0, 1, 2, 3}
    assert "the run was diverging" in rep["hint"] and "clip the gradients" in rep["hint"]
    assert {"grad_norm_jump", "loss_jump"} <= {p["kind"] for p in rep["precursors"]}


def test_healthy_amp_transformer_raises_no_event(tmp_path):
    """float16 autocast and a GradScaler, unscaled and clipped: no event, the same weights."""
    recorded = train_transformer(tmp_path, amp=True)
    plain = train_transformer(None, amp=True)
    assert list(tmp_path.rglob("*.nan")) == []
    _same_weights(recorded, plain)


class FirstNonFiniteOutput:
    """Forward hooks on every module of a model called once a step: the step, the module (its
    name and type), the kind made (NaN before +Inf before -Inf) and the batch columns of the
    first module output, in call order, holding a non-finite value that the module made (at
    entries whose input was finite, for an output shaped as its input: a Dropout fed an
    infinity passes it on). A call given an additive mask holding -inf (attention's
    ``attn_mask``: the causal mask) counts: the mask's -inf is intended, its data finite.
    Computes nothing the model computes (a run with it trains as one without it)."""

    def __init__(self, model: nn.Module):
        self.step, self.first, self.root = 0, None, model
        for name, module in model.named_modules():
            module.register_forward_hook(self.hook(name), with_kwargs=True)

    def hook(self, name: str):
        def check(module, args, kwargs, out):
            out = out[0] if isinstance(out, tuple) else out
            if self.first is None and isinstance(out, torch.Tensor) \
                    and out.is_floating_point():
                made = ~torch.isfinite(out)
                x = args[0] if args and isinstance(args[0], torch.Tensor) else None
                if x is not None and x.shape == out.shape:
                    made &= torch.isfinite(x)
                if made.any():
                    bad = out[made]
                    kind = "nan" if bad.isnan().any() else "+inf" if (bad == torch.inf).any() \
                        else "-inf"
                    columns = made.flatten(2).any(2).any(0)  # ([seq, batch, ...])
                    self.first = (self.step, name, type(module), kind,
                                  columns.nonzero().flatten().tolist())
            if module is self.root:
                self.step += 1
        return check


# the op a module's overflowing output comes from: a Linear's matmul with its bias (the
# attention's output projection's too), a Dropout's 1 / (1 - p) scaling of the kept entries
OVERFLOWING_OP = {nn.Linear: "aten.addmm", nn.MultiheadAttention: "aten.addmm",
                  nn.Dropout: "aten.mul"}


def test_amp_transformer_without_clipping_overflows_float16_and_says_it_diverged(tmp_path):
    """Under float16 autocast, without the clipping, the diverging activations pass float16's
    65504 in the second layer: where and when first, the trajectory's rounding decides (found
    by the same training without the recorder, with its own forward hooks): on an AMD EPYC
    at step 14 in its linear2's matmul, or with ``ATEN_CPU_CAPABILITY=avx2`` at step 13 in its
    self-attention's output projection, a call given the causal mask, whose -inf is intended
    (before, a chain never started in a call whose inputs held an infinity, and the report
    named the dropout after it, which only scaled the overflow on). An overflow of float16
    whose hint says the run was diverging, not only to compute the op in float32."""
    watched = []
    train_transformer(None, clip=False, epochs=3, amp=True,
                      watch=lambda m: watched.append(FirstNonFiniteOutput(m)))
    assert watched[0].first is not None, "the run without the recorder stayed finite"
    step, module, module_type, made, samples = watched[0].first
    assert step > 0 and samples  # (a divergence: its first steps were finite)
    err = event_of(train_transformer, tmp_path, clip=False, epochs=3, amp=True)
    assert (err.event["step"], err.event["phase"], err.event["module"]) == \
        (step, "forward", module)
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert rep["reproduced"] is True and rep["cause"] == "overflow"
    assert (o["op"], o["module"], o["made"], o["samples"]) == \
        (OVERFLOWING_OP[module_type], module, made, samples)
    assert "beyond float16's largest value" in rep["hint"]
    assert "the run was diverging" in rep["hint"] and "clip the gradients" in rep["hint"]


def test_adamw_amsgrad_with_eps0_names_the_rows_no_transition_reached(tmp_path):
    """Every sampled transition took action 0, so layer3's row for action 1 (and the hidden
    units the ReLUs closed) get gradients exactly 0; AdamW's m / (sqrt(v) + 0) is 0/0 there
    at the first update. An optimizer event, not re-run, whose hint names eps."""
    err = event_of(train_dqn, tmp_path, eps=0.0, action=0)
    assert (err.event["step"], err.event["phase"]) == (0, "optimizer")
    rep = nanreplay_json(err.bundle_path, code=1)
    assert rep["cause"] == "optimizer"
    assert "layer3.weight" in rep["origin"]["params"]
    assert "eps=0" in rep["hint"] and "whose gradient was all 0" in rep["hint"]
    # (rows of a Linear are output units: a Q-value no transition's action took, a unit a
    # ReLU closed; no entries absent from the batch, as an embedding's are)
    assert "(an output unit no sample's loss reached" in rep["hint"]
    assert "absent from the batch" not in rep["hint"]


def test_corrupt_digit_image_is_an_input_event_on_its_row(tmp_path):
    """Image 37 decoded to NaN pixels: batch 2 (of 16), row 5, before the localization net."""
    err = event_of(train_stn, tmp_path, corrupt=37)
    assert (err.event["step"], err.event["phase"]) == (2, "input")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert rep["reproduced"] is True and rep["cause"] == "input"
    assert (o["tensor"], o["made"], o["samples"]) == ("batch", "nan", [5])


def test_polynomial_fit_at_100x_the_learning_rate_is_a_divergence_not_the_data(tmp_path):
    """The hand update at lr 5e-4 moves d from 0.3 to 2e6 in two steps; the loss's square of
    a 1e27 prediction overflows. The report names aten.pow in the loss. It used to add that
    samples 0..1999 but the six nearest x = 0 were 'out of scale, 400x the other rows'
    largest': most of the batch standing above a few rows near 0 is a grid's range, not
    corrupt records. With one step before it, the loss's and the gradient norm's jumps at
    step 1 (4.4e6x, 7.8e5x) were no precursors (two steps were needed for a median); a
    thousandfold jump is one from a single step, and the hint says the run was diverging."""
    err = event_of(train_polynomial, tmp_path, learning_rate=5e-4)
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (2, "loss", "<loss>")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert rep["reproduced"] is True and rep["cause"] == "overflow"
    assert (o["op"], o["module"], o["made"]) == ("aten.pow", "<loss>", "+inf")
    assert o["source"].startswith(source_line(MODELS, "return (y_pred - y).pow(2).sum()"))
    assert len(o["samples"]) == 1994 and 999 not in o["samples"]
    assert "out of scale" not in rep["hint"]
    assert "the run was diverging" in rep["hint"] and "lower the learning rate" in rep["hint"]
    assert {(p["step"], p["kind"]) for p in rep["precursors"]} >= \
        {(1, "grad_norm_jump"), (1, "loss_jump")}
    # (one call of the model per backward: no note that the steps count calls)
    assert not any("count the model's calls" in p for p in rep["problems"])


def test_hand_written_norm_of_an_unknown_text_is_a_backward_only_nan(tmp_path):
    """Text 13 (batch 1, row 5) is all ``<unk>``, whose embedding row starts at 0: the bag's
    mean is 0, sqrt(0) = 0 is finite, and SqrtBackward0's 1 / (2 sqrt(0)) makes the
    embedding's gradient non-finite."""
    err = event_of(train_text, tmp_path, factory="make_text_classifier_with_norm", unknown=13)
    assert (err.event["step"], err.event["phase"]) == (1, "backward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    assert (o["op"], o["module"], o["samples"], o["params"]) == \
        ("SqrtBackward0", "", [5], ["embedding.weight"])
    assert o["source"].startswith(source_line(MODELS, "torch.sqrt((embedded ** 2).sum("))
    assert "torch.linalg.vector_norm" in rep["hint"]


def test_nan_reward_from_the_environment_is_the_losss_target_on_its_row(tmp_path):
    """Transition 6 of the replay sample at step 2 carries a NaN reward (an environment's
    reward of a crashed episode): the policy's Q-values are finite, the expected values the
    loop built from the reward and the target network are not. An input event of the loss's
    target, on that row, which says the loop or the data made it."""
    err = event_of(train_dqn, tmp_path, nan_reward=(2, 6))
    assert (err.event["step"], err.event["phase"]) == (2, "input")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert rep["reproduced"] is True and rep["cause"] == "input"
    assert (o["tensor"], o["made"], o["samples"]) == ("loss_args[1]", "nan", [6])
    assert "an argument of the loss, not data the model took" in rep["hint"]

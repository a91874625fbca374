"""The official pytorch/examples training scripts, ported tiny (tests/pytorch_examples_models.py)
and run under the flight recorder as a user adds it to them: word_language_model's hand-written
SGD update (no optimizer), dcgan's two optimizers and hand-written BCE, vae's summed BCE + KLD,
time_sequence_prediction's LBFGS closure, REINFORCE's normalised returns, the siamese network's
two inputs, and mnist_forward_forward's layers with the Adam each builds for itself."""

from __future__ import annotations

import math

import pytest
import pytorch_examples_models as M
import torch
import torch.nn.functional as F
from bundles import nanreplay_json, source_line
from torch import nn
from torch.distributions import Categorical

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

MODELS = "pytorch_examples_models.py"


def _origin(rep) -> tuple:
    o = rep["origin"]
    return rep["event"]["step"], o["module"], o["op"], rep["cause"], o["samples"]


def _the_bundle(out_dir):
    (bundle,) = sorted(out_dir.glob("*.nan"))
    return bundle


# --- word_language_model -------------------------------------------------------------------

def _train_lm(out_dir=None, kind="LSTM", steps=6, lr=20.0, clip=0.25):
    """main.py's train(): BPTT batches, repackage_hidden, clip_grad_norm_, and the update
    written by hand (p.data.add_(p.grad, alpha=-lr)); the recorder has no optimizer. The
    Transformer takes its causal mask (a float mask holding -inf) as an argument."""
    model = M.make_rnn_lm() if kind == "LSTM" else M.make_transformer_lm()
    criterion = nn.NLLLoss()
    train_data = M.batchify(M.corpus(max(400, 4 * steps * M.BPTT + 8)), 4)
    torch.manual_seed(1)
    losses = []

    def epoch():
        model.train()
        hidden = model.init_hidden(4) if kind == "LSTM" else None
        for i in range(0, steps * M.BPTT, M.BPTT):
            data, targets = M.get_batch(train_data, i)
            model.zero_grad()
            if kind == "LSTM":
                hidden = M.repackage_hidden(hidden)
                output, hidden = model(data, hidden)
            else:
                output = model(data, model._generate_square_subsequent_mask(len(data)))
            loss = criterion(output.view(-1, M.NTOKEN), targets)
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr)
            losses.append(loss.item())

    if out_dir is None:
        epoch()
    else:
        with FlightRecorder(model, None, loss_fn=criterion, out_dir=out_dir,
                            factory="pytorch_examples_models:make_rnn_lm"
                            if kind == "LSTM" else "pytorch_examples_models:make_transformer_lm"):
            epoch()
    return model, losses


@pytest.mark.parametrize("kind", ["LSTM", "Transformer"])
def test_healthy_word_language_model_raises_nothing_and_trains_bit_identically(tmp_path, kind):
    """The recorder changes nothing: same losses and weights, bit for bit, and no bundle."""
    plain, plain_losses = _train_lm(kind=kind)
    recorded, rec_losses = _train_lm(tmp_path, kind=kind)
    assert len(rec_losses) == 6 and all(map(math.isfinite, rec_losses))
    assert rec_losses == plain_losses
    for (n, a), b in zip(plain.state_dict().items(), recorded.state_dict().values()):
        assert torch.equal(a, b), n
    assert not list(tmp_path.glob("*.nan"))


def _dcgan(out_dir, record_d: bool) -> NonFiniteError:
    """main.py's loop with one ``label`` tensor filled in place for each loss (as the example
    does), the BCE written out by hand and optimizerD's lr far too high; netD recorded with
    optimizerD, or netG with optimizerG."""
    netG, netD = M.make_netG(), M.make_netD()
    criterion = M.BCE()
    optimizerD = torch.optim.Adam(netD.parameters(), lr=0.3, betas=(0.5, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=0.0002, betas=(0.5, 0.999))
    model, opt, name = (netD, optimizerD, "make_netD") if record_d else \
        (netG, optimizerG, "make_netG")
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=criterion, out_dir=out_dir,
                            factory=f"pytorch_examples_models:{name}"):
            for i in range(4):
                netD.zero_grad()
                real_cpu = M.real_images(i)
                label = torch.full((real_cpu.size(0),), 1.0)
                criterion(netD(real_cpu), label).backward()
                fake = netG(torch.randn(real_cpu.size(0), M.NZ, 1, 1))
                label.fill_(0.0)
                criterion(netD(fake.detach()), label).backward()
                optimizerD.step()
                netG.zero_grad()
                label.fill_(1.0)
                criterion(netD(fake), label).backward()
                optimizerG.step()
    return info.value


def test_dcgan_generator_recorded_label_filled_between_its_two_losses_is_re_run(tmp_path):
    """netG recorded with optimizerG: in its step D's loss on the detached fakes took
    ``label`` (0), the loop filled it with 1, and the generator's loss took it, NaN where D
    scored a fake exactly 1.0. The write into the first call's target marked the micro-batch's
    targets as changed, so the replay refused to re-run ('loss targets written after the
    loss') though the call kept, the NaN one, took them after that write. Only the kept call's
    targets count now; and D's output, which the loss took with a graph (D is no part of the
    recorded model), is no longer read as the batch's data ('a degenerate record')."""
    err = _dcgan(tmp_path, record_d=False)
    ev = err.event
    assert (ev["step"], ev["phase"], ev["micro_batch"]) == (0, "loss", 0)
    assert "wrote into the loss's targets" not in ev["detail"]
    rep = nanreplay_json(err.bundle_path)
    assert rep["reproduced"] is True and rep["not_rerun"] is None
    assert _origin(rep) == (0, "<loss>", "aten.log", "invalid", [2, 3, 4, 6])
    assert "binary_cross_entropy_with_logits" in rep["hint"]
    assert "degenerate" not in rep["hint"], rep["hint"]


# --- vae -----------------------------------------------------------------------------------

def test_vae_nan_image_is_the_input_event_of_its_batch_sample(tmp_path):
    """A corrupt record (image 37 all NaN), loaded by two workers, reaches
    binary_cross_entropy, which raises on the NaN reconstruction; the recorder checks the
    cut-short step and names the batch row."""
    model = M.make_vae()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = M.mnist_loader(bad=(37, float("nan")), num_workers=2)
    with pytest.raises(RuntimeError, match="between 0 and 1"):
        with FlightRecorder(model, optimizer, loss_fn=M.vae_loss_function, out_dir=tmp_path,
                            factory="pytorch_examples_models:make_vae") as rec:
            model.train()
            for data, _ in loader:
                optimizer.zero_grad()
                recon_batch, mu, logvar = model(data)
                loss = rec.loss_fn(recon_batch, data, mu, logvar)
                loss.backward()
                optimizer.step()
    del loader  # (its workers, before a later garbage collection waits for them)
    rep = nanreplay_json(_the_bundle(tmp_path))
    assert rep["reproduced"] is True
    assert _origin(rep) == (2, None, None, "input", [37 - 32])
    assert rep["origin"]["tensor"] == "batch"


def test_transformer_lm_without_clipping_diverges_to_a_layer_norm_overflow(tmp_path):
    """--clip dropped from the Transformer LM's hand-written SGD at the example's lr of 20: the
    loss jumps at step 2 and at step 7 layer norm's variance overflows float32 in every
    column of the batch (sequence-first); the hint says to clip, not to widen the type."""
    with pytest.raises(NonFiniteError) as info:
        _train_lm(tmp_path, kind="Transformer", steps=20, clip=None)
    rep = nanreplay_json(info.value.bundle_path)
    assert rep["reproduced"] is True
    assert _origin(rep) == (7, "encoder.layers.1.norm1", "aten.native_layer_norm", "overflow",
                            [0, 1, 2, 3])
    assert "clip the gradients" in rep["hint"], rep["hint"]
    assert any(p["kind"] == "grad_norm_jump" and p["step"] == 2 for p in rep["precursors"])


# --- vae (diverging) -----------------------------------------------------------------------

def test_vae_at_lr_1_overflows_exp_in_reparameterize(tmp_path):
    """Adam at lr 1.0 (--lr typed for SGD): the weights jump 15x in step 1 and at step 2 the
    encoder's logvar is so large that reparameterize's exp(0.5 * logvar) overflows for every
    row; binary_cross_entropy then raises on the NaN reconstruction. The root's own code is
    named (the VAE's forward), with the exp's line and the divergence."""
    model = M.make_vae()
    optimizer = torch.optim.Adam(model.parameters(), lr=1.0)
    loader = M.mnist_loader(n=64)
    with pytest.raises(RuntimeError, match="between 0 and 1"):
        with FlightRecorder(model, optimizer, loss_fn=M.vae_loss_function, out_dir=tmp_path,
                            factory="pytorch_examples_models:make_vae") as rec:
            for _ in range(3):
                for data, _ in loader:
                    optimizer.zero_grad()
                    recon_batch, mu, logvar = model(data)
                    rec.loss_fn(recon_batch, data, mu, logvar).backward()
                    optimizer.step()
    rep = nanreplay_json(_the_bundle(tmp_path))
    assert rep["reproduced"] is True
    assert _origin(rep) == (2, "", "aten.exp", "overflow", list(range(16)))
    assert rep["origin"]["source"] == source_line(MODELS, "std = torch.exp(0.5 * logvar)")
    assert "lower the learning rate" in rep["hint"]


# --- dcgan ---------------------------------------------------------------------------------

def test_dcgan_hand_written_bce_of_a_saturated_sigmoid_is_precision_not_the_fakes(tmp_path):
    """netD recorded with optimizerD (lr far too high) and the BCE written out by hand. After
    D's first update its sigmoid gives exactly 1.0 on the generator's fakes: the generator's
    step (micro-batch 0 of D's step 1) takes (1 - label) * log(1 - 1) = 0 * -inf = NaN, and
    optimizerG, not recorded, steps G on it, so the next fakes are NaN. The report named the
    NaN fakes of micro-batch 2 as bad input with no sample, though the event was micro-batch
    0's loss, computed before them; now the loss is the origin: log's pole at the rounded 1."""
    err = _dcgan(tmp_path, record_d=True)
    ev = err.event
    assert (ev["step"], ev["phase"], ev["micro_batch"]) == (1, "loss", 0)
    rep = nanreplay_json(err.bundle_path)
    assert rep["reproduced"] is True
    assert _origin(rep) == (1, "<loss>", "aten.log", "precision", [2, 3, 4, 6])
    assert rep["origin"]["source"] == source_line(MODELS, "(1 - label) * torch.log(1 - output)")
    assert "binary_cross_entropy_with_logits" in rep["hint"]


# --- time_sequence_prediction --------------------------------------------------------------

def test_lbfgs_closure_on_a_sine_wave_with_a_missing_value(tmp_path):
    """LBFGS's closure runs the forward inside step(); row 7 of the waves (sample 4 of the
    training rows 3:) has a NaN at time 11: the input event of closure evaluation 0."""
    data = M.sine_waves()
    data[7, 11] = float("nan")
    input, target = data[3:, :-1], data[3:, 1:]
    seq = M.make_sequence()
    criterion = nn.MSELoss()
    optimizer = torch.optim.LBFGS(seq.parameters(), lr=0.8, max_iter=4)

    def closure():
        optimizer.zero_grad()
        loss = criterion(seq(input), target)
        loss.backward()
        return loss

    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(seq, optimizer, loss_fn=criterion, out_dir=tmp_path,
                            factory="pytorch_examples_models:make_sequence"):
            for _ in range(2):
                optimizer.step(closure)
    rep = nanreplay_json(info.value.bundle_path)
    assert _origin(rep) == (0, None, None, "input", [4])
    assert "feature(s) 11" in rep["hint"]


def _lbfgs_run():
    """time_sequence_prediction's LBFGS set-up in float32 at lr 5, without a line search: the
    model, its loss, the optimizer, its closure and the batch."""
    data = M.sine_waves(n=20, length=40)
    input, target = data[3:, :-1], data[3:, 1:]
    seq = M.make_sequence()
    criterion = nn.MSELoss()
    optimizer = torch.optim.LBFGS(seq.parameters(), lr=5)

    def closure():
        optimizer.zero_grad()
        loss = criterion(seq(input), target)
        loss.backward()
        return loss

    return seq, criterion, optimizer, closure, (input, target)


def test_lbfgs_float32_without_line_search_diverges_to_an_mse_overflow(tmp_path):
    """The example runs LBFGS in float64 at lr 0.8; in float32 at lr 5, without a line
    search, the quasi-Newton steps diverge and mse_loss overflows at a closure evaluation
    around 30: which one follows the rounding of the CPU's kernels (29 on one, 31 on another),
    so a plain run that counts its evaluations gives it; the hint names the missing line
    search."""
    seq, criterion, optimizer, _, (input, target) = _lbfgs_run()
    evaluations = []

    class Overflowed(Exception):
        pass

    def counting():  # (the closure, stopping at the first non-finite loss)
        optimizer.zero_grad()
        out = seq(input)
        loss = criterion(out, target)
        evaluations.append((bool(torch.isfinite(out).all()), loss.item()))
        if not math.isfinite(evaluations[-1][1]):
            raise Overflowed
        loss.backward()
        return loss

    with pytest.raises(Overflowed):
        for _ in range(8):
            optimizer.step(counting)
    at = len(evaluations) - 1
    # (an overflow: the model's outputs finite, their squared errors' mean +inf)
    assert evaluations[-1] == (True, math.inf), evaluations[-3:]

    seq, criterion, optimizer, closure, _ = _lbfgs_run()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(seq, optimizer, loss_fn=criterion, out_dir=tmp_path,
                            factory="pytorch_examples_models:make_sequence"):
            for _ in range(8):
                optimizer.step(closure)
    rep = nanreplay_json(info.value.bundle_path)
    step, module, op, cause, _ = _origin(rep)
    assert (step, module, op, cause) == (at, "<loss>", "aten.mse_loss", "overflow")
    assert 'line_search_fn="strong_wolfe"' in rep["hint"]


# --- reinforcement_learning ----------------------------------------------------------------

@pytest.mark.filterwarnings("ignore::UserWarning")  # (torch.std of one value, in the replay too)
def test_reinforce_one_step_episode_normalises_returns_by_a_nan_std(tmp_path):
    """finish_episode's (R - mean) / (std + eps): an episode of one step has an unbiased std
    of 0/0, which eps does not help. The loss function computing it is named, with aten.std."""
    policy = M.make_policy()
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
    env = M.CartPole()
    with pytest.raises(NonFiniteError) as info, pytest.warns(UserWarning, match="std"):
        with FlightRecorder(policy, optimizer, loss_fn=M.reinforce_loss, out_dir=tmp_path,
                            factory="pytorch_examples_models:make_policy") as rec:
            for i_episode in range(6):
                state = env.reset(length=1 if i_episode == 3 else 5)
                log_probs, rewards = [], []
                for _ in range(1, 10000):
                    action, log_prob = M.select_action(policy, state)
                    log_probs.append(log_prob)
                    state, reward, done = env.step(action)
                    rewards.append(reward)
                    if done:
                        break
                optimizer.zero_grad()
                rec.loss_fn(torch.cat(log_probs), torch.tensor(rewards)).backward()
                optimizer.step()
    rep = nanreplay_json(info.value.bundle_path)
    assert rep["reproduced"] is True
    assert _origin(rep) == (3, "<loss>", "aten.std", "invalid", [])
    assert rep["origin"]["source"] == source_line(MODELS, "(returns.std() + EPS)")
    assert "over an episode of one step" in rep["hint"], rep["hint"]


def test_actor_critic_loss_in_the_loop_is_said_to_enter_the_value_head(tmp_path):
    """actor_critic.py computes its loss in the loop (smooth_l1_loss on a NaN normalised
    return of a one-step episode): the recorder sees the NaN gradient entering the value head
    (model output 1) at step 3, which nothing the model did made; no op can be named."""
    model = M.make_actor_critic()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-2)
    env = M.CartPole()
    with pytest.raises(NonFiniteError) as info, pytest.warns(UserWarning, match="std"):
        with FlightRecorder(model, optimizer, out_dir=tmp_path,
                            factory="pytorch_examples_models:make_actor_critic"):
            for i_episode in range(6):
                state = env.reset(length=1 if i_episode == 3 else 5)
                saved_actions, rewards = [], []
                for _ in range(1, 10000):
                    probs, state_value = model(state.float())
                    m = Categorical(probs)
                    action = m.sample()
                    saved_actions.append((m.log_prob(action), state_value))
                    state, reward, done = env.step(action.item())
                    rewards.append(reward)
                    if done:
                        break
                R, policy_losses, value_losses, returns = 0.0, [], [], []
                for r in rewards[::-1]:
                    R = r + 0.99 * R
                    returns.insert(0, R)
                returns = torch.tensor(returns)
                returns = (returns - returns.mean()) / (returns.std() + M.EPS)
                for (log_prob, value), R in zip(saved_actions, returns):
                    advantage = R - value.item()
                    policy_losses.append(-log_prob * advantage)
                    value_losses.append(F.smooth_l1_loss(value, torch.tensor([R])))
                optimizer.zero_grad()
                loss = torch.stack(policy_losses).sum() + torch.stack(value_losses).sum()
                loss.backward()
                optimizer.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (3, "backward")
    rep = nanreplay_json(info.value.bundle_path)
    assert rep["cause"] is None and rep["origin"]["phase"] == "loss", rep["origin"]
    assert "loss was computed outside the recorder" in rep["hint"]


# --- siamese_network -----------------------------------------------------------------------

def test_siamese_second_image_inf_names_the_second_argument_and_its_row(tmp_path):
    """model(images_1, images_2): an overflowed image in the second input, row 6 of batch 4;
    BCELoss raises on the NaN score it leads to, after which the recorder names it."""
    model = M.make_siamese()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    criterion = nn.BCELoss()
    with pytest.raises(RuntimeError, match="between 0 and 1"):
        with FlightRecorder(model, optimizer, loss_fn=criterion, out_dir=tmp_path,
                            factory="pytorch_examples_models:make_siamese"):
            for batch_idx in range(6):
                images_1, images_2, targets = M.pair_batch(batch_idx)
                if batch_idx == 4:
                    images_2[6] = float("inf")
                optimizer.zero_grad()
                loss = criterion(model(images_1, images_2).squeeze(), targets.squeeze())
                loss.backward()
                optimizer.step()
    rep = nanreplay_json(_the_bundle(tmp_path))
    assert _origin(rep) == (4, None, None, "input", [6])
    assert rep["origin"]["tensor"] == "args[1]"


# --- super_resolution ----------------------------------------------------------------------

def test_super_resolution_fp16_autocast_overflow_of_an_unscaled_16_bit_image(tmp_path):
    """The Net (PixelShuffle) under float16 autocast with a GradScaler; image 2 of batch 3 is a
    16-bit PNG never divided by 65535: conv1 overflows float16 on that row alone."""
    model = M.make_srnet()
    criterion = nn.MSELoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, optimizer, loss_fn=criterion, scaler=scaler,
                            out_dir=tmp_path, factory="pytorch_examples_models:make_srnet"):
            for iteration in range(6):
                input, target = M.bsds_batch(iteration)
                if iteration == 3:
                    input[2] *= 65535.0
                    target[2] *= 65535.0
                optimizer.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = criterion(model(input), target)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
    rep = nanreplay_json(info.value.bundle_path)
    assert _origin(rep) == (3, "conv1", "aten.convolution", "overflow", [2])
    assert rep["origin"]["source"] == source_line(MODELS, "x = self.relu(self.conv1(x))")
    assert "out of scale" in rep["hint"]


# --- mnist_forward_forward -----------------------------------------------------------------

def test_forward_forward_layer_called_through_forward_is_said_unrecorded(tmp_path):
    """Layer.train calls self.forward(x_pos): no hook runs, so no step opens and only the
    last update's check, as the recorder detaches, sees the weights NaN (the loss's
    log(1 + exp(.)) overflowed at the first step, its gradient NaN). The report said
    'optimizer: finite gradients became non-finite weights in optimizer.step()' at step -1
    and to record with guard_optimizer=True, none of which is so; now it says no step was
    recorded and to call the model itself."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(32, 20, generator=g)
    y = torch.randint(0, 10, (32,), generator=g)
    x_pos, x_neg = M.overlay_y_on_x(x, y), M.overlay_y_on_x(x, (y + 3) % 10)
    layer = M.make_ff_layer(threshold=120.0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(layer, layer.opt, loss_fn=M.ff_loss, out_dir=tmp_path,
                            factory="pytorch_examples_models:make_ff_layer",
                            factory_kwargs={"threshold": 120.0}) as rec:
            for _ in range(3):
                g_pos = layer.forward(x_pos).pow(2).mean(1)
                g_neg = layer.forward(x_neg).pow(2).mean(1)
                loss = rec.loss_fn(g_pos, g_neg, layer.threshold)
                layer.opt.zero_grad()
                loss.backward()
                layer.opt.step()
    assert info.value.event["phase"] == "optimizer"
    rep = nanreplay_json(info.value.bundle_path, code=1)  # (not reproduced)
    assert rep["reproduced"] is False and rep["cause"] == "not_reproduced", rep["cause"]
    assert rep["origin"]["params"] == ["weight", "bias"]
    hint = rep["hint"]
    assert "finite gradients" not in hint and "guard_optimizer" not in " ".join(
        rep["problems"]), (hint, rep["problems"])
    assert "no step of the model was recorded" in hint and "not model.forward(x)" in hint


def test_forward_forward_layer_called_as_a_module_is_caught_at_its_overflow(tmp_path):
    """The same layer called as layer(x): the loss's exp overflows at step 0 and the step is
    caught before the update, with the op and the cause."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(32, 20, generator=g)
    y = torch.randint(0, 10, (32,), generator=g)
    x_pos, x_neg = M.overlay_y_on_x(x, y), M.overlay_y_on_x(x, (y + 3) % 10)
    layer = M.make_ff_layer(threshold=120.0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(layer, layer.opt, loss_fn=M.ff_loss, out_dir=tmp_path,
                            factory="pytorch_examples_models:make_ff_layer",
                            factory_kwargs={"threshold": 120.0}) as rec:
            for _ in range(3):
                g_pos = layer(x_pos).pow(2).mean(1)
                g_neg = layer(x_neg).pow(2).mean(1)
                loss = rec.loss_fn(g_pos, g_neg, layer.threshold)
                layer.opt.zero_grad()
                loss.backward()
                layer.opt.step()
    rep = nanreplay_json(info.value.bundle_path)
    step, module, op, cause, _ = _origin(rep)
    assert (step, module, op, cause) == (0, "<loss>", "aten.exp", "overflow"), rep["hint"]

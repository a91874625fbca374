"""End to end: training loops off the beaten path (progressive unfreezing, ...), recorded
and replayed as a user runs them."""

from __future__ import annotations

import json
from pathlib import Path

import loop_models as LM
import pytest
import torch
from bundles import invoke_cli, nanreplay_json
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from recorder.foreign import WARNING

pytestmark = pytest.mark.usefixtures("in_tests_dir")


@pytest.mark.parametrize("unfreeze", ["requires_grad", "add_param_group"])
def test_unfrozen_encoder_nan_gradient_is_a_backward_event(out_dir, unfreeze):
    """The encoder is frozen for a warm-up, then unfrozen: either the optimizer held it all
    along (``requires_grad_(True)``) or it is given to it then (``add_param_group``). A blank
    record at step 6 makes its gradient NaN; the recorder missed the gradients of parameters
    that did not train at attach, so the NaN went through the update and the report blamed
    the optimizer (or weights written outside it)."""
    model = LM.make_fine_tuned()
    held = model.parameters() if unfreeze == "requires_grad" else model.classifier.parameters()
    opt = torch.optim.AdamW(held, lr=1e-3)
    crit = nn.CrossEntropyLoss()
    model.encoder.requires_grad_(False)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="loop_models:make_fine_tuned"):
            for step in range(10):
                if step == 3:
                    model.encoder.requires_grad_(True)
                    if unfreeze == "add_param_group":
                        opt.add_param_group({"params": list(model.encoder.parameters()),
                                             "lr": 1e-4})
                x, y = LM.fine_tune_batch(step, blank=5 if step == 6 else None)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    event = info.value.event
    assert (event["step"], event["phase"]) == (6, "backward")
    assert event["params"] == ["encoder.proj.weight"]
    assert torch.isfinite(model.encoder.proj.weight).all()  # stopped before the update
    report = nanreplay_json(info.value.bundle_path)
    origin = report["origin"]
    assert (origin["phase"], origin["module"], origin["op"]) == \
        ("backward", "encoder", "SqrtBackward0")
    assert origin["samples"] == [5]
    assert report["cause"] == "invalid"


def unfreeze_with_a_typo(out_dir: Path, **kw) -> NonFiniteError:
    """Progressive unfreezing: the backbone joins the optimizer at step 8 in a group of its
    own whose learning rate is 1e5 times the head's (a typo: 1e4 for 1e-4). Its weights blow
    up and a forward overflows a few steps later."""
    torch.manual_seed(0)
    model = LM.make_backboned()
    model.backbone.requires_grad_(False)
    opt = torch.optim.SGD(model.head.parameters(), lr=0.1, momentum=0.9)
    crit = nn.CrossEntropyLoss()
    x_all = torch.randn(512, 20)
    y_all = x_all[:, :5].argmax(1)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="loop_models:make_backboned", **kw):
            for step in range(40):
                if step == 8:
                    model.backbone.requires_grad_(True)
                    opt.add_param_group({"params": list(model.backbone.parameters()),
                                         "lr": 1e4, "momentum": 0.9})
                i = (step * 32) % 512
                opt.zero_grad()
                crit(model(x_all[i:i + 32]), y_all[i:i + 32]).backward()
                opt.step()
    assert info.value.event["step"] > 8
    return info.value


def test_unfrozen_group_with_a_huge_lr_is_the_precursor(out_dir):
    """The new group's rate had no earlier rates to jump from, so no precursor named it, and
    the backbone's first layer jumping (its weights, written by that update) was read as the
    input batch's absmax jumping."""
    report = nanreplay_json(unfreeze_with_a_typo(out_dir).bundle_path)
    lr_jumps = [p for p in report["precursors"] if p["kind"] == "lr_jump"]
    assert [p["step"] for p in lr_jumps] == [8]
    assert "(group 1) 1e+04, of a group added at step 8, is 1e+05x" in lr_jumps[0]["detail"]
    assert not any("input batch" in p["detail"] for p in report["precursors"])


def lbfgs_bundle(out_dir: Path) -> Path:
    """A heteroscedastic fit trained with LBFGS whose unconstrained scale goes negative in one
    of the closure's evaluations after an inner update: log(sigma) is NaN."""
    model = LM.make_mean_and_scale()
    opt = torch.optim.LBFGS(model.parameters(), lr=1.0, max_iter=10, history_size=10)
    torch.manual_seed(0)
    x = torch.linspace(-3, 3, 256).unsqueeze(1)
    y = torch.sin(2 * x) + 0.1 * torch.randn_like(x) * (1 + x.abs())
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=LM.gaussian_nll, out_dir=out_dir,
                            factory="loop_models:make_mean_and_scale") as rec:
            for _ in range(5):
                def closure():
                    opt.zero_grad()
                    loss = rec.loss_fn(model(x), y)
                    loss.backward()
                    return loss
                opt.step(closure)
    assert (info.value.event["phase"], info.value.event["micro_batch"]) == ("loss", 0)
    return info.value.bundle_path


def test_rewind_window_across_add_param_group(out_dir):
    """The rewind window (copy at step 8 or before) spans the step where the backbone's group
    was added. The re-run trained that group from the window's first step, as the rebuilt
    optimizer has it from the start: the event came back early, the loop was said to clip its
    gradients (it does not), and the growth said to begin before the window. Steps before a
    group was added now leave its parameters untouched."""
    err = unfreeze_with_a_typo(out_dir, rewind=6)
    report = nanreplay_json(err.bundle_path, "--try", "lr=1e-4")
    w = report["window"]
    assert w["steps"][0] < 8 < w["steps"][1]
    assert w["reproduced"] and w["first_non_finite"]["step"] == err.event["step"]
    assert w["loop_clip"] is None
    assert w["precursors_began"]["step"] == 8
    assert report["what_if"][0]["finite"] is True


def test_lbfgs_inner_evaluation_is_replayed_as_its_own_step(out_dir):
    """LBFGS evaluates its closure again after each inner update. Those evaluations joined
    the next step as micro-batches run on other weights than the bundle's, so the replay of a
    NaN made in one of them found the re-run differing from training and blamed the factory.
    Each evaluation is now a step of its own."""
    report = nanreplay_json(lbfgs_bundle(out_dir))
    assert report["reproduced"] and report["fidelity"]["matches"]
    origin = report["origin"]
    assert (origin["module"], origin["op"], report["cause"]) == ("<loss>", "aten.log", "invalid")


def test_lbfgs_what_if_re_runs_the_step_without_its_update(out_dir):
    """A what-if re-runs the recorded step and then its update, and LBFGS.step() cannot run
    without its closure: every try 'failed: ... missing 1 required positional argument:
    closure'. Now the step is re-run without the update (said in a note when the update
    matters: a window of several steps, an optimizer event)."""
    bundle = lbfgs_bundle(out_dir)
    report = nanreplay_json(bundle, "--try", "auto")
    # without the rows whose scale went negative, the step is finite
    (tried,) = report["what_if"]
    assert tried["try"] == "drop=" + ",".join(map(str, report["origin"]["samples"]))
    assert "error" not in tried and tried["finite"] is True and not tried["inconclusive"]


def test_resume_with_a_nan_in_adam_state_names_that_state(out_dir, tmp_path):
    """A run resumed from a checkpoint whose Adam second moment holds a NaN (one row of the
    embedding): the next update of that row writes NaN into the weights. The report said
    'finite gradients became non-finite weights: check the learning rate, eps, clip', which
    no change of those fixes; it now names the state that was already NaN before the
    update and says to resume from a checkpoint whose optimizer state is finite."""
    crit = nn.CrossEntropyLoss()
    model = LM.make_bag_of_tokens()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(3):
        tok = torch.randint(0, 50, (8, 6))
        opt.zero_grad()
        crit(model(tok), tok[:, 0]).backward()
        opt.step()
    ckpt = {"model": model.state_dict(), "opt": opt.state_dict()}
    ckpt["opt"]["state"][0]["exp_avg_sq"][7, 3] = float("nan")  # a bad checkpoint
    torch.save(ckpt, tmp_path / "ckpt.pt")
    model = LM.make_bag_of_tokens()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, guard_optimizer=True,
                            factory="loop_models:make_bag_of_tokens"):
            for step in range(8):
                if step == 2:  # resume
                    ckpt = torch.load(tmp_path / "ckpt.pt")
                    model.load_state_dict(ckpt["model"])
                    opt.load_state_dict(ckpt["opt"])
                tok = torch.randint(0, 50, (8, 6))
                tok[:, 1] = 7  # token 7 in every record: its row is updated
                opt.zero_grad()
                crit(model(tok), tok[:, 0]).backward()
                opt.step()
    event = info.value.event
    assert (event["step"], event["phase"], event["params"]) == (2, "optimizer", ["emb.weight"])
    report = nanreplay_json(info.value.bundle_path)
    assert report["reproduced"] and report["cause"] == "optimizer"
    assert "its state exp_avg_sq of emb.weight already held nan before this update" \
        in report["hint"]
    assert "resume from a checkpoint whose optimizer state is finite" in report["hint"]


@pytest.mark.parametrize("kernel", ["fused", "foreach"])
def test_fused_adam_eps0_update_names_the_op(out_dir, kernel):
    """Adam(fused=True) (or foreach=True, the default on CUDA) with eps=0 from a config: the
    embedding rows of tokens absent from the batch have m = v = 0 and the update makes 0/0.
    With guard_optimizer the replay re-ran the update with the recorded kernel, where no op
    can be named ('nan made by parameter emb.weight'); it now re-runs it per parameter, as
    the rewind window does, and names aten.addcdiv_."""
    torch.manual_seed(0)
    model = LM.make_tagger()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=0.0, **{kernel: True})
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, guard_optimizer=True,
                            factory="loop_models:make_tagger"):
            for _ in range(3):
                tok = torch.randint(0, 50, (8, 12))  # only the first 50 tokens occur
                opt.zero_grad()
                crit(model(tok).flatten(0, 1), (tok % 5).flatten()).backward()
                opt.step()
    assert (info.value.event["step"], info.value.event["phase"]) == (0, "optimizer")
    report = nanreplay_json(info.value.bundle_path, "--try", "eps=1e-8")
    origin = report["origin"]
    assert (origin["op"], origin["param"], report["cause"]) == \
        ("aten.addcdiv_", "emb.weight", "optimizer")
    assert "with eps=0" in report["hint"]
    assert report["what_if"][0]["finite"] is True


def test_module_shared_by_encoder_and_decoder_is_rebuilt(out_dir):
    """An autoencoder whose decoder reuses the encoder's embedding module (and ties its
    output projection to it): the replay stopped with 'replay failed (KeyError: 1400...)' while
    loading the weights, as the shared module yields its parameter twice and the second time
    it was the replacement. It now names the log of the underflowed softmax."""
    torch.manual_seed(0)
    model = LM.make_tied_autoencoder()
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    crit = nn.NLLLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="loop_models:make_tied_autoencoder"):
            for _ in range(50):
                tok = torch.randint(0, 40, (16, 10))
                opt.zero_grad()
                crit(model(tok).flatten(0, 1), tok.flatten()).backward()
                opt.step()
    report = nanreplay_json(info.value.bundle_path)
    origin = report["origin"]
    assert report["reproduced"] and report["fidelity"]["matches"]
    assert (origin["module"], origin["op"], origin["made"], report["cause"]) == \
        ("decoder", "aten.log", "-inf", "underflow")


def test_hand_written_update_without_optimizer_is_named_as_the_writer(out_dir):
    """A loop with no optimizer object (``p -= lr * p.grad``), an inverse-sqrt schedule whose
    offset makes rsqrt(0) = inf at step 5: the next step's weights are NaN. The hint said to
    find what writes weights outside optimizer.step() and resume from a checkpoint; with no
    optimizer recorded it now names the loop's own update and that its gradients were
    finite: cause ``optimizer``, as torch.optim.SGD's update of the same rate is."""
    torch.manual_seed(0)
    model = LM.make_backboned()
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, None, loss_fn=crit, out_dir=out_dir,
                            factory="loop_models:make_backboned"):
            for step in range(10):
                x = torch.randn(16, 20)
                loss = crit(model(x), x[:, :5].argmax(1))
                model.zero_grad()
                loss.backward()
                lr = 0.1 * torch.rsqrt(torch.tensor(abs(step - 5.0)))  # BUG: inf at step 5
                with torch.no_grad():
                    for p in model.parameters():
                        p -= lr * p.grad
    assert (info.value.event["step"], info.value.event["phase"]) == (6, "weights")
    report = nanreplay_json(info.value.bundle_path)
    assert report["cause"] == "optimizer"  # (the loop's update is its optimizer)
    assert "given no optimizer: the loop's own update after step 5 (p -= lr * " \
        "p.grad) wrote them from finite gradients" in report["hint"]


def unfreeze_in_place(out_dir: Path) -> NonFiniteError:
    """The optimizer holds every parameter; the backbone is frozen with requires_grad_(False)
    for a warm-up and unfrozen at step 20, when the loop also sets every group's learning rate
    to 1e4 (a typo for 1e-4). Recorded with rewind=8, so the window spans step 20."""
    torch.manual_seed(0)
    model = LM.make_backboned()
    model.backbone.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    crit = nn.CrossEntropyLoss()
    x_all = torch.randn(512, 20) * 3
    y_all = x_all[:, :5].argmax(1)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, rewind=8,
                            factory="loop_models:make_backboned"):
            for step in range(40):
                if step == 20:
                    model.backbone.requires_grad_(True)
                    for g in opt.param_groups:
                        g["lr"] = 1e4
                i = (step * 32) % 512
                opt.zero_grad()
                crit(model(x_all[i:i + 32]), y_all[i:i + 32]).backward()
                opt.step()
    return info.value


def test_rewind_window_across_requires_grad_unfreezing(out_dir):
    """The rebuilt model trains every parameter, so the window's re-run trained the backbone
    in the steps it was frozen: its gradient norms differed from the recorded ones and the
    report said the loop clipped its gradients (it does not). The recorder now logs each
    step's frozen parameters, and the re-run leaves them untrained there."""
    err = unfreeze_in_place(out_dir)
    w = nanreplay_json(err.bundle_path)["window"]
    assert w["steps"][0] < 20 < w["steps"][1]
    assert w["loop_clip"] is None
    assert w["reproduced"] and w["first_non_finite"]["step"] == err.event["step"]


def test_window_began_names_the_lr_set_at_unfreezing(out_dir):
    """The weights grew slowly at every step of the warm-up, as training does, then exploded
    after the learning rate was set to 1e4 at step 20: 'began' named the slow creep ('the
    weight norm rose at every step from step 10') instead of the learning-rate jump."""
    err = unfreeze_in_place(out_dir)
    began = nanreplay_json(err.bundle_path)["window"]["precursors_began"]
    assert (began["step"], began["kind"]) == (20, "lr_jump")


def test_optimizer_rebuilt_at_unfreezing_does_not_stall_the_steps(out_dir, caplog):
    """A fine-tuning recipe that builds a new optimizer over every parameter when it
    unfreezes the backbone, after the recorder was given the first one: the recorded optimizer
    never stepped again, so the step never closed; every later forward was a micro-batch of
    it, held in memory and unchecked, and a NaN batch 10 steps later trained on unseen. The
    recorder now notices its optimizer's weights changing under an open step, says so once,
    and checks each forward as a step: the NaN batch is an input event at its own step."""
    torch.manual_seed(0)
    model = LM.make_backboned()
    model.backbone.requires_grad_(False)
    opt = torch.optim.Adam(model.head.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="loop_models:make_backboned"):
            for step in range(30):
                if step == 5:
                    model.backbone.requires_grad_(True)
                    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
                x = torch.randn(16, 20)
                if step == 15:
                    x[3, 0] = float("nan")  # a corrupt record
                opt.zero_grad()
                crit(model(x), x[:, :5].argmax(1)).backward()
                opt.step()
    event = info.value.event
    assert (event["step"], event["phase"], event["samples"]) == (15, "input", [3])
    assert event["micro_batch"] == 0
    warned = [r.getMessage() for r in caplog.records if r.getMessage() == WARNING]
    assert len(warned) == 1
    report = nanreplay_json(info.value.bundle_path)
    assert (report["cause"], report["origin"]["samples"]) == ("input", [3])


def ortho_rnn_bundle(out_dir: Path) -> Path:
    """An RNN unrolled from ``torch.zeros(B, 32)`` (float32, made in forward), its recurrence
    kept orthogonal, trained with RMSprop; a zero count at step 3 is log(0) = -inf, which the
    tanh saturates: the forward output is finite, the gradient of inp.weight NaN."""
    torch.manual_seed(0)
    model = LM.make_ortho_rnn()
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="loop_models:make_ortho_rnn"):
            for step in range(6):
                x = torch.rand(8, 10, 4) + 0.1
                x[..., 3] = torch.randint(1, 5, (8, 10)).float()
                if step == 3:
                    x[5, 7, 3] = 0.0  # a zero count
                opt.zero_grad()
                crit(model(x), torch.randint(0, 2, (8,))).backward()
                opt.step()
    assert (info.value.event["step"], info.value.event["phase"]) == (3, "backward")
    return info.value.bundle_path


def test_what_if_whose_change_makes_the_model_raise_is_no_finite(out_dir):
    """Under ``--try dtype=float64`` the model's own code raises (its state, made with an
    explicit ``dtype=torch.float32``, times float64 weights): the try read 'finite through step 3', evidence of a fix it never ran.
    It is now a failed try that says what raised."""
    report = nanreplay_json(ortho_rnn_bundle(out_dir), "--try", "dtype=float64")
    (tried,) = report["what_if"]
    assert tried["finite"] is None
    assert tried["error"].startswith("RuntimeError: expected m1 and m2 to have the same dtype")
    assert tried["error"].endswith("in the model's code at step 3")


def test_backward_of_a_saved_infinity_names_the_forward_op_that_made_it(out_dir):
    """AddmmBackward0 in inp multiplied the -inf of log(0) that the forward saved (a tanh
    saturated it before the output): the report said 'overflow ... where a value overflowed
    and was masked or saturated', with no samples, as addmm has no pole. The forward op that
    made the infinity is now found and blamed: aten.log of 0, invalid, sample 5."""
    report = nanreplay_json(ortho_rnn_bundle(out_dir))
    origin = report["origin"]
    assert (origin["op"], origin["module"]) == ("AddmmBackward0", "inp")
    assert [c["op"] for c in origin["chain"]] == ["aten.log", "AddmmBackward0"]
    assert origin["chain"][0]["made"] == "-inf"
    assert (report["cause"], origin["samples"]) == ("invalid", [5])
    assert "aten.log of 0" in report["hint"]


def test_try_auto_proposes_the_rate_before_the_jump(out_dir):
    """When the window began with a learning-rate jump (1e4 set at unfreezing, 1e5x the 0.1
    before), auto's lr=0.1x is still 1e3 and NaN: it now also proposes the rate the run
    trained at before the jump, which stays finite."""
    report = nanreplay_json(unfreeze_in_place(out_dir).bundle_path, "--try", "auto")
    tries = {t["try"]: t for t in report["what_if"]}
    assert tries["lr=0.1"]["finite"] is True and not tries["lr=0.1"]["inconclusive"]


def _dp_sgd(model, opt, crit, x, y, eps: float) -> torch.Tensor:
    """One DP-SGD step by hand: per-sample gradients with torch.func (the model's forward runs
    under vmap(grad(...))), each clipped to norm 1, summed, noised; the logged loss from one
    plain forward. ``eps=0``: the clip divides a blank record's 0 gradient by its 0 norm."""
    from torch.func import functional_call, grad, vmap

    loss = crit(model(x), y)
    params = {k: v.detach() for k, v in model.named_parameters()}
    per_sample = vmap(grad(lambda p, xi, yi: crit(functional_call(model, p, (xi[None],)),
                                                  yi[None])), in_dims=(None, 0, 0))
    grads = per_sample(params, x, y)
    norms = sum(g.flatten(1).pow(2).sum(1) for g in grads.values()).sqrt()
    factor = norms.clamp(max=1.0) / (norms + eps)
    g = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        clipped = grads[name] * factor.view(-1, *[1] * (grads[name].dim() - 1))
        p.grad = clipped.sum(0) + 0.01 * torch.randn(p.shape, generator=g)
    opt.step()
    return loss


def test_per_sample_gradients_under_torch_func_are_checked_and_said(out_dir, caplog):
    """The model's forward also runs under ``vmap(grad(functional_call(...)))``: those calls
    hold functorch's wrapped tensors, which no reduction into a slot takes; the first one
    disabled the recorder ('Batching rule not implemented for aten::aminmax.out') and the NaN
    that the hand-written clip made at step 3 went through unchecked. Now they are left out,
    the step's NaN gradients are an event at step 3, and the replay says that no backward made
    them: the loop's own code did."""
    model = LM.make_dp_mlp()
    opt, crit = torch.optim.SGD(model.parameters(), lr=0.05), nn.MSELoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="loop_models:make_dp_mlp") as rec:
            for step in range(6):
                g = torch.Generator().manual_seed(step)
                x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
                if step == 3:
                    x[4], y[4] = 0.0, 0.0  # a blank record: its gradient is exactly 0
                _dp_sgd(model, opt, crit, x, y, eps=0.0)
    assert "internal error" not in caplog.text and rec.health.internal_errors == 0
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "backward", "nan")
    assert set(ev["params"]) == {"0.weight", "2.weight"}
    r = invoke_cli(info.value.bundle_path, "--json")
    assert (r.exit_code, r.stderr) == (1, ""), (r.exit_code, r.stderr)  # 1: not reproduced
    rep = json.loads(r.stdout)
    assert (rep["cause"], rep["reproduced"], rep["origin"]["phase"]) == \
        ("not_reproduced", False, "backward")
    assert "written by the loop's own code, not by backward through the model" in rep["hint"]
    assert any("no backward ran through the recorded forward" in p for p in rep["problems"])


def test_a_model_run_only_under_torch_func_is_said_once(out_dir, caplog):
    """A purely functional loop (every forward under grad(...)) records nothing: it trains as
    without the recorder, and one warning says that nothing was checked and why."""
    from torch.func import functional_call, grad

    model = LM.make_dp_mlp()
    opt, crit = torch.optim.SGD(model.parameters(), lr=0.05), nn.MSELoss()
    twin = LM.make_dp_mlp()
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.05)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir):
        for _ in range(3):
            x, y = torch.randn(16, 8), torch.randn(16, 1)
            for m, o in ((model, opt), (twin, twin_opt)):
                def loss_of(p, m=m, x=x, y=y):
                    return crit(functional_call(m, p, (x,)), y)

                grads = grad(loss_of)({k: v.detach() for k, v in m.named_parameters()})
                for name, p in m.named_parameters():
                    p.grad = grads[name]
                o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    said = [r.getMessage() for r in caplog.records if "torch.func transforms" in r.getMessage()]
    assert len(said) == 1 and "only its gradients and the update are checked" \
        in said[0]


def test_a_validation_forward_in_eval_mode_inside_the_step_is_replayed_in_eval_mode(out_dir):
    """A loop validates after backward and before optimizer.step(), with model.eval() and
    no_grad, then model.train(): that forward is micro-batch 1 of the step. A constant
    validation record (row 4) makes the dropout-then-standardise model divide 0 by 0 there.
    The bundle held the modes of the step's end (train), so the replay ran the validation
    forward with dropout on: NOT reproduced, the fidelity line blaming parameters passed in
    or edited weights."""
    torch.manual_seed(0)
    model = LM.make_dropout_standardised()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    crit = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    xv, yv = torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="loop_models:make_dropout_standardised"):
            for step in range(6):
                x, y = torch.randn(16, 12, generator=g), torch.randint(0, 3, (16,), generator=g)
                opt.zero_grad()
                crit(model(x), y).backward()
                model.eval()
                with torch.no_grad():
                    v = xv.clone()
                    if step == 3:
                        v[4] = 5.0  # a constant record
                    crit(model(v), yv)
                model.train()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["module"], ev["micro_batch"], ev["samples"]) == (3, "1", 1, [4]), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["micro_batch"], o["op"], o["samples"],
            rep["cause"]) == (True, "1", 1, "aten.div", [4], "invalid"), o

"""End to end on semi-supervised classification (``semi_supervised_models``): FixMatch's loop
(weak and strong views of the unlabelled batch, one forward of the interleaved labelled, weak
and strong batch so BatchNorm sees all three, SGD with Nesterov momentum and a cosine
schedule, an EMA copy of the model updated under ``torch.no_grad``) with ReMixMatch's
distribution alignment or UDA's sharpened KL, and MixMatch's loop (K = 2 guesses sharpened
under ``torch.no_grad``, mixup, the mixed batch interleaved). Each planted bug of the domain
fires under the recorder and is replayed with the CLI; the healthy versions raise no event and
train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib
import copy
import functools
import math

import pytest
import semi_supervised_models as M
import torch
import torch.nn.functional as F
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

B, MU = 8, 2  # labelled batch size, unlabelled ratio


def line_of(text: str) -> str:
    return source_line("semi_supervised_models.py", text)


def optimizer(model, steps: int):
    """FixMatch's SGD (Nesterov, weight decay on all but biases and BatchNorm) and its cosine
    schedule ``cos(7 pi k / 16 K)``."""
    decay = [p for n, p in model.named_parameters() if "bn" not in n and "bias" not in n]
    rest = [p for n, p in model.named_parameters() if "bn" in n or "bias" in n]
    opt = torch.optim.SGD([{"params": decay, "weight_decay": 5e-4},
                           {"params": rest, "weight_decay": 0.0}],
                          lr=0.03, momentum=0.9, nesterov=True)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: max(0.0, math.cos(7 * math.pi * k / (16 * steps))))
    return opt, sched


@torch.no_grad()
def ema_update(ema, model, decay: float = 0.999):
    for e, p in zip(ema.parameters(), model.parameters()):
        e.mul_(decay).add_(p.detach(), alpha=1 - decay)
    for e, b in zip(ema.buffers(), model.buffers()):
        e.copy_(b)


def fixmatch(loss, out_dir, steps: int = 4, record: bool = True, blank: int | None = None,
             last: int = B * MU, bf16: bool = False):
    """FixMatch's training loop; ``loss`` a module or function of (logits_x, y, logits_w,
    logits_s). ``blank``: the strong views use AutoContrast, and the unlabelled record
    ``blank`` of the last step is a blank grey frame; ``last``: the unlabelled batch size of
    the last step (a loader without ``drop_last``); ``bf16``: the forward and the loss under
    bfloat16 autocast. Returns the model and its EMA copy."""
    model = M.make_wrn()
    ema = copy.deepcopy(model).requires_grad_(False)
    opt, sched = optimizer(model, steps)
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=loss, out_dir=out_dir,
                         factory="semi_supervised_models:make_wrn") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else loss
        for step in range(steps):
            x, y = M.images(g, B)
            u, _ = M.images(g, B * MU if step < steps - 1 else last)
            if blank is not None and step == steps - 1:
                u[blank] = 0.5
            views = (M.weak(x, g), M.weak(u, g), M.strong(u, g, contrast=blank is not None))
            inputs = M.interleave(torch.cat(views), 2 * MU + 1)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = M.de_interleave(model(inputs), 2 * MU + 1)
                logits_w, logits_s = logits[B:].chunk(2)
                total = loss_fn(logits[:B], y, logits_w, logits_s)
            opt.zero_grad()
            total.backward()
            opt.step()
            sched.step()
            ema_update(ema, model)
    return model, ema


def mixmatch(T: float, out_dir, blank: int | None = None, steps: int = 4, record: bool = True,
             alpha: float = 0.75):
    """MixMatch's training loop (YU1ut/MixMatch-pytorch): K = 2 weak views of the unlabelled
    batch guessed and sharpened under ``torch.no_grad``, mixup of the labelled and unlabelled
    rows with ``lam = max(lam, 1 - lam)``, the mixed batch interleaved for BatchNorm, Adam and
    the EMA copy; the unlabelled record ``blank`` of the last step is a blank grey frame.
    Returns the model and its EMA copy."""
    model = M.make_wrn()
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    g = torch.Generator().manual_seed(0)
    beta = torch.distributions.Beta(torch.tensor(alpha), torch.tensor(alpha))
    rec = FlightRecorder(model, opt, loss_fn=M.mixmatch_loss, out_dir=out_dir,
                         factory="semi_supervised_models:make_wrn") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else M.mixmatch_loss
        for step in range(steps):
            x, y = M.images(g, B)
            u, _ = M.images(g, B)
            if blank is not None and step == steps - 1:
                u[blank] = 0.5
            x, u1, u2 = M.weak(x, g), M.weak(u, g), M.weak(u, g)
            with torch.no_grad():
                p = (torch.softmax(model(u1), dim=1) + torch.softmax(model(u2), dim=1)) / 2
                targets_u = M.sharpen(p, T)
            all_inputs = torch.cat([x, u1, u2])
            all_targets = torch.cat([F.one_hot(y, M.CLASSES).float(), targets_u, targets_u])
            lam = float(beta.sample())
            lam = max(lam, 1 - lam)
            idx = torch.randperm(all_inputs.size(0), generator=g)
            mixed_input = lam * all_inputs + (1 - lam) * all_inputs[idx]
            mixed_target = lam * all_targets + (1 - lam) * all_targets[idx]
            logits = M.de_interleave(model(M.interleave(mixed_input, 3)), 3)
            loss = loss_fn(logits[:B], mixed_target[:B], logits[B:], mixed_target[B:])
            opt.zero_grad()
            loss.backward()
            opt.step()
            ema_update(ema, model)
    return model, ema


def fire(run, *args, **kwargs):
    with pytest.raises(NonFiniteError) as info:
        run(*args, **kwargs)
    return info.value.event, info.value.bundle_path


def test_alignment_by_a_pseudo_label_histogram_names_the_buffer_at_0(tmp_path):
    """ReMixMatch's distribution alignment over a running pseudo-label histogram that starts
    at zeros and takes the first batch's: the untrained model predicts one class for every
    row, so the other classes keep 0 in ``p_model`` and ``p * p_target / p_model`` is x/0,
    then the renormalisation inf/inf. The soft pseudo-labels carry the NaN through the mask's
    0 into the loss. The replay names the division, its line, no sample, and the loss's
    buffer with the entries at 0 (as an unrecorded step leaves it), with the fix at the
    buffer, not an eps in the data or a feature constant over the batch."""
    plain = M.make_da_hist_loss()
    fixmatch(plain, None, steps=1, record=False)
    zeros = (plain.p_model == 0).nonzero().flatten().tolist()
    assert 0 < len(zeros) < M.CLASSES, plain.p_model
    ev, bundle = fire(fixmatch, M.make_da_hist_loss(), tmp_path)
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"], rep["cause"]) == ("aten.div", "+inf", [], "invalid")
    assert o["source"] == line_of("probs = probs * self.p_target / self.p_model"), o
    hint = rep["hint"]
    assert f"the buffer <loss>.p_model as the code keeps it, 0 at " \
           f"entr{'ies' if len(zeros) > 1 else 'y'} {', '.join(map(str, zeros))} of its " \
           f"shape ({M.CLASSES},)" in hint, hint
    assert "start it above 0" in hint and "self.p_model.clamp_min(eps)" in hint, hint
    assert "statistic over the batch" not in hint, hint


def test_uda_softmax_temperature_of_0_names_the_division_and_the_setting(tmp_path):
    """UDA's sharpening ``softmax(logits_w / T)`` given T = 0 (meant as "no sharpening"):
    x/0 is +-inf and the softmax NaN, in the loss under ``torch.no_grad``. The replay names
    the division on its line, every row, and a Python number set to 0 (a temperature)."""
    ev, bundle = fire(fixmatch, functools.partial(M.uda_loss, temperature=0.0), tmp_path)
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], rep["cause"]) == ("aten.div", "invalid"), rep
    assert o["source"] == line_of("probs = torch.softmax(logits_w / temperature, -1)"), o
    assert "by the number 0" in rep["hint"] and "temperature" in rep["hint"], rep["hint"]


def test_mixmatch_sharpening_underflow_names_the_target_rows_and_the_temperature(tmp_path,
                                                                                 monkeypatch):
    """MixMatch's ``p ** (1 / T)`` with T = 0.009: every class of a guess whose largest
    probability is below about 0.39 underflows to 0 and the renormalisation is 0/0, made by
    the loop under ``torch.no_grad`` and mixed into the targets. The loss's target
    ``mixed_target[:B]`` has B rows beside ``logits[:B]``, not the model's 3B: the replay
    names its NaN rows (those an unrecorded run gives the loss) and the sharpening's
    temperature, not a per-class weight vector of an empty cluster."""
    seen = []
    monkeypatch.setattr(M, "mixmatch_loss", lambda *a: seen.append(a[1]) or torch.tensor(0.0,
                                                                                     requires_grad=True))
    mixmatch(0.009, None, steps=1, record=False)
    monkeypatch.undo()
    rows = torch.isnan(seen[0]).any(1).nonzero().flatten().tolist()
    assert rows and bool(torch.isnan(seen[0][rows]).all()), seen[0]
    ev, bundle = fire(mixmatch, 0.009, tmp_path)
    assert (ev["step"], ev["phase"], ev["tensor"]) == (0, "input", "loss_args[1]"), ev
    rep = nanreplay_json(bundle)
    assert (rep["origin"]["tensor"], rep["cause"]) == ("loss_args[1]", "input"), rep
    hint = rep["hint"]
    assert f"holds NaN in its row(s) {rows} of {B} (every entry of each)" in hint, hint
    assert "p ** (1 / T)" in hint and "keep T away from 0" in hint, hint
    assert "empty cluster" not in hint, hint


def test_autocontrast_of_a_blank_unlabelled_frame_names_its_strong_view_row(tmp_path):
    """A blank grey frame among the unlabelled images: the strong view's AutoContrast on the
    batch, ``(x - lo) / (hi - lo)``, is 0/0 in every channel of it, and FixMatch's interleave
    moves that strong view to a row of its own in the model's batch. The recorder stops at
    the model's input before the forward, and the replay names that row (where interleave
    put it), the input cause and the normalisation's division by zero. Dropping that row
    cannot be judged: the loss took slices of the de-interleaved output, which the replay
    holds only as recorded (NaN, BatchNorm having spread the row to all), so the try says
    so rather than "still non-finite"."""
    row = M.interleave(torch.arange(B + 2 * B * MU), 2 * MU + 1).tolist().index(
        B + B * MU + 3)
    ev, bundle = fire(fixmatch, M.uda_loss, tmp_path, blank=3)
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == (3, "input", "batch", [row])
    rep = nanreplay_json(bundle, "--try", f"drop={row}")
    assert (rep["origin"]["samples"], rep["cause"]) == ([row], "input"), rep
    assert "division by zero in normalisation" in rep["hint"], rep["hint"]
    w = rep["what_if"][0]  # (the loss took de-interleaved slices the replay cannot remake)
    assert w["finite"] is None and "recorded copy" in w["note"], w


@pytest.mark.filterwarnings("ignore:.*degrees of freedom is <= 0:UserWarning")
def test_softmatch_variance_of_a_last_batch_of_one_names_the_var(tmp_path):
    """SoftMatch's running variance of the confidences takes each batch's unbiased
    ``var()``: the unlabelled loader's last batch (no ``drop_last``) holds one image, whose
    variance is 0/0, and the Gaussian weights of every row turn NaN. The replay names the
    var on its line, the division by n - 1 = 0 and the advice for a batch of one; the 0-d
    running buffer the re-run leaves NaN does not break the replay."""
    ev, bundle = fire(fixmatch, M.make_softmatch_loss(), tmp_path, last=1)
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["made"], rep["cause"]) == ("aten.var", "nan", "invalid"), rep
    assert o["source"] == line_of("conf.var(unbiased=True)"), o
    assert "a batch of 1" in rep["hint"] and "correction=0" in rep["hint"], rep["hint"]


def same_weights(a, b):
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("kind", ["align", "uda", "uda_bf16", "softmatch", "mixmatch"])
def test_healthy_runs_raise_nothing_and_train_the_same(tmp_path, kind):
    """Distribution alignment from a uniform running mean (USB's), UDA at T = 0.4 (also
    under bfloat16 autocast), SoftMatch over full batches and MixMatch at T = 0.5, each masking most unlabelled rows to 0: no
    event, and the model, its EMA copy and the loss's running statistics are bit-identical
    with and without the recorder."""
    def run(record):
        if kind == "mixmatch":
            return (*mixmatch(0.5, tmp_path, steps=3, record=record), None)
        loss = {"align": M.make_da_loss, "softmatch": M.make_softmatch_loss}.get(
            kind, lambda: M.uda_loss)()
        return (*fixmatch(loss, tmp_path, steps=3, record=record, bf16=kind == "uda_bf16"),
                loss)

    recorded, plain = run(True), run(False)
    assert not list(tmp_path.glob("*.nan"))
    for a, b in zip(recorded, plain):
        if isinstance(a, torch.nn.Module):
            same_weights(a, b)
    if kind == "softmatch":
        assert recorded[2].var != 1.0, recorded[2].var  # (it ran, and updated its buffers)

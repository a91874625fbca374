"""End to end: adversarial training and certified robustness as the well-known repositories
write it (``adversarial_models``): PGD inner loops that differentiate the loss w.r.t. the
input between the step's forwards, TRADES and MART losses, double backprop. The attack's
forwards are micro-batches of the step; a NaN its step made in the next forward's input is
the loop's, not the data's."""

from __future__ import annotations

import contextlib
import functools

import adversarial_models as A
import pytest
import torch
from bundles import invoke_cli, nanreplay_json

from recorder import FlightRecorder, NonFiniteError

N = 16


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def train_pgd_l2(out_dir, steps: int, tiny: float = 0.0):
    model = A.make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    crit = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                        factory="adversarial_models:make_net"):
        for _ in range(steps):
            x, y = A.images(g, N)
            x_adv = A.pgd_l2(model, x, y, tiny=tiny)
            loss = crit(model(x_adv), y)
            opt.zero_grad()
            loss.backward()
            opt.step()


def test_pgd_l2_zero_input_gradient_is_named_as_the_attacks_step(tmp_path):
    """FAT's early-stopped PGD-L2 masks the attack's loss to the samples still classified
    correctly; the others' input gradient is exactly 0 and ``g / ‖g‖`` is 0/0, so the attack's
    second forward takes NaN rows. The report blamed the data ("the batch itself holds
    NaN/Inf"; with every row NaN, "a division by a scalar that is 0") although the batch was
    made by the loop from the first forward's input, which the bundle holds finite."""
    x, y = A.images(torch.Generator().manual_seed(0), N)
    with torch.no_grad():
        wrong = (A.make_net().eval()(x).argmax(1) != y).nonzero().flatten().tolist()
    assert 0 < len(wrong) < N
    with pytest.raises(NonFiniteError) as info:
        train_pgd_l2(tmp_path, 3)
    err = info.value
    ev = err.event
    assert (ev["step"], ev["phase"], ev["micro_batch"], ev["samples"]) == (0, "input", 1, wrong)
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["phase"], o["tensor"], o["micro_batch"],
            o["samples"], o["made"]) == (True, "input", "input", "batch", 1, wrong, "nan"), rep
    hint = rep["hint"]
    assert "the loop made it between the step's forwards from the input of micro-batch 0" \
        in hint, hint
    assert "clamp_min(1e-12)" in hint and "batch itself holds" not in hint, hint
    text = invoke_cli(err.bundle_path).stdout
    assert "gradient of exactly 0 into the model's output in micro-batch 0" in text, text


def test_pgd_l2_with_the_norm_guarded_raises_nothing(tmp_path):
    train_pgd_l2(tmp_path, 3, tiny=1e-12)
    assert not list(tmp_path.glob("*.nan"))


def macer_batch(g, xs, ys, step: int):
    x, y = xs[16 * step % 64:][:16], ys[16 * step % 64:][:16]
    return x.repeat_interleave(4, 0) + torch.randn(64, A.C, A.H, A.H, generator=g) * 0.25, y


def macer_steps(out_dir, steps: int, clamp: bool = False, record: bool = True):
    """MACER on Gaussian-noised copies (4 an image); returns the model and the generator."""
    model = A.make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    xs, ys = A.images(g, 64)
    # a blank gray frame among the images, seen first in step 3 (its image 1): no class is
    # sure of it (top probability 1 - 1.5e-6, 26 float32 spacings short of 1, with AVX2,
    # AVX-512 and scalar kernels alike), so that step's images are not all rounded to 1
    xs[49] = 0.5
    loss_fn = functools.partial(A.macer_loss, clamp=clamp)
    rec = FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir,
                         factory="adversarial_models:make_net") if record else None
    with rec or contextlib.nullcontext():
        for step in range(steps):
            noisy, y = macer_batch(g, xs, ys, step)
            loss = (rec.loss_fn if rec else loss_fn)(model(noisy), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model, g, xs, ys


def test_macer_icdf_of_a_probability_rounded_to_one_is_precision(tmp_path):
    """MACER's certified radius Φ⁻¹(p_A) − Φ⁻¹(p_B) without the official code's clamp: a
    confident image's soft-smoothed top probability rounds to 1.0 in float32 (below 1 in
    exact arithmetic, off it in float64); the radius is inf and filtered out, but the
    filter's zero gradient times erfinv's infinite derivative at 1 is NaN (step 3's images
    but the gray frame among them: which images round to 1 follows the CPU's kernels, so
    they come from a plain run). The report said
    "overflow — the gradient is too large for its dtype: rescale its inputs (subtract the
    row max before exp)"; erfinv had no pole in the replay's tables."""
    with pytest.raises(NonFiniteError) as info:
        macer_steps(tmp_path, 10)
    err = info.value
    step = err.event["step"]
    assert (step, err.event["phase"]) == (3, "backward")
    # the same training without the recorder up to that step: its images whose smoothed top
    # probability is 1.0 (or runner-up 0.0) in float32, and their 4 noisy copies each
    model, g, xs, ys = macer_steps(tmp_path, step, record=False)
    noisy, y = macer_batch(g, xs, ys, step)
    with torch.no_grad():
        p = torch.softmax(16 * model(noisy), 1).view(16, 4, -1).mean(1).topk(2, 1).values
    images = ((p[:, 0] == 1) | (p[:, 1] == 0)).nonzero().flatten().tolist()
    assert 0 < len(images) < 16 and 1 not in images, images
    rows = [4 * i + k for i in images for k in range(4)]
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["phase"], o["module"], o["op"], o["samples"]) \
        == (True, "precision", "backward", "<loss>", "ErfinvBackward0", rows), rep
    assert "rounded to exactly +-1, the edge of erfinv's domain" in rep["hint"], rep["hint"]
    assert "p.clamp(1e-6, 1 - 1e-6)" in rep["hint"], rep["hint"]
    assert o["source"].startswith("adversarial_models.py:") and "normal.icdf(top2[:, 0])" in \
        rep["source_lines"][o["source"]]


def test_macer_with_the_clamp_raises_nothing(tmp_path):
    macer_steps(tmp_path, 10, clamp=True)
    assert not list(tmp_path.glob("*.nan"))


def test_trades_kl_target_underflow_names_the_out_of_scale_record(tmp_path):
    """TRADES as its official code writes it: KLDivLoss(batchmean) of the adversarial
    log-softmax against the clean softmax, which keeps its graph. A record saved in 0-255
    among [0, 1] images drives the clean logits apart until a class probability underflows
    to 0, and xlogy's gradient w.r.t. the target there is 0/0."""
    model = A.make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=A.trades_loss, out_dir=tmp_path,
                            factory="adversarial_models:make_net") as rec:
            for step in range(6):
                x, y = A.images(g, N)
                if step == 3:
                    x[5] = x[5] * 255  # one record never divided by 255
                x_adv = A.pgd_linf(model, x, y, g=g)
                loss = rec.loss_fn(model(x_adv), model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (3, "backward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["samples"],
            o["micro_batch"]) == (True, "underflow", "<loss>", "XlogyBackward0", [5], 4), rep
    assert "KLDivLoss(reduction=\"batchmean\")" in rep["source_lines"][o["source"]]
    assert "log_target=True" in rep["hint"] and "--try drop=5" in rep["hint"], rep["hint"]


def test_attack_inside_the_models_forward_is_a_forward_origin(tmp_path):
    """robustness's AttackerModel runs the same early-stopped PGD-L2 inside its forward
    (``torch.autograd.grad`` of the classifier's loss in a root call): the 0/0 is the root's
    own op, named at the attack's line, on the samples the attack skipped."""
    model = A.make_attacker()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    crit = torch.nn.CrossEntropyLoss()
    x, y = A.images(torch.Generator().manual_seed(0), N)
    # the attack's 0/0 rows: those skipped at its first step, and those its first step turned
    # wrong, skipped at a later one (their own 0/0 there: dropping the first alone is no fix)
    wrong = _zero_norm_rows(A.make_net(), x, y)
    assert 0 < len(_zero_norm_rows(A.make_net(), x, y, steps=1)) < len(wrong)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="adversarial_models:make_attacker"):
            loss = crit(model(x, y, make_adv=True), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["phase"], o["module"], o["op"], o["samples"],
            o["made"]) == (True, "invalid", "forward", "", "aten.div", wrong, "nan"), rep
    assert "grad / gnorm.clamp_min(tiny)" in rep["source_lines"][o["source"]]


def _zero_norm_rows(model, x, y, steps: int = 3) -> list[int]:
    """The rows whose input gradient is exactly 0 while their input is finite, at some step
    of ``pgd_l2``'s loop (computed without the recorder, with ``tiny`` made harmless)."""
    model.eval()
    rows: set[int] = set()
    x_adv = x.clone()
    for _ in range(steps):
        x_adv.requires_grad_(True)
        out = model(x_adv)
        active = (out.argmax(1) == y).float()
        loss = (torch.nn.functional.cross_entropy(out, y, reduction="none") * active).sum()
        (grad,) = torch.autograd.grad(loss, x_adv)
        gnorm = grad.flatten(1).norm(dim=1)
        rows |= set(((gnorm == 0) & torch.isfinite(x_adv.flatten(1)).all(1)).nonzero()
                    .flatten().tolist())
        x_adv = x_adv.detach() + 0.2 * grad / gnorm.clamp_min(1e-12).view(-1, 1, 1, 1)
        d = x_adv - x
        dn = d.flatten(1).norm(dim=1).view(-1, 1, 1, 1)
        x_adv = (x + d * torch.clamp(0.5 / (dn + 1e-12), max=1.0)).clamp(0, 1)
    return sorted(rows)


def test_a_bad_record_among_differentiated_micro_batches_is_still_the_datas(tmp_path):
    """Double backprop (an input-gradient penalty, ``create_graph=True``) accumulated over two
    micro-batches of other images: both inputs require grad, as an attack's do, but the NaN
    record of the second is data, which the hint must not put on the loop."""
    model = A.make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=A.input_grad_penalty, out_dir=tmp_path,
                            factory="adversarial_models:make_net") as rec:
            for step in range(3):
                opt.zero_grad()
                for micro in range(2):
                    x, y = A.images(g, N // 2)
                    if (step, micro) == (1, 1):
                        x[3, 0, 2, 2] = float("nan")  # a corrupt pixel
                    x.requires_grad_(True)
                    (rec.loss_fn(model(x), y, x) / 2).backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"], err.event["micro_batch"]) == (1, "input", 1)
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["tensor"], o["micro_batch"], o["samples"]) == (
        "input", "batch", 1, [3]), rep
    assert "the loop made it" not in (rep["hint"] or ""), rep["hint"]


def test_the_attacks_own_loss_is_named_not_terms_outside_loss_fn(tmp_path):
    """The attack's ``-log(1 - p_y)`` on a record saved in 0-255, which the model classifies
    with p_y rounded to 1: log(0), and autograd.grad w.r.t. delta sends NaN into the attack
    forward's output (micro-batch 0), with every parameter's gradient finite. The report said
    the loop's loss "holds terms computed outside" loss_fn and that the model's backward "did
    not give the recorded non-finite parameter gradients back", of a forward no training loss
    took."""
    model = A.make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    crit = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="adversarial_models:make_net") as rec:
            for step in range(4):
                x, y = A.images(g, N)
                if step == 2:
                    x[7] *= 255
                    with torch.no_grad():  # (a record the model has learnt: its own label)
                        y[7] = model(x[7:8]).argmax(1)[0]
                loss = rec.loss_fn(model(A.pgd_push_down(model, x, y, g=g)), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
    err = info.value
    ev = err.event
    assert (ev["step"], ev["phase"], ev["micro_batch"], ev["samples"]) == (
        2, "backward", 0, [7]), ev
    rep = nanreplay_json(err.bundle_path, code=1)
    o = rep["origin"]
    assert (rep["cause"], o["phase"], o["micro_batch"], o["samples"]) == (
        None, "loss", 0, [7]), rep  # (unknown: the op is in a loss not re-run)
    assert "a loss of its own there w.r.t. the model's input" in rep["hint"], rep["hint"]
    notes = " ".join(rep["problems"])
    assert "loss_fn took no output of micro-batch 0" in notes, notes
    assert "holds terms computed outside" not in notes and "did not give" not in notes, notes

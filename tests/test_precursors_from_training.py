"""Precursors found in the ring buffer of a real training run, checked against what the loop
itself measured.

``replay_models.Fp16Net`` trains with SGD; at step K-1 one sample is scaled so that the float16
layer's output reaches about 45 000 (finite, past half the float16 maximum), and labelled with
the class the model finds least likely, so the loss and the gradients jump too; at step K a larger sample overflows float16, the recorded event. The loop
measures, with its own forward hooks and before each update, every module's largest absolute
output, the total gradient norm and the loss; the expected precursors are computed from those
numbers with the documented rule (a value at least 10x the median of at least two earlier finite
values; a float16 module past 32 752), independently of the recorder and of ``replay``.
"""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path

import lora_models as L
import pytest
import replay_models as R
import torch
import torch.nn.functional as F
from models import check_event
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from replay import replay

K = 5
TARGET_ABSMAX = 45_000.0  # past 65504 / 2, below 65504


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def train(out_dir: Path):
    """Returns the NonFiniteError and, per step, the loop's own measurements."""
    model = R.make_fp16_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    crit = nn.CrossEntropyLoss()
    absmax: dict[str, float] = {}

    def measure(name):
        def hook(module, args, out):
            v = out.detach().abs().max().float().item()
            absmax[name] = max(absmax.get(name, -math.inf), v)
        return hook

    handles = [m.register_forward_hook(measure(n)) for n, m in model.named_modules()]
    seen: list[dict] = []
    try:
        with pytest.raises(NonFiniteError) as info:
            with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                                factory="replay_models:make_fp16_net"):
                for step in range(K + 3):
                    x, y = R.batch(step)
                    if step == K - 1:  # the float16 layer's output near 45 000, finite,
                        w = model.half_lin.weight.detach().float()
                        x[4] = TARGET_ABSMAX / w.sum(dim=1).abs().max().item()
                        y[4] = _least_likely(model, x)[4]  # and its label wrong: big gradients
                    if step == K:
                        x[4] = 6e4  # past 65504 in float16
                    absmax.clear()
                    # the weights as the update before left them (none before step 0)
                    weight_norm = math.sqrt(sum(p.detach().double().pow(2).sum().item()
                                                for p in model.parameters())) if step else math.nan
                    opt.zero_grad()
                    loss = crit(model(x), y)
                    loss.backward()
                    grad_norm = math.sqrt(sum(p.grad.double().pow(2).sum().item()
                                              for p in model.parameters()))
                    seen.append({"step": step, "loss": loss.item(), "grad_norm": grad_norm,
                                 "weight_norm": weight_norm, "absmax": dict(absmax)})
                    opt.step()
    finally:
        for h in handles:
            h.remove()
    return info.value, seen


def _least_likely(model, x) -> torch.Tensor:
    """The class each sample gets the lowest logit for, computed from the weights without
    calling the modules (a call would be a micro-batch of the recorded step)."""
    with torch.no_grad():
        h = F.linear(x.half(), model.half_lin.weight, model.half_lin.bias).relu().float()
        return F.linear(h, model.head.weight, model.head.bias).argmin(dim=1)


def jumps(values: list[tuple[int, float]], factor: float = 10.0, least: int = 2) -> list[int]:
    """The documented rule, on the loop's own numbers: steps whose value is at least
    ``factor`` times the median of the earlier finite values (two at least; one for the
    weights)."""
    out, earlier = [], []
    for step, v in values:
        if not math.isfinite(v):
            continue
        if len(earlier) >= least and statistics.median(earlier) > 0 \
                and v >= factor * statistics.median(earlier):
            out.append(step)
        earlier.append(abs(v))
    return out


def test_precursors_of_a_float16_overflow_are_the_measured_ones(out_dir):
    err, seen = train(out_dir)
    check_event(err.event, step=K, phase="forward", module="half_lin", kind="+inf")
    rep = replay(err.bundle_path)
    assert rep["event"]["step"] == K and rep["reproduced"] is True
    assert (rep["origin"]["module"], rep["origin"]["op"], rep["cause"]) == \
        ("half_lin", "aten.addmm", "overflow")

    measured = [s for s in seen if s["step"] <= K]
    expected = {(s, "grad_norm_jump", "gradient norm")
                for s in jumps([(m["step"], m["grad_norm"]) for m in measured])}
    expected |= {(s, "loss_jump", "loss") for s in jumps([(m["step"], m["loss"])
                                                          for m in measured])}
    expected |= {(s, "weight_jump", "weight norm (as the update before left them)")
                 for s in jumps([(m["step"], m["weight_norm"]) for m in measured], least=1)}
    # layers in the loop's own call order (hooks fire as calls return)
    jumped: dict[int, list[str]] = {}
    for name in seen[0]["absmax"]:
        col = [(m["step"], m["absmax"].get(name, math.nan)) for m in measured]
        for s in jumps(col):
            jumped.setdefault(s, []).append(name or "<root>")
    # one jump seen through several layers is one line naming the first layer called
    expected |= {(s, "absmax_jump", f"absmax of {names[0]}" if len(names) == 1
                  else f"{names[0]}, {len(names)} layers") for s, names in jumped.items()}
    first_near = next(m["step"] for m in measured if 65504 / 2 < m["absmax"]["half_lin"]
                      < math.inf)
    expected.add((first_near, "near_fp16_max", "absmax of half_lin"))

    got = set()
    for p in rep["precursors"]:  # "gradient norm 12.3 is 45x the median ...", "absmax of X is"
        group = re.search(r"(?:seen at (\S+), the first layer called|absmax of (\S+) jumped)"
                          r".*?(?:every layer followed \((\d+) layers\)|(\d+) layers? after)",
                          p["detail"])
        if p["kind"] == "absmax_jump" and group:
            first, count = group[1] or group[2], int(group[3] or int(group[4]) + 1)
            got.add((p["step"], p["kind"], f"{first}, {count} layers"))
            continue
        head = p["detail"].split(" is ")[0]
        got.add((p["step"], p["kind"],
                 head if p["kind"] == "near_fp16_max" else head.rsplit(" ", 1)[0]))
    assert got == expected, (sorted(got), sorted(expected))
    # the planted step K-1 shows all three kinds, for the float16 layer where it applies
    kinds = {(k, s) for st, k, s in got if st == K - 1}
    # (the float16 layer is the first called; the layers after it followed its jump)
    assert jumped[K - 1][0] == "half_lin" and len(jumped[K - 1]) > 1, jumped
    assert {("grad_norm_jump", "gradient norm"),
            ("absmax_jump", f"half_lin, {len(jumped[K - 1])} layers"),
            ("near_fp16_max", "absmax of half_lin")} <= kinds, kinds
    assert first_near == K - 1

    # and the numbers they quote are the loop's own
    detail = {(p["step"], p["kind"]): p["detail"] for p in rep["precursors"]
              if p["kind"] != "absmax_jump"}
    assert detail[K - 1, "near_fp16_max"].startswith(
        f"absmax of half_lin is {seen[K - 1]['absmax']['half_lin']:.4g}, past half"), detail
    assert detail[K - 1, "grad_norm_jump"].startswith(
        f"gradient norm {seen[K - 1]['grad_norm']:.4g} is "), detail


def test_an_embeddings_jump_after_a_warmup_to_a_huge_rate_is_the_weights_not_the_batch(out_dir):
    """A language model whose warmup climbs from 0 to a learning rate of 1e5 (a typo for 1e-5),
    gradients clipped to 1: neither the rate (no median above 0 to jump from) nor the
    gradient norm jumps, and the first layer's absmax jumps because the update wrote its
    embedding rows 1e4 times larger. It read 'the input batch's absmax jumped (seen at emb)':
    token ids do not jump. The weights' norm, as each update left them, is a precursor of its
    own, and the layers' jump is named from the first of them."""
    torch.manual_seed(0)
    model = R.make_token_lm()
    opt = torch.optim.AdamW(model.parameters(), lr=1e5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 5))
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=nn.CrossEntropyLoss(), out_dir=out_dir,
                            lr_scheduler=sched, factory="replay_models:make_token_lm"):
            for _ in range(20):
                ids = torch.randint(0, R.VOCAB, (8, 12), generator=g)
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1),
                                                   ids[:, 1:].flatten())
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
    rep = replay(info.value.bundle_path)
    lines = {(p["step"], p["kind"]): p["detail"] for p in rep["precursors"]}
    assert not any("input batch" in d for d in lines.values()), lines
    assert (2, "weight_jump") in lines, lines
    assert lines[(2, "absmax_jump")].startswith("absmax of emb jumped"), lines


def test_a_lora_weights_jump_is_not_read_as_the_input_batchs(out_dir):
    """Only the LoRA factors of a parametrized MLP train, at a learning rate of 1e3: the
    update of step 1 makes them huge, and at step 2 every layer's absmax jumps from the first
    module called, the first layer's parametrization, whose input is the frozen weight and
    whose output the adapted one. It read 'the input batch's absmax jumped (seen at
    0.parametrizations.weight.0, the first layer called)', sending the user to the data; the
    frozen base weights hide the jump from the weight norm."""
    model = L.make_lora_mlp()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e3)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=nn.CrossEntropyLoss(), out_dir=out_dir,
                            factory="lora_models:make_lora_mlp"):
            for _ in range(20):
                x, y = 4 * torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
    rep = replay(info.value.bundle_path)
    lines = {(p["step"], p["kind"]): p["detail"] for p in rep["precursors"]}
    assert not any("input batch" in d for d in lines.values()), lines
    assert lines[(2, "absmax_jump")].startswith(
        "absmax of 0.parametrizations.weight.0 jumped"), lines

"""End to end on Slot Attention autoencoders (``object_centric_models``): Locatello et al.'s
object discovery model (softmax over slots, the attention-weighted mean, GRU updates, a
spatial broadcast decoder whose alpha masks are softmaxed over slots), DINOSAUR's feature
reconstruction over padded ViT patches, SAVi's slots carried over between frames. Each planted
bug of the domain fires under the recorder and is replayed with the CLI; the healthy versions
raise no event and train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import object_centric_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("object_centric_models.py", text)


def batch(kind: str, g: torch.Generator, bad: int | None):
    """(model args, loss args after the model's outputs) of one step."""
    if kind == "dinosaur":
        x, mask = M.vit_features(g, bad)
        return (x, mask), (x, mask)
    img, slot_mask = M.scenes(g, bad, background=kind == "scenes_bg")
    return (img, slot_mask), (img,)


def train(kind: str, make: str, out_dir, bad: int | None = None, steps: int = 4,
          record: bool = True):
    """Adam with the Slot Attention paper's linear warmup, gradient clipping at 1 as its
    follow-ups do; the sample ``bad`` is planted in the last step's batch. Returns the
    model."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=4e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    crit = M.masked_feature_loss if kind == "dinosaur" else torch.nn.MSELoss()
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(1)  # (the slots' initial noise)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"object_centric_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step in range(steps):
            args, targets = batch(kind, g, bad if step == steps - 1 else None)
            out = model(*args)
            loss = loss_fn(*out[:1], *targets) if kind != "dinosaur" else loss_fn(
                *out, *targets)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    return model


def fire(kind: str, make: str, tmp_path, bad: int):
    with pytest.raises(NonFiniteError) as info:
        train(kind, make, tmp_path, bad)
    return info.value.event, info.value.bundle_path


def test_weighted_mean_without_eps_names_the_division_and_the_empty_record(tmp_path):
    """DINOSAUR over padded patch features with the eps of the attention-weighted mean
    removed: a record whose resize left no valid patch has every attention weight zeroed by
    the token mask, so ``attn / attn.sum(-1)`` is 0/0 for every slot of that record. The
    recorder and the replay name slot attention's division, its line, sample 5, and an eps
    in the denominator."""
    ev, bundle = fire("dinosaur", "make_dinosaur_no_eps", tmp_path, bad=5)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"], ev["kind"]) == (
        3, "forward", "slot_attention", [5], "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "slot_attention", "aten.div", "nan", [5]), o
    assert o["source"] == line_of("attn = attn / attn.sum(dim=-1, keepdim=True)  # the"), o
    assert rep["cause"] == "invalid" and "add an eps to the denominator" in rep["hint"], rep
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_alpha_softmax_over_no_active_slot_names_the_softmax_and_the_blank_scene(tmp_path):
    """The slot mask counts one slot per object and forgets the background's: a blank frame
    has no active slot, its alpha logits are -inf for every slot, and the softmax over slots
    is NaN at every pixel of that scene. The replay names the softmax in the root's decoder
    code on scene 2, the -inf fill as intended, and says to keep one entry per row."""
    ev, bundle = fire("scenes", "make_autoencoder", tmp_path, bad=2)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"], ev["kind"]) == (
        3, "forward", "", [2], "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=2")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten._softmax", "nan", [2])
    assert o["source"] == line_of("masks = alpha_logits.softmax(dim=1)"), o
    assert rep["cause"] == "invalid" and "every entry is -inf" in rep["hint"], rep["hint"]
    assert "keep at least one" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


@pytest.mark.parametrize("kind,make", [("scenes_bg", "make_autoencoder"),
                                       ("dinosaur", "make_dinosaur")])
def test_healthy_runs_raise_nothing_and_train_the_same(tmp_path, kind, make):
    """A blank scene whose background slot stays active (the other slots' -inf alpha logits
    stay inside the softmax), and an empty DINOSAUR record under the weighted mean's eps: no
    event, bit-identical weights with and without the recorder."""
    recorded = train(kind, make, tmp_path, bad=2)
    plain = train(kind, make, tmp_path, bad=2, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name

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
    if kind in ("dinosaur", "entropy"):
        x, mask = M.vit_features(g, bad)
        return (x, mask), (x, mask)
    if kind == "video":
        x, mask = M.video_features(g, bad)
        return (x, mask), (x, mask)
    img, slot_mask = M.scenes(g, None if kind == "mixture" else bad,
                              background=kind not in ("scenes", "log_mixture"))
    if kind == "mixture" and bad is not None:
        img[bad] *= 255  # a frame saved as 0-255 among 0-1 frames
    return (img, slot_mask), (img,)


LOSSES = {"dinosaur": M.masked_feature_loss, "video": M.masked_feature_loss,
          "mixture": M.mixture_nll, "entropy": M.feature_loss_with_entropy,
          "log_mixture": M.mixture_nll_log_space, "log_mixture_bg": M.mixture_nll_log_space,
          "colour": M.colour_consistency_loss}


def train(kind: str, make: str, out_dir, bad: int | None = None, steps: int = 4,
          record: bool = True, **settings):
    """Adam with the Slot Attention paper's linear warmup, gradient clipping at 1 as its
    follow-ups do; the sample ``bad`` is planted in the last step's batch. Returns the
    model."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=4e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    crit = LOSSES.get(kind, torch.nn.MSELoss())
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(1)  # (the slots' initial noise)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"object_centric_models:{make}", **settings) if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step in range(steps):
            args, targets = batch(kind, g, bad if step == steps - 1 else None)
            out = model(*args)
            loss = loss_fn(*(out if kind in LOSSES else out[:1]), *targets)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    return model


def fire(kind: str, make: str, tmp_path, bad: int | None, **settings):
    with pytest.raises(NonFiniteError) as info:
        train(kind, make, tmp_path, bad, **settings)
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


def test_savi_frame_without_patches_names_the_call_of_that_frame(tmp_path):
    """SAVi's slots carried from frame to frame, the weighted mean without eps: clip 1's
    frame 2 decoded with no valid patch. Slot attention runs once per frame; the event and the
    replay name its call 2 (the frame), the division and clip 1, whose earlier frames were
    finite."""
    ev, bundle = fire("video", "make_savi_no_eps", tmp_path, bad=1)
    assert (ev["step"], ev["module"], ev["call"], ev["samples"]) == (
        3, "slot_attention", 2, [1]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["call"], o["op"], o["samples"], rep["cause"]) == (
        "slot_attention", 2, "aten.div", [1], "invalid"), rep
    assert o["source"] == line_of("attn = attn / attn.sum(dim=-1, keepdim=True)  # the"), o


def fp16_nan_rows() -> list[int]:
    """The rows of the first step's slot-attention output that an unrecorded fp16 run makes
    non-finite (the replay's claim, checked independently)."""
    model = M.make_dinosaur_fp16()
    torch.manual_seed(1)
    x, mask = M.vit_features(torch.Generator().manual_seed(0))
    _, attn = model(x, mask)
    return torch.nonzero(~torch.isfinite(attn).flatten(1).all(1)).flatten().tolist()


def test_fp16_sharpened_attention_names_the_eps_float16_cannot_hold(tmp_path):
    """DINOSAUR under fp16 autocast with sharpened logits (an inverse temperature of 10): a
    slot that loses every patch gets softmax weights that underflow to 0 in float16, and the
    reference code's eps of 1e-8 rounds to 0 in float16 too, so the weighted mean's
    normalisation is 0/0 in the very first step. The replay calls it underflow, names the
    eps float16 cannot hold and the row an unrecorded run breaks; bf16 autocast (range of
    float32) trains the same model without an event (below)."""
    rows = fp16_nan_rows()
    assert rows, rows
    ev, bundle = fire("dinosaur", "make_dinosaur_fp16", tmp_path, bad=None)
    assert (ev["step"], ev["module"], ev["samples"]) == (0, "slot_attention", rows), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == (
        "slot_attention", "aten.div", rows, "underflow"), rep
    assert o["source"] == line_of("attn = attn / attn.sum(dim=-1, keepdim=True)"), o
    assert "the eps 1e-08 added to that input is 0 in float16" in rep["hint"], rep["hint"]


def test_mixture_likelihood_of_an_unscaled_frame_names_the_log_and_the_frame(tmp_path):
    """MONet's pixel mixture likelihood exponentiated and summed by hand: a frame saved as
    0-255 puts every slot's Gaussian density below float32's range, the sum is 0 and its log
    -inf. A loss event; the replay names the log, the frame, underflow, log space, and the
    frame's data as out of scale; dropping it makes the step finite."""
    ev, bundle = fire("mixture", "make_autoencoder", tmp_path, bad=6)
    assert (ev["step"], ev["phase"]) == (3, "loss"), ev
    rep = nanreplay_json(bundle, "--try", "drop=6")
    o = rep["origin"]
    assert (o["phase"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "loss", "aten.log", "-inf", [6], "underflow"), rep
    assert o["source"] == line_of("return -torch.log(lik).mean()"), o
    assert "logsumexp" in rep["hint"] and "out of scale" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_attention_entropy_over_padded_patches_names_the_log_and_the_padded_records(tmp_path):
    """An entropy penalty ``-(attn * attn.log())`` on the weighted mean's attention, without
    its eps: the token mask left exact zeros at the padded patches, log(0) = -inf, 0 * -inf =
    NaN, in the loss of the very first step. The replay names the log (the mul after it in
    the chain), exactly the records that have padding, and clamping away from the pole."""
    g = torch.Generator().manual_seed(0)
    padded = torch.nonzero(~M.vit_features(g)[1].all(1)).flatten().tolist()
    assert 0 < len(padded) < 8, padded
    ev, bundle = fire("entropy", "make_dinosaur_no_eps", tmp_path, bad=None)
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "loss", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "loss", "aten.log", "-inf", padded, "invalid"), rep
    assert o["source"] == line_of("entropy = -(attn * attn.log()).sum(-1).mean()"), o
    assert "clamp_min(eps)" in rep["hint"], rep["hint"]


def train_fp16_scaled(record: bool, out_dir, steps: int = 4):
    """DINOSAUR under fp16 autocast with a GradScaler started at 2**24 (it skips the first
    steps' overflowing gradients and halves its scale) and 2 accumulated micro-batches."""
    model = M.Dinosaur(amp=torch.float16)
    opt = torch.optim.AdamW(model.parameters(), lr=4e-4)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(1)
    rec = FlightRecorder(model, opt, loss_fn=M.masked_feature_loss, out_dir=out_dir,
                         factory="object_centric_models:make_dinosaur",
                         scaler=scaler) if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else M.masked_feature_loss
        for _ in range(steps):
            opt.zero_grad()
            for _ in range(2):
                x, mask = M.vit_features(g)
                loss = loss_fn(*model(x, mask), x, mask) / 2
                scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
    return model, scaler.get_scale()


def test_fp16_grad_scaler_skips_are_no_event_and_train_the_same(tmp_path):
    """The GradScaler's skipped steps (its scaled gradients overflow float16) are no event;
    the weights are bit-identical with and without the recorder."""
    torch.manual_seed(0)
    recorded, scale = train_fp16_scaled(True, tmp_path)
    torch.manual_seed(0)
    plain, _ = train_fp16_scaled(False, tmp_path)
    assert scale < 2.0 ** 24 and not list(tmp_path.glob("*.nan")), scale
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


class SceneSet(torch.utils.data.Dataset):
    """16 scenes as dict records (scene 13 blank, no background slot), as a DataLoader
    yields them."""

    def __init__(self):
        self.img, self.slot_mask = M.scenes(torch.Generator().manual_seed(0), 13,
                                            background=False, n=16)

    def __len__(self):
        return len(self.img)

    def __getitem__(self, i):
        return {"image": self.img[i], "slot_mask": self.slot_mask[i]}


def test_dataloader_dict_batches_name_the_blank_scene_by_its_row(tmp_path):
    """The same alpha softmax over no active slot, fed by a DataLoader of dict records as
    keyword arguments (``model(**batch)``): the fourth batch holds scene 13, its row 1; the
    replay names the softmax on row 1 and dropping it makes the step finite."""
    model = M.make_autoencoder()
    opt = torch.optim.Adam(model.parameters(), lr=4e-4)
    torch.manual_seed(1)
    loader = torch.utils.data.DataLoader(SceneSet(), batch_size=4)
    crit = torch.nn.MSELoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="object_centric_models:make_autoencoder") as rec:
            for batch in loader:
                loss = rec.loss_fn(model(**batch)[0], batch["image"])
                opt.zero_grad()
                loss.backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["module"], ev["samples"]) == (3, "", [1]), ev
    rep = nanreplay_json(info.value.bundle_path, "--try", "drop=1")
    o = rep["origin"]
    assert (o["op"], o["samples"], rep["cause"]) == ("aten._softmax", [1], "invalid"), rep
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_log_masks_in_the_output_name_the_fill_and_the_allow_inf_pattern(tmp_path):
    """Genesis-style log masks returned for a log-space mixture likelihood hold the -inf of
    the inactive slots in the root output: by default an event (in the first step, every
    scene has an inactive slot), which the replay says is the intended fill and answers with
    the ``allow_inf`` pattern of the root."""
    ev, bundle = fire("log_mixture", "make_autoencoder_log_masks", tmp_path, bad=None)
    assert (ev["step"], ev["module"], ev["kind"]) == (0, "", "-inf"), ev
    rep = nanreplay_json(bundle)
    assert (rep["origin"]["op"], rep["origin"]["all_samples"]) == ("aten.full_like", True)
    assert "allow_inf=['']" in " ".join(rep["problems"]), rep["problems"]


def test_log_softmax_over_no_active_slot_names_only_the_blank_scene(tmp_path):
    """The same log masks recorded with ``allow_inf=[""]``, the slot mask without the
    background's slot: the blank scene's log_softmax over slots is NaN, while every scene's
    inactive slots keep their -inf. The NaN's sample is the blank scene alone, not every row
    holding an allowed -inf (before, the replay said all 8 rows)."""
    ev, bundle = fire("log_mixture", "make_autoencoder_log_masks", tmp_path, bad=2,
                      allow_inf=[""])
    assert (ev["step"], ev["module"], ev["samples"], ev["kind"]) == (3, "", [2], "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=2")
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"], rep["cause"]) == (
        "aten._log_softmax", "nan", [2], "invalid"), rep
    assert o["source"] == line_of("return rgb, alpha_logits.log_softmax(dim=1)"), o
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_allowed_log_masks_with_a_background_slot_raise_nothing_and_train_the_same(tmp_path):
    """With the background's slot active and ``allow_inf=[""]``, the log masks' -inf reach
    the output and the loss's logsumexp every step: no event, bit-identical weights."""
    kind, make = "log_mixture_bg", "make_autoencoder_log_masks"
    recorded = train(kind, make, tmp_path, bad=2, allow_inf=[""])
    plain = train(kind, make, tmp_path, bad=2, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_mask_weighted_colour_of_an_inactive_slot_is_a_0_by_0_not_an_underflow(tmp_path):
    """A colour-consistency term divides each slot's mask-weighted colour by its mask's area;
    an inactive slot's alpha logits are -inf, its softmax mask exactly 0, so the area is 0
    and the division 0/0 in the loss of the first step, in every scene with an inactive
    slot. The replay names the division on those scenes and says invalid, an eps or a skip:
    before, it read the model's softmax on the autograd graph as positive and called the 0
    an underflow, to fix in log space, though exact arithmetic gives the same 0."""
    g = torch.Generator().manual_seed(0)
    inactive = torch.nonzero(~M.scenes(g)[1].all(1)).flatten().tolist()
    assert 0 < len(inactive) < 8, inactive
    ev, bundle = fire("colour", "make_autoencoder", tmp_path, bad=None)
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "loss", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "loss", "aten.div", "nan", inactive, "invalid"), rep
    assert o["source"] == line_of("owned = (masks * image[:, None]).sum(dim=(-2, -1)) / area")
    assert "add an eps to the denominator" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("kind,make", [("scenes_bg", "make_autoencoder"),
                                       ("scenes_bg", "make_autoencoder_implicit"),
                                       ("dinosaur", "make_dinosaur"),
                                       ("dinosaur", "make_dinosaur_bf16"),
                                       ("entropy", "make_dinosaur"),
                                       ("video", "make_savi"), ("mixture", "make_autoencoder")])
def test_healthy_runs_raise_nothing_and_train_the_same(tmp_path, kind, make):
    """A blank scene whose background slot stays active (the other slots' -inf alpha logits
    stay inside the softmax; also with implicit differentiation's detached last iteration), an empty DINOSAUR record and a SAVi clip's empty frame under the
    weighted mean's eps, sharpened logits under bf16 autocast, the mixture likelihood of
    in-scale frames: no event, bit-identical weights with and without the recorder."""
    bad = None if kind == "mixture" else 2
    recorded = train(kind, make, tmp_path, bad=bad)
    plain = train(kind, make, tmp_path, bad=bad, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name

"""End to end on vector-quantised models (``vector_quantization_models``): DALL-E's dVAE with a
Gumbel-softmax temperature the loop anneals, a cosine-similarity codebook over padded speech
features, a VQGAN quantiser's expanded distance and codebook-usage entropy under float16
autocast with a GradScaler, and FSQ feeding an EMA codebook with Laplace smoothing and
dead-code restarts. Each planted bug of the domain fires under the recorder and is replayed
with the CLI; the healthy versions raise no event and train bit-identically with and without
the recorder."""

from __future__ import annotations

import contextlib

import pytest
import torch
import vector_quantization_models as M
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

STEPS = 4


def line_of(text: str) -> str:
    return source_line("vector_quantization_models.py", text)


def image_batches(g, bad):
    return [((img,), (img,)) for img in (M.images(g) for _ in range(STEPS))]


def tokenizer_batches(g, bad):
    """Length-bucketed batches of full utterances; the last batch pads the rows ``bad``."""
    out = []
    for step in range(STEPS):
        lengths = [12] * 8
        if step == STEPS - 1:
            for row in bad or ():
                lengths[row] = 7
        feats, lens = M.padded_features(g, lengths)
        out.append(((feats, lens), (feats,)))
    return out


def padded_batches(g, bad):
    """Every batch pads a few utterances (a collate over random lengths)."""
    out = []
    for _ in range(STEPS):
        lengths = torch.randint(4, 13, (8,), generator=g).tolist()
        feats, lens = M.padded_features(g, lengths)
        out.append(((feats, lens), (feats,)))
    return out


def vqgan_batches(g, bad):
    """Images scaled to [-1, 1] as taming-transformers feeds them; in the last batch the rows
    ``bad`` are raw 12-bit camera frames (0..4095) whose ``/ 4095`` the loader skipped."""
    out = []
    for step in range(STEPS):
        img = M.images(g)
        scaled = img * 2 - 1
        if step == STEPS - 1:
            for row in bad or ():
                scaled[row] = img[row] * 4095
        out.append(((scaled,), (scaled,)))
    return out


KINDS = {  # batches, loss, optimizer's lr
    "dvae": (image_batches, M.dvae_loss),
    "tokenizer": (tokenizer_batches, M.tokenizer_loss),
    "restarts": (padded_batches, M.tokenizer_loss),
    "vqgan": (vqgan_batches, M.vqgan_loss),
    "fsq": (image_batches, M.fsq_loss),
    "rvq": (image_batches, M.dvae_loss),
}


def train(kind: str, make: str, out_dir, bad=None, record: bool = True,
          temperature=M.linear_temperature, init_scale: float = 2.0 ** 16):
    """AdamW with warmup-free cosine decay and gradient clipping, as taming-transformers and
    DALLE-pytorch train; the dVAE's temperature set on the model before each step; the VQGAN
    under float16 autocast with a GradScaler (unscaled before clipping). Returns the model."""
    batches, crit = KINDS[kind]
    model = getattr(M, make)()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.5, 0.9))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
    amp = kind == "vqgan"
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, enabled=amp)
    model.scales = []  # the scaler's scale after each step (a skipped step halves it)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(1)  # (Gumbel noise, dead-code restarts)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, scaler=scaler if amp else None,
                         factory=f"vector_quantization_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step, (args, targets) in enumerate(batches(g, bad)):
            if kind == "dvae":
                model.temperature = temperature(step, STEPS)
            with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
                out = model(*args)
                loss = loss_fn(*out, *targets)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            model.scales.append(scaler.get_scale())
    return model


def fire(kind: str, make: str, tmp_path, bad=None, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(kind, make, tmp_path, bad, **kw)
    return info.value.event, info.value.bundle_path


def test_gumbel_temperature_annealed_to_zero_names_the_division_and_the_setting(tmp_path):
    """A linear temperature schedule without a floor sets ``model.temperature = 0`` at the last
    step: ``gumbel_softmax`` divides the noisy logits by 0 (+-inf), its softmax makes NaN in
    every row. The replay re-runs with the recorded temperature, names the division by the
    number 0 on the Gumbel line, and points at the annealed setting, not at an eps."""
    ev, bundle = fire("dvae", "make_dvae", tmp_path)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (3, "forward", "", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"]) == (
        True, "", "aten.div", "+inf"), o
    assert o["source"] == line_of("soft_one_hot = F.gumbel_softmax("), o
    assert o["samples"] == list(range(8)), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "by the number 0" in rep["hint"] and "temperature" in rep["hint"], rep["hint"]
    assert any("<root>.temperature = 0.0 (the factory built 0.9)" in p for p in rep["problems"])


def test_cosine_codebook_normalising_a_padded_frame_names_the_division_and_the_padded_rows(
        tmp_path):
    """The tokenizer zeroes the padded frames before quantising, then l2-normalises by hand:
    0/0 at every padded frame. Only the utterances the last batch padded (2 and 5) are named,
    with the eps advice."""
    ev, bundle = fire("tokenizer", "make_tokenizer", tmp_path, bad=[2, 5])
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (
        3, "forward", "quantizer", "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=2,5")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "quantizer", "aten.div", "nan", [2, 5]), o
    assert o["source"] == line_of("z = z / z.norm(dim=-1, keepdim=True)"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"] and "eps" in rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_padded_frames_in_the_second_micro_batch_are_named_as_its_rows(tmp_path):
    """Gradient accumulation over two micro-batches of 4 utterances (the loss divided by 2):
    the last step's second micro-batch pads utterances 1 and 3. The event and the replay name
    micro-batch 1 and its own rows 1 and 3, the division and the eps advice."""
    model = M.make_tokenizer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.tokenizer_loss, out_dir=tmp_path,
                            factory="vector_quantization_models:make_tokenizer") as rec:
            for step in range(3):
                opt.zero_grad()
                for micro in range(2):
                    lengths = [6 if step == 2 and micro == 1 and i in (1, 3) else 12
                               for i in range(4)]
                    feats, lens = M.padded_features(g, lengths)
                    (rec.loss_fn(*model(feats, lens), feats) / 2).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["micro_batch"], ev["module"], ev["samples"]) == (
        2, 1, "quantizer", [1, 3]), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], o["micro_batch"], o["module"], o["op"], o["samples"]) == (
        True, 1, "quantizer", "aten.div", [1, 3]), o
    assert o["source"] == line_of("z = z / z.norm(dim=-1, keepdim=True)"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]


def test_float16_distance_of_a_raw_frame_is_overflow_of_the_squared_norm_and_the_frame(
        tmp_path):
    """Under float16 autocast the expanded distance's ``flat.pow(2)`` stays float16 on the CPU
    and overflows for the raw 12-bit frame 3; the entropy's softmax over ``-dist`` then makes
    NaN. The replay names the pow (not the softmax that made the NaN), overflow, and the frame
    as out of scale, which a wider type would only hide."""
    ev, bundle = fire("vqgan", "make_vqgan", tmp_path, bad=[3])
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (
        3, "forward", "quantize", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "quantize", "aten.pow", "+inf", [3]), o
    assert o["source"] == line_of("dist = (flat.pow(2).sum(1, keepdim=True)"), o
    assert rep["cause"] == "overflow", rep["cause"]
    assert "float32" in rep["hint"] and "out of scale" in rep["hint"], rep["hint"]


def test_temperature_given_to_forward_as_an_argument_is_replayed_from_the_batch(tmp_path):
    """DALLE-pytorch's loop: ``loss = vae(images, return_loss=True, temp=temp)``, no loss
    function, the annealed temperature a forward argument (no attribute changes). The bundle
    keeps the Python arguments, so the replay re-runs with ``temp=0.0`` and names the same
    division by the number 0 as when the loop set the attribute."""
    model = M.make_dvae()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(1)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=tmp_path,
                            factory="vector_quantization_models:make_dvae"):
            for step in range(STEPS):
                loss = model(M.images(g), return_loss=True,
                             temp=M.linear_temperature(step, STEPS))
                opt.zero_grad()
                loss.backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (3, "forward", "", "nan"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "", "aten.div", "+inf", list(range(8))), o
    assert o["source"] == line_of("soft_one_hot = F.gumbel_softmax(logits, tau=temp"), o
    assert rep["cause"] == "invalid" and "by the number 0" in rep["hint"], rep["hint"]
    assert not any("temperature" in p for p in rep.get("problems", [])), rep["problems"]


def test_kl_over_a_padded_vocabulary_names_the_product_and_the_mask_not_the_gumbel(tmp_path):
    """The codebook is padded to 32 codes and the 5 padding codes masked with -inf: the
    Gumbel-softmax gives them probability 0 (no NaN), but the KL to the uniform prior computes
    ``exp(-inf) * (-inf - log_uniform)``, 0 * -inf, in every row at the first step. The replay
    names kl_div's product, with the masked_fill as the chain's intended start, and tells to
    keep the masked codes out of the KL."""
    ev, bundle = fire("dvae", "make_dvae_padded", tmp_path, temperature=M.exp_temperature)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "forward", "", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "", "aten.mul", "nan", list(range(8))), o
    assert o["source"] == line_of("kl = F.kl_div(log_uniform, qy"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "the KL over the unmasked columns only" in rep["hint"], rep["hint"]


def test_dead_code_restarted_from_a_padded_frame_names_the_zero_code_rows(tmp_path):
    """Dead codes restart from random frames of the batch, padded (zeroed) frames included; the
    codes are l2-normalised by hand, so a restarted zero code is 0/0 at the next step, in every
    row (its NaN similarity wins every argmax). The replay names the division, the zero rows of
    the codebook and the restart from zeros as what wrote them."""
    ev, bundle = fire("restarts", "make_tokenizer_restarts", tmp_path)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (
        2, "forward", "quantizer", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "quantizer", "aten.div", "nan", list(range(8))), o
    assert o["source"] == line_of("codes = w / w.norm(dim=-1, keepdim=True)"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "quantizer.embed.weight is 0 in whole slices along dim 0" in rep["hint"]
    assert "re-initialisation of dead units from an input of zeros" in rep["hint"]


def test_soft_kmeans_sqrt_distance_to_codes_initialised_from_the_batch_names_its_backward(
        tmp_path):
    """The codebook is initialised on the first batch from its own frames, so each picked frame
    is at distance exactly 0 from its code; the hand-written euclidean distance's sqrt has an
    infinite derivative there: a backward event at step 0. The replay names SqrtBackward0 in the
    quantizer, the utterances whose frames became codes (recomputed from the same draw), and
    the sqrt of a sum of squares at coinciding points, with ``vector_norm`` as the fix."""
    ev, bundle = fire("tokenizer", "make_tokenizer_dkm", tmp_path)
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "backward", "nan"), ev
    torch.manual_seed(1)  # train's seed; the init's randperm is the step's first draw
    picked = sorted(set((torch.randperm(8 * 12)[:8] // 12).tolist()))
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["samples"]) == (
        True, "quantizer", "SqrtBackward0", picked), o
    assert o["source"] == line_of("dist = sq if self.squared else sq.sqrt()"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "where two points coincide" in rep["hint"] and "vector_norm" in rep["hint"]


def test_quantizer_dropout_keeping_no_stage_names_the_mean_over_stages_and_its_samples(tmp_path):
    """SoundStream's per-sample quantizer dropout drawn with ``randint(0, Q + 1)``: a sample that
    keeps no stage averages its commitment over 0 stages, 0/0. The replay names the division
    and exactly the samples the draw gave 0 stages (recomputed from the same draw)."""
    ev, bundle = fire("rvq", "make_rvq", tmp_path)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "forward", "rvq", "nan"), ev
    torch.manual_seed(1)  # train's seed; the dropout's draw is the step's first
    none_kept = torch.nonzero(torch.randint(0, 5, (8,)) == 0).flatten().tolist()
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "rvq", "aten.div", "nan", none_kept), o
    assert o["source"] == line_of("per_sample = (torch.stack(losses, 1) * active).sum(1)"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("kind, make, bad, kw", [
    ("dvae", "make_dvae", None, {"temperature": M.exp_temperature}),
    ("dvae", "make_dvae_padded_fixed", None, {"temperature": M.exp_temperature}),
    ("tokenizer", "make_tokenizer_safe", [2, 5], {}),
    ("restarts", "make_tokenizer_valid_restarts", None, {}),
    ("tokenizer", "make_tokenizer_dkm_squared", None, {}),
    ("vqgan", "make_vqgan_fp32", None, {}),
    ("fsq", "make_fsq", None, {}),
    ("rvq", "make_rvq_fixed", None, {}),
])
def test_healthy_runs_raise_nothing_and_train_the_same(tmp_path, kind, make, bad, kw):
    """The fixed versions (a floored temperature, the KL over the used codes while the
    Gumbel-softmax keeps its -inf padding codes, ``F.normalize``'s eps over padded frames,
    dead codes restarted from valid frames only, soft k-means over squared distances, float32
    distances, quantizer dropout keeping at least one stage) and FSQ into an EMA codebook with Laplace smoothing and dead-code
    restarts: no event, and bit-identical weights and codebooks with and without the
    recorder."""
    recorded = train(kind, make, tmp_path, bad, **kw)
    plain = train(kind, make, tmp_path, bad, record=False, **kw)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name
    if kind == "fsq":  # the restarts' randint drew the same rows under the recorder
        assert recorded.vq.restarts == plain.vq.restarts > 0


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # (skips)
def test_float16_steps_the_grad_scaler_skips_are_not_events(tmp_path):
    """A GradScaler started far too high (2**40): every step's float16 gradients overflow and
    the scaler skips the update and halves its scale, as it should; the recorder raises
    nothing, and the weights stay bit-identical to an unrecorded run's."""
    recorded = train("vqgan", "make_vqgan_fp32", tmp_path, init_scale=2.0 ** 40)
    plain = train("vqgan", "make_vqgan_fp32", tmp_path, init_scale=2.0 ** 40, record=False)
    assert recorded.scales == plain.scales == [2.0 ** 39, 2.0 ** 38, 2.0 ** 37, 2.0 ** 36]
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name

"""End to end on hand-written protein language models (``protein_language_models_models``):
ESM-2-style masked language modelling with rotary attention and ``-inf`` key padding masks, a
LoRA-adapted frozen backbone with a masked mean pool under bf16 autocast, ESM's contact head
(symmetrised attention maps, APC), unit-norm token embeddings over fixed-length crops. AdamW
with linear warm-up, gradient accumulation over two micro-batches padded per batch, gradient
clipping. Each planted bug of the domain fires under the recorder and is replayed with the
CLI; the healthy versions raise no event and train bit-identically with and without it."""

from __future__ import annotations

import contextlib

import protein_language_models_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("protein_language_models_models.py", text)


def crop_batch(g: torch.Generator, bad: int | None, crop: int = 20):
    """Fixed-length crops of random sequences (no padding); ``bad``: a letter outside the
    alphabet ('J') that the tokenizer maps to ``<pad>``."""
    seqs = [s[:crop].ljust(crop, "A") for s in M.random_seqs(g, n=4, lo=crop, hi=crop + 8)]
    if bad is not None:
        seqs[bad] = seqs[bad][:7] + "J" + seqs[bad][8:]
    return M.tokenize(seqs, unknown=M.PAD)


def micro_batches(kind: str, g: torch.Generator, bad: int | None):
    """Two micro-batches of (model args, loss args after the output); ``bad`` is planted in
    the second."""
    out = []
    for i in range(2):
        b = bad if i == 1 else None
        if kind == "mlm" and b is not None:
            # short antimicrobial peptides: 15 % masking of 12 residues draws none 14 % of
            # the time, as this seed does
            tokens = M.tokenize(["KWK", "GLF", "RRW", "FKA"])
            inputs, targets = M.mlm_mask(tokens, torch.Generator().manual_seed(1))
            assert (targets == -100).all()
            out.append(((inputs,), (targets,)))
            continue
        if kind in ("mlm", "cosine", "standard"):
            seqs = M.random_seqs(g, 4)
            if kind == "standard" and b is not None:  # a UniProt entry with unknown residues
                seqs[b] = "XXXXXXXXXX" + seqs[b][10:]
            tokens = crop_batch(g, b) if kind == "cosine" else M.tokenize(seqs)
            inputs, targets = M.mlm_mask(tokens, g)
            out.append(((inputs,), (targets,)))
            continue
        seqs = M.random_seqs(g, 4)
        if kind == "peptides" and b is not None:  # a batch of peptides of 5 residues
            seqs = [s[:5] for s in seqs]
        elif b is not None:
            seqs[b] = "" if kind != "residue" else seqs[b]  # cropping a window past the sequence's end leaves <cls><eos>
        tokens = M.tokenize(seqs)
        if kind == "regress":
            out.append(((tokens,), (torch.randn(4, generator=g),)))
            continue
        if kind == "residue":
            target = torch.rand(tokens.shape, generator=g)
            resolved = M.residue_mask(tokens).float()
            if b is not None:  # residues 3-6 unresolved: mmCIF's missing lDDT read as NaN
                target[b, 3:7], resolved[b, 3:7] = float("nan"), 0.0
            out.append(((tokens,), (target, resolved)))
            continue
        n = tokens.shape[1]
        contacts = (torch.rand(4, n, n, generator=g) < 0.1).float()
        real = M.residue_mask(tokens)
        sep = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs() >= 6
        valid = (real[:, :, None] & real[:, None, :] & sep).float()
        out.append(((tokens,), (contacts, valid)))
    return out


LOSSES = {"mlm": M.mlm_loss, "standard": M.mlm_loss, "cosine": M.mlm_loss, "regress": torch.nn.MSELoss(),
          "contacts": M.contact_loss, "peptides": M.contact_loss, "residue": M.residue_loss}


def train(kind: str, make: str, out_dir, bad: int | None = None, steps: int = 3,
          record: bool = True):
    """AdamW with linear warm-up, two accumulated micro-batches, clipping at 1.0; the
    regressor under bf16 autocast. ``bad`` is planted in the last step. Returns the model."""
    model = getattr(M, make)()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))
    crit = LOSSES[kind]
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(1)
    # (the restricted head's -inf logits of non-standard tokens are intended)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"protein_language_models_models:{make}",
                         allow_inf=[""] if kind == "standard" else []) if record else None
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind == "regress")
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step in range(steps):
            opt.zero_grad()
            for args, targets in micro_batches(kind, g, bad if step == steps - 1 else None):
                with amp:
                    out = model(*args)
                loss = loss_fn(out.float(), *targets) / 2
                loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
    return model


def fire(kind: str, make: str, tmp_path, bad: int):
    with pytest.raises(NonFiniteError) as info:
        train(kind, make, tmp_path, bad)
    return info.value.event, info.value.bundle_path


def test_masking_that_drew_no_residue_names_the_cross_entropy_and_the_fix(tmp_path):
    """A micro-batch of short peptides whose 15 % masking drew no residue: every target is
    ``ignore_index``, and cross-entropy's mean over 0 tokens is 0/0. A loss event in the
    second micro-batch, named at ``nll_loss_forward`` on the loss's line, ``invalid``, with
    the advice to skip such batches or divide a sum by max(count, 1)."""
    ev, bundle = fire("mlm", "make_esm", tmp_path, bad=0)
    assert (ev["step"], ev["phase"]) == (2, "loss"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["op"], o["micro_batch"]) == (
        True, "loss", "aten.nll_loss_forward", 1), o
    assert o["source"] == line_of("return F.cross_entropy(logits.reshape(-1, VOCAB)"), o
    assert rep["cause"] == "invalid", rep
    assert "ignore_index" in rep["hint"] and "max(count, 1)" in rep["hint"], rep["hint"]


def test_sequence_of_only_special_tokens_names_the_masked_mean_pool(tmp_path):
    """A crop left one sequence as ``<cls><eos>``: the masked mean pool over real residues
    divides 0 by 0 in its row, under bf16 autocast with LoRA on a frozen backbone. The
    recorder stops at the root's output; the replay names the pool's division, sample 2, and
    says its token ids hold nothing but the ids every sample holds and padding."""
    ev, bundle = fire("regress", "make_regressor", tmp_path, bad=2)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (2, "forward", "", [2]), ev
    rep = nanreplay_json(bundle, "--try", "drop=2")
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], o["micro_batch"]) == ("", "aten.div", [2], 1), o
    assert o["source"] == line_of("pooled = (x * real).sum(1) / real.sum(1)  # the bug"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert "Sample(s) 2 are empty records: batch (token ids) holds" in rep["hint"], rep["hint"]
    assert "count.clamp_min(1)" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_apc_of_an_empty_attention_map_names_the_in_place_division_and_the_record(tmp_path):
    """ESM's contact head over a sequence with no real residue: its symmetrised attention map
    is all 0, so APC's ``a_i. a_.j / a..`` is 0/0 in the in-place ``div_``. The replay names
    ``contact_head``, the ``div_``, sample 1, and the empty record (the pair mask with no
    valid entry in its row)."""
    ev, bundle = fire("contacts", "make_contacts", tmp_path, bad=1)
    assert (ev["step"], ev["module"], ev["samples"]) == (2, "contact_head", [1]), ev
    rep = nanreplay_json(bundle, "--try", "drop=1")
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"]) == ("contact_head", "aten.div_", [1]), o
    assert o["source"] == line_of("avg.div_(a12)"), o
    assert rep["cause"] == "invalid" and "empty records" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_batch_of_peptides_with_no_contact_pair_names_the_loss_mean_over_nothing(tmp_path):
    """A micro-batch of 5-residue peptides has no residue pair at separation >= 6, so the
    contact loss's mean over valid pairs divides 0 by 0 for the whole batch: a loss event,
    the loss's division, no sample to blame, and the advice to floor the count."""
    ev, bundle = fire("peptides", "make_contacts", tmp_path, bad=0)
    assert (ev["step"], ev["phase"], ev["samples"]) == (2, "loss", []), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["op"], o["samples"], o["micro_batch"]) == (
        "loss", "aten.div", [], 1), o
    assert o["source"] == line_of("return (loss * valid).sum() / valid.sum()"), o
    assert rep["cause"] == "invalid" and "no row is to blame" in rep["hint"], rep["hint"]
    assert "count.clamp_min(1)" in rep["hint"], rep["hint"]


def test_unknown_letter_mapped_to_the_zeroed_pad_row_names_the_embedding_norm(tmp_path):
    """Fixed-length crops never pad, until a 'J' the tokenizer maps to ``<pad>``: the pad row
    the embedding zeroed is normalised, 0/0 at that residue of sample 3. The hint names the
    id and its place in the batch and sends the user to the tokenizer (an id of its own for
    unknown letters), not only to an eps."""
    ev, bundle = fire("cosine", "make_cosine", tmp_path, bad=3)
    assert (ev["step"], ev["module"], ev["samples"]) == (2, "embed_tokens", [3]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"]) == ("embed_tokens", "aten.div", [3]), o
    assert o["source"] == line_of("return e / e.norm(dim=-1, keepdim=True)  # the bug"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert "batch holds the id 1 (sample 3 position 8)" in rep["hint"], rep["hint"]
    assert "tokenizer" in rep["hint"] and "<unk>" in rep["hint"], rep["hint"]


def test_pairwise_padding_mask_names_the_softmax_of_fully_masked_rows(tmp_path):
    """A pair mask (query or key padded) leaves each padded query's score row all ``-inf``:
    softmax makes NaN there from the first step. The loss ignores those positions and stays
    finite, and unrecorded the weights turn NaN through the backward. The recorder stops in
    the first layer's attention; the replay names its softmax, the samples with padding (an
    independent count of the first micro-batch), and the fully masked row's fix."""
    g = torch.Generator().manual_seed(0)
    padded = (M.tokenize(M.random_seqs(g, 4)) == M.PAD).any(1).nonzero().flatten().tolist()
    assert 0 < len(padded) < 4, padded
    ev, bundle = fire("mlm", "make_esm_pairwise", tmp_path, bad=None)
    assert (ev["step"], ev["module"], ev["samples"]) == (0, "layers.0.attn", padded), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], o["micro_batch"]) == (
        "layers.0.attn", "aten._softmax", padded, 0), o
    assert o["source"] == line_of("attn = scores.softmax(-1)"), o
    assert rep["cause"] == "invalid" and "fully masked row" in rep["hint"], rep["hint"]
    assert "keep at least one key per row" in rep["hint"], rep["hint"]
    model = train("mlm", "make_esm_pairwise", tmp_path, record=False)
    assert not all(torch.isfinite(p).all() for p in model.parameters())


def test_unresolved_residues_read_as_nan_name_the_mask_product_in_the_loss(tmp_path):
    """A structure's unresolved residues have no lDDT: the data loader reads them as NaN and
    masks them with ``resolved`` 0, but the loss multiplies by the mask, and NaN * 0 is NaN.
    An input event on the loss target's sample 1; the replay names the product's line and
    says to fill or select the missing values before the first op that reads them."""
    ev, bundle = fire("residue", "make_residue_head", tmp_path, bad=1)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        2, "input", "<loss>", [1]), ev
    assert "loss_args[1]" in ev["detail"], ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["samples"], o["micro_batch"]) == ("input", [1], 1), o
    assert o["source"] == line_of("return ((pred - target) ** 2 * resolved).sum()"), o
    assert rep["cause"] == "input" and "NaN * 0 is NaN" in rep["hint"], rep["hint"]
    assert "torch.where(observed, x, 0)" in rep["hint"], rep["hint"]


def test_masked_unknown_residue_under_a_standard_amino_acid_head_names_the_forbidden_target(
        tmp_path):
    """The head fills the logits of every non-standard token with ``-inf`` (allowed by
    ``allow_inf``), but a UniProt entry with a run of 'X' residues gets some of them masked
    as MLM targets: cross-entropy's log-probability of such a target is -inf. A loss event;
    the replay names ``nll_loss_forward`` on sample 2 and says the mask forbids the target."""
    ev, bundle = fire("standard", "make_esm_standard", tmp_path, bad=2)
    assert (ev["step"], ev["phase"], ev["kind"]) == (2, "loss", "+inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["op"], o["samples"], o["micro_batch"]) == (
        "loss", "aten.nll_loss_forward", [2], 1), o
    assert o["source"] == line_of("return F.cross_entropy(logits.reshape(-1, VOCAB)"), o
    assert rep["cause"] == "invalid" and "target on a masked class" in rep["hint"], rep["hint"]


def test_lora_rank_zero_names_the_scale_buffer_not_an_underflow(tmp_path):
    """A rank pattern gives the last layer's v projection r = 0: its A and B are empty, their
    product an exact 0 (a sum of no terms), and ``alpha / ranknum`` divides it by 0 under
    bf16 autocast. The replay names the division in that LoRA layer, every sample, and the
    scalar buffer ``ranknum`` at 0 as the divisor: ``invalid``, not an underflow of a
    positive product (an empty product was taken for one), and no crash on a 0-d buffer."""
    with pytest.raises(NonFiniteError) as info:
        train("regress", "make_rank_pattern", tmp_path)
    ev, bundle = info.value.event, info.value.bundle_path
    assert (ev["step"], ev["module"], ev["samples"]) == (
        0, "esm.layers.1.attn.v_proj", [0, 1, 2, 3]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["all_samples"]) == (
        "esm.layers.1.attn.v_proj", "aten.div", True), o
    assert o["source"] == line_of("self.lora_b(self.lora_a(x)) * self.alpha / self.ranknum"), o
    assert rep["cause"] == "invalid", rep
    assert "buffer esm.layers.1.attn.v_proj.ranknum, a scalar" in rep["hint"], rep["hint"]
    assert "LoRA rank" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("kind,make", [("mlm", "make_esm"), ("regress", "make_regressor_safe"),
                                       ("contacts", "make_contacts"), ("cosine", "make_cosine"),
                                       ("residue", "make_residue_head"),
                                       ("standard", "make_esm_standard")])
def test_healthy_runs_raise_nothing_and_train_the_same(tmp_path, kind, make):
    """Key padding masks filled with ``-inf`` before the softmax (rows of padding queries
    stay finite: every row keeps its ``<cls>`` key), a head's ``-inf`` logits of the
    non-standard tokens that reach the loss (allowed), bf16 autocast with LoRA, the contact
    head's APC over real sequences, the unit-norm embedding over crops: no event, and the
    weights are bit-identical with and without the recorder."""
    recorded = train(kind, make, tmp_path)
    plain = train(kind, make, tmp_path, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name

"""Hugging Face ``transformers`` architectures beyond ``hf_model_zoo_models``', fine-tuned with
the plain loop their model cards show (``model(**batch).loss``, AdamW), for
``test_hf_architectures``: ``BartForConditionalGeneration`` (shared, tied embeddings,
``decoder_input_ids`` shifted from the labels), ``WhisperForConditionalGeneration`` (log-mel
input features), ``CLIPModel`` (``return_loss=True``, a learnable ``logit_scale``),
``DebertaV2ForSequenceClassification`` (disentangled attention), ``MixtralForCausalLM`` (a
routed MoE, ``output_router_logits=True``: the model adds the load-balancing loss) and
``RobertaForSequenceClassification`` with ``problem_type="multi_label_classification"``;
each from a tiny config by a factory (nothing downloaded)."""

from __future__ import annotations

import torch

VOCAB, PAD, BOS, EOS = 64, 1, 0, 2
B, T = 4, 8


def make_bart():
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    return BartForConditionalGeneration(BartConfig(
        vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, max_position_embeddings=32, pad_token_id=PAD, bos_token_id=BOS,
        eos_token_id=EOS, decoder_start_token_id=EOS, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0))


def make_whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    return WhisperForConditionalGeneration(WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=8, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, d_model=16, max_source_positions=8, max_target_positions=16,
        pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, decoder_start_token_id=BOS,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0))


def make_clip():
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(0)
    return CLIPModel(CLIPConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2,
                         max_position_embeddings=16, pad_token_id=PAD, bos_token_id=BOS,
                         eos_token_id=EOS),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, image_size=16, patch_size=8, num_channels=3),
        projection_dim=16))


def make_deberta():
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    torch.manual_seed(0)
    return DebertaV2ForSequenceClassification(DebertaV2Config(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32, relative_attention=True,
        position_buckets=8, pos_att_type=["p2c", "c2p"], max_relative_positions=16,
        num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        pad_token_id=PAD))


def make_mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32, output_router_logits=True,
        router_aux_loss_coef=0.02, pad_token_id=PAD))


def make_roberta():
    from transformers import RobertaConfig, RobertaForSequenceClassification

    torch.manual_seed(0)
    return RobertaForSequenceClassification(RobertaConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=40, num_labels=4,
        problem_type="multi_label_classification", hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=PAD))


# ---- data ------------------------------------------------------------------------------------


def tokens(k, empty=None, seed=0):
    """Batch ``k``'s ids, right-padded past position 6, and attention mask; at ``empty =
    (batch, row)`` that row is an empty text (all padding, its mask all 0)."""
    g = torch.Generator().manual_seed(seed + k)
    ids = torch.randint(3, VOCAB, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[:, 6:] = 0
    if empty is not None and empty[0] == k:
        mask[empty[1]] = 0
    return ids.masked_fill(mask == 0, PAD), mask


def seq2seq(n, empty=None, unlabelled_at=None):
    """BART batches: ``labels`` padded with -100; at batch ``unlabelled_at`` every target
    position is -100 (answers a truncation cut off)."""
    out = []
    for k in range(n):
        ids, mask = tokens(k, empty)
        tgt, tmask = tokens(k, seed=50)
        labels = tgt.masked_fill(tmask == 0, -100)
        if k == unlabelled_at:
            labels[:] = -100
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def speech(n, nan_at=None):
    """Whisper batches of 8-bin log-mel features over 16 frames; at ``nan_at = (batch, row)``
    one bin of one frame is NaN (a clip's log-mel of a corrupt frame)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for k in range(n):
        feats = torch.randn(B, 8, 16, generator=g)
        if nan_at is not None and nan_at[0] == k:
            feats[nan_at[1], 3, 5] = float("nan")
        tgt, tmask = tokens(k, seed=50)
        out.append({"input_features": feats, "labels": tgt.masked_fill(tmask == 0, -100)})
    return out


def image_text(n):
    """CLIP batches: captions ending in EOS at position 5, 16x16 images, ``return_loss``."""
    g = torch.Generator().manual_seed(0)
    out = []
    for k in range(n):
        ids, mask = tokens(k)
        ids[:, 5] = EOS
        out.append({"input_ids": ids, "attention_mask": mask, "return_loss": True,
                    "pixel_values": torch.randn(B, 3, 16, 16, generator=g)})
    return out


def classified(n, empty=None, multi_label=False, missing_at=None):
    """Text classification batches: a class each, or (``multi_label``) 4 binary labels as
    floats; at ``missing_at = (batch, row, label)`` that label is unknown, read as NaN."""
    g = torch.Generator().manual_seed(0)
    out = []
    for k in range(n):
        ids, mask = tokens(k, empty)
        labels = (torch.rand(B, 4, generator=g) > 0.5).float() if multi_label \
            else torch.randint(0, 3, (B,), generator=g)
        if missing_at is not None and missing_at[0] == k:
            labels[missing_at[1:]] = float("nan")
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def causal_lm(n, empty=None):
    """Causal-LM batches: ``labels`` = ids, padding at -100."""
    return [{"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
            for ids, mask in (tokens(k, empty) for k in range(n))]


def hot_router(model, scale=1e7):
    """A Mixtral whose router was loaded from a checkpoint saved with a wrong scale: the
    gate's weight entries in the 1e5s, past float16's range."""
    with torch.no_grad():
        model.model.layers[0].mlp.gate.weight.mul_(scale)
    return model


# ---- the loop --------------------------------------------------------------------------------


def train(model, opt, batches, dtype=None):
    """The model cards' loop: the model's own loss, AdamW; autocast at ``dtype``. The losses."""
    model.train()
    losses = []
    for batch in batches:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def temperature_as_scale(model):
    """CLIP's ``logit_scale`` (a log) set to the temperature cap 100 itself, as a script
    porting OpenAI's ``logit_scale.clamp(0, 100)`` (applied to the exp) writes it."""
    with torch.no_grad():
        model.logit_scale.fill_(100.0)
    return model

"""Hugging Face ``transformers`` models fine-tuned with plain loops, as their model cards'
scripts write them, for ``test_hf_model_zoo``: tiny ``LlamaForCausalLM`` (RoPE, RMSNorm, SDPA
attention under a padding mask), ``T5ForConditionalGeneration`` (relative position bias,
``decoder_input_ids`` shifted from ``-100`` labels), ``BertForMaskedLM`` fed by
``DataCollatorForLanguageModeling``, ``ViTForImageClassification`` and ``Wav2Vec2ForCTC`` (CTC
with input lengths from the attention mask), each built from a config by a factory (nothing
downloaded); AdamW, ``get_linear_schedule_with_warmup``, gradient clipping, autocast."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, PAD, BOS, EOS, MASK = 64, 0, 1, 2, 3


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, attn_implementation="sdpa")


def make_llama():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config())


class LlamaMeanPooled(nn.Module):
    """A sentence embedder/classifier on ``LlamaModel`` (as LLM2Vec-style recipes pool a
    decoder): the last hidden states mean-pooled over the attention mask, then a linear
    head. ``model`` is the ``LlamaModel``, so names read ``model.layers.0.self_attn...``."""

    def __init__(self, labels=3):
        super().__init__()
        from transformers import LlamaModel

        self.model = LlamaModel(llama_config())
        self.score = nn.Linear(32, labels, bias=False)

    def forward(self, input_ids, attention_mask, labels=None):
        h = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * m).sum(1) / m.sum(1)  # the bug: no clamp, 0/0 for a row of padding
        return self.score(pooled)


def make_llama_pooled():
    torch.manual_seed(0)
    return LlamaMeanPooled()


class LlamaCosineEmbedder(LlamaMeanPooled):
    """The embedder trained as a cosine classifier (sentence-embedding fine-tuning): the mean
    pool floored at one token, then L2-normalised with a hand-written norm."""

    def forward(self, input_ids, attention_mask, labels=None):
        h = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * m).sum(1) / m.sum(1).clamp_min(1.0)
        norm = pooled.pow(2).sum(-1, keepdim=True).sqrt()  # the bug: sqrt's gradient at 0
        return 20.0 * self.score(pooled / norm.clamp_min(1e-6))


def make_llama_cosine():
    torch.manual_seed(0)
    return LlamaCosineEmbedder()


def make_t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=PAD, eos_token_id=EOS,
        decoder_start_token_id=PAD, dropout_rate=0.0))


def make_bert_mlm():
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    return BertForMaskedLM(BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, pad_token_id=PAD,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def make_vit():
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    return ViTForImageClassification(ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=64, num_labels=5,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def make_wav2vec2():
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    torch.manual_seed(0)
    return Wav2Vec2ForCTC(Wav2Vec2Config(
        vocab_size=12, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, conv_dim=(16, 16), conv_kernel=(10, 3), conv_stride=(5, 2),
        num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2, feat_extract_norm="layer",
        do_stable_layer_norm=True, mask_time_prob=0.0, hidden_dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
        final_dropout=0.0, layerdrop=0.0, pad_token_id=0, ctc_loss_reduction="mean"))


# ---- data ------------------------------------------------------------------------------------


def token_rows(n, seed=0, lo=4, hi=12):
    """Tokenized texts of ``lo``..``hi`` ids (``[BOS] ... [EOS]``), unpadded lists."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        k = int(torch.randint(lo, hi, (1,), generator=g))
        rows.append([BOS, *torch.randint(4, VOCAB, (k,), generator=g).tolist(), EOS])
    return rows


def pad_batch(rows, side="left"):
    """``tokenizer.pad``: ids padded with ``PAD`` (left, for a decoder), ``attention_mask``."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            sl = slice(width - len(r), width) if side == "left" else slice(0, len(r))
            ids[i, sl], mask[i, sl] = torch.tensor(r), 1
    return ids, mask


def causal_lm_batches(n_batches, b=4, empty=None, seed=0):
    """Llama batches: ``labels`` = ids with padding at ``-100``; at ``empty = (batch, row)``
    the row is an empty document (no tokens: its attention mask all 0)."""
    out = []
    for k in range(n_batches):
        rows = token_rows(b, seed=seed + k)
        if empty is not None and empty[0] == k:
            rows[empty[1]] = []
        ids, mask = pad_batch(rows)
        out.append({"input_ids": ids, "attention_mask": mask,
                    "labels": ids.masked_fill(mask == 0, -100)})
    return out


def classify_batches(n_batches, b=4, empty=None, seed=0):
    """:func:`causal_lm_batches` with a class label per text for the pooled classifier."""
    out = causal_lm_batches(n_batches, b, empty, seed)
    g = torch.Generator().manual_seed(seed)
    return [{**x, "labels": torch.randint(0, 3, (b,), generator=g)} for x in out]


def hot_ff(model, block=1, scale=300.0):
    """A T5 whose encoder block ``block`` feed-forward runs hot, as the pretrained T5/mT5
    checkpoints' do (activations past fp16's 65504 in ``wo``): ``wi`` and ``wo`` scaled up."""
    ff = model.encoder.block[block].layer[1].DenseReluDense
    with torch.no_grad():
        ff.wi.weight.mul_(scale)
        ff.wo.weight.mul_(scale)
    return model


def seq2seq_batches(n_batches, b=4, seed=0):
    """T5 batches: source ids right-padded, ``labels`` target ids padded with ``-100`` (the
    model shifts them into ``decoder_input_ids``)."""
    out = []
    for k in range(n_batches):
        ids, mask = pad_batch(token_rows(b, seed=seed + k), side="right")
        tgt, tmask = pad_batch(token_rows(b, seed=100 + seed + k, lo=2, hi=6), side="right")
        out.append({"input_ids": ids, "attention_mask": mask,
                    "labels": tgt.masked_fill(tmask == 0, -100)})
    return out


class MiniTokenizer:
    """What ``DataCollatorForLanguageModeling`` reads of a tokenizer, without a download."""

    mask_token, pad_token, pad_token_id, padding_side = "[MASK]", "[PAD]", PAD, "right"
    model_input_names = ["input_ids", "attention_mask"]

    def convert_tokens_to_ids(self, token):
        return MASK if token == "[MASK]" else PAD

    def get_special_tokens_mask(self, ids, already_has_special_tokens=True):
        return [int(t in (PAD, BOS, EOS)) for t in ids]

    def pad(self, features, return_tensors="pt", **kw):
        ids, mask = pad_batch([list(f["input_ids"]) for f in features], side="right")
        return {"input_ids": ids, "attention_mask": mask}

    def __len__(self):
        return VOCAB


def mlm_collator(p=0.15):
    from transformers import DataCollatorForLanguageModeling

    return DataCollatorForLanguageModeling(MiniTokenizer(), mlm_probability=p, seed=0)


def mlm_batches(n_batches, b=4, short_at=None, seed=0):
    """Masked-LM batches through the collator; at batch ``short_at`` every text is a one-word
    title (``[BOS] w [EOS]``), whose lone maskable token the 15% draw skips."""
    collate = mlm_collator()
    out = []
    for k in range(n_batches):
        rows = token_rows(b, seed=seed + k, lo=1, hi=2) if k == short_at else \
            token_rows(b, seed=seed + k)
        out.append(collate([{"input_ids": r} for r in rows]))
    return out


def images(n_batches, b=4, nan_at=None, seed=0):
    """ViT batches of normalized 16x16 images; ``nan_at = (batch, row)`` holds a decoded
    image with a NaN pixel (a corrupt file's channel divided by a zero std)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n_batches):
        x = torch.randn(b, 3, 16, 16, generator=g)
        if nan_at is not None and nan_at[0] == k:
            x[nan_at[1], 1, 5, 7] = float("nan")
        out.append({"pixel_values": x, "labels": torch.randint(0, 5, (b,), generator=g)})
    return out


def audio(n_batches, b=4, long_at=None, seed=0):
    """Wav2Vec2 batches: right-padded waveforms with an attention mask, character labels
    padded with ``-100``; at ``long_at = (batch, row)`` a 0.1 s clip carries a sentence's
    transcript (more labels than the clip has frames)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n_batches):
        lens = torch.randint(300, 400, (b,), generator=g)
        tl = torch.randint(2, 6, (b,), generator=g)
        if long_at is not None and long_at[0] == k:
            lens[long_at[1]], tl[long_at[1]] = 120, 30
        x = torch.zeros(b, 400)
        mask = torch.zeros(b, 400, dtype=torch.long)
        labels = torch.full((b, int(tl.max())), -100)
        for i in range(b):
            x[i, :lens[i]] = torch.randn(int(lens[i]), generator=g)
            mask[i, :lens[i]] = 1
            labels[i, :tl[i]] = torch.randint(1, 12, (int(tl[i]),), generator=g)
        out.append({"input_values": x, "attention_mask": mask, "labels": labels})
    return out


# ---- losses ----------------------------------------------------------------------------------


class ShiftedLMLoss(nn.Module):
    """The causal-LM loss written out as in a custom loop: logits ``[:, :-1]`` against
    labels ``[:, 1:]``, ``-100`` ignored, in float32."""

    def forward(self, logits, labels):
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                               ignore_index=-100)


class TokenMeanLoss(nn.Module):
    """Masked-LM loss averaged over the masked tokens, as a pretraining script's
    ``(loss * mask).sum() / mask.sum()`` normalisation."""

    def forward(self, logits, labels):
        per_tok = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten().clamp_min(0),
                                  reduction="none")
        m = (labels.flatten() != -100).float()
        return (per_tok * m).sum() / m.sum()  # the bug: 0/0 when no token is masked


class FocalLoss(nn.Module):
    """Focal loss for imbalanced classes (Lin et al.), written from the paper's formula on
    the softmax probability of the true class, sharpened by a temperature ``t``."""

    def __init__(self, gamma=2.0, t=0.2):
        super().__init__()
        self.gamma, self.t = gamma, t

    def forward(self, logits, labels):
        pt = (logits / self.t).softmax(-1).gather(1, labels[:, None]).squeeze(1)
        return (-(1 - pt) ** self.gamma * pt.log()).mean()  # the bug: log of a pt rounded to 0


def new_head(model):
    """The classifier re-initialised for the new label set with ``nn.init.normal_``'s
    default std of 1 (the config's ``initializer_range`` is 0.02): logits in the tens."""
    nn.init.normal_(model.classifier.weight)
    return model


# ---- the loop --------------------------------------------------------------------------------


def train(model, opt, batches, loss_fn=None, dtype=None, clip=1.0, warmup=2):
    """The model cards' fine-tuning loop: AdamW (``opt``), a linear warmup schedule,
    autocast at ``dtype``, clipping; the loss is ``loss_fn(logits, labels)`` or the model's."""
    from transformers import get_linear_schedule_with_warmup

    sched = get_linear_schedule_with_warmup(opt, warmup, len(batches))
    model.train()
    for batch in batches:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            if loss_fn is None:
                loss = model(**batch).loss
            else:
                inputs = {k: v for k, v in batch.items() if k != "labels"}
                out = model(**inputs)
                loss = loss_fn(getattr(out, "logits", out), batch["labels"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
    return model

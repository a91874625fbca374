"""Hugging Face ``transformers`` training as its users write it, for ``test_hf_trainer_stack``:
tiny models built from configs (nothing downloaded) — ``BertForSequenceClassification``,
``GPT2LMHeadModel``, ``T5ForConditionalGeneration`` and a mean-pooled head on ``AutoModel`` —
a ``Trainer`` subclass overriding ``compute_loss`` (a class-weighted cross-entropy, a
distillation loss against a frozen teacher), and token data padded by
``DataCollatorWithPadding`` / ``DataCollatorForLanguageModeling`` with attention masks and
``-100`` labels."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, PAD, CLS, SEP, MASK, LABELS = 96, 0, 1, 2, 3, 3


def bert_config(**kw):
    from transformers import BertConfig

    return BertConfig(**{**dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                num_attention_heads=2, intermediate_size=64,
                                max_position_embeddings=64, pad_token_id=PAD,
                                num_labels=LABELS, attn_implementation="eager"), **kw})


def make_bert_cls():
    """``BertForSequenceClassification`` (the factory ``nanreplay`` rebuilds it with)."""
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(bert_config())


def make_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB,
                                      n_positions=64, bos_token_id=CLS, eos_token_id=SEP,
                                      pad_token_id=PAD, attn_implementation="eager"))


def make_t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
        pad_token_id=PAD, eos_token_id=SEP, decoder_start_token_id=PAD))


class MeanPooledClassifier(nn.Module):
    """A custom head on ``AutoModel``: the encoder's hidden states mean-pooled over the
    attention mask (as sentence-transformers pools), then a linear classifier."""

    def __init__(self):
        super().__init__()
        from transformers import AutoModel

        self.encoder = AutoModel.from_config(bert_config(), add_pooling_layer=False)
        self.head = nn.Linear(32, LABELS)

    def forward(self, input_ids, attention_mask, token_type_ids=None, labels=None):
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * m).sum(1) / m.sum(1)  # the bug: no clamp, 0/0 for a row of padding
        return {"logits": self.head(pooled)}


def make_pooled():
    torch.manual_seed(0)
    return MeanPooledClassifier()


class WeightedCE(nn.Module):
    """Class-weighted cross-entropy for an imbalanced label set (labels -100 ignored)."""

    def __init__(self, weight=(1.0, 2.0, 4.0)):
        super().__init__()
        self.register_buffer("weight", torch.tensor(weight))

    def forward(self, logits, labels):
        return F.cross_entropy(logits.float(), labels, weight=self.weight)


class DistillKL(nn.Module):
    """Distillation: KL(teacher || student) at temperature ``t``, written out by hand."""

    def __init__(self, t: float = 2.0):
        super().__init__()
        self.t = t

    def forward(self, student, teacher):
        p = F.softmax(teacher / self.t, dim=-1)
        log_q = F.log_softmax(student / self.t, dim=-1)
        return (p * (p.log() - log_q)).sum(-1).mean() * self.t ** 2


def trainer_classes():
    """The ``Trainer`` subclasses (built lazily: importing transformers takes a second)."""
    import transformers

    class InOrder:
        """Batches in dataset order, so a planted batch is a known step."""

        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    class WeightedTrainer(InOrder, transformers.Trainer):
        """``compute_loss`` overridden with a class-weighted loss module."""

        def __init__(self, *a, loss_fn=None, **kw):
            super().__init__(*a, **kw)
            self.loss_fn = loss_fn

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            logits = outputs["logits"]
            loss = self.loss_fn(logits, labels)
            return (loss, outputs) if return_outputs else loss

    class DistillTrainer(InOrder, transformers.Trainer):
        """A student distilled from a frozen teacher, plus the labels' cross-entropy."""

        def __init__(self, *a, teacher=None, loss_fn=None, alpha=0.5, **kw):
            super().__init__(*a, **kw)
            self.teacher, self.loss_fn, self.alpha = teacher.eval(), loss_fn, alpha

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = model(**inputs)
            with torch.no_grad():
                t = self.teacher(**inputs).logits
            loss = self.alpha * out.loss + (1 - self.alpha) * self.loss_fn(out.logits, t)
            return (loss, out) if return_outputs else loss

    class PlainTrainer(InOrder, transformers.Trainer):
        pass

    class Seq2Seq(InOrder, transformers.Seq2SeqTrainer):
        pass

    return dict(weighted=WeightedTrainer, distill=DistillTrainer, plain=PlainTrainer,
                seq2seq=Seq2Seq)


def sentences(n: int, seed: int = 0, empty=(), rare=(), rare_id=VOCAB - 1):
    """Tokenized sentences of 3..12 ids ``[CLS] ... [SEP]`` with a label each, as a tokenizer's
    output (lists, unpadded). Rows in ``empty`` are an empty text's encoding (no tokens at
    all: the collator pads them whole); rows in ``rare`` hold the token ``rare_id``."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        k = int(torch.randint(1, 11, (1,), generator=g))
        ids = torch.randint(4, VOCAB - 1, (k,), generator=g).tolist()
        if i in rare:
            ids[k // 2] = rare_id
        ids = [] if i in empty else [CLS, *ids, SEP]
        rows.append({"input_ids": ids, "attention_mask": [1] * len(ids),
                     "labels": int(torch.randint(0, LABELS, (1,), generator=g))})
    return rows


def unlabelled(rows, which):
    """The rows in ``which`` with label -100 (an annotator's "skip")."""
    return [{**r, "labels": -100} if i in which else r for i, r in enumerate(rows)]


class PadTo:
    """The pad-to-longest ``tokenizer.pad`` ``DataCollatorWithPadding`` calls, without a
    tokenizer download: pads ``input_ids`` with ``PAD``, ``attention_mask`` with 0."""

    padding_side, model_input_names, pad_token_id = "right", ["input_ids", "attention_mask"], PAD
    mask_token, pad_token = "[MASK]", "[PAD]"

    def convert_tokens_to_ids(self, token):
        return MASK if token == "[MASK]" else PAD

    def get_special_tokens_mask(self, ids, already_has_special_tokens=True):
        return [int(t in (PAD, CLS, SEP)) for t in ids]

    def pad(self, features, padding=True, max_length=None, pad_to_multiple_of=None,
            return_tensors="pt", **kw):
        width = max(max(len(f["input_ids"]) for f in features), 1)
        out: dict = {"input_ids": [], "attention_mask": []}
        for f in features:
            gap = width - len(f["input_ids"])
            out["input_ids"].append(list(f["input_ids"]) + [PAD] * gap)
            mask = f.get("attention_mask", [1] * len(f["input_ids"]))
            out["attention_mask"].append(list(mask) + [0] * gap)
        for k in features[0]:
            if k not in out:
                out[k] = [f[k] for f in features]
        return {k: torch.tensor(v) for k, v in out.items()}

    def __len__(self):
        return VOCAB


def with_padding():
    from transformers import DataCollatorWithPadding

    return DataCollatorWithPadding(PadTo())


def lm_rows(n: int, seed: int = 0):
    """Token rows for causal LM training (``labels`` made by the collator)."""
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": [CLS, *torch.randint(4, VOCAB, (int(torch.randint(4, 14, (1,),
                                                                             generator=g)),),
                                               generator=g).tolist(), SEP]} for _ in range(n)]


def lm_collator(mlm: bool = False):
    """``DataCollatorForLanguageModeling``: pads; labels = ids with -100 on pads (causal), or
    15 % of the tokens masked and every other label -100 (``mlm``)."""
    from transformers import DataCollatorForLanguageModeling

    return DataCollatorForLanguageModeling(PadTo(), mlm=mlm)


def make_bert_mlm():
    from transformers import BertForMaskedLM

    torch.manual_seed(0)
    return BertForMaskedLM(bert_config())


def short_texts(n: int, seed: int = 0, short=()):
    """Unlabelled sentences for masked-LM pretraining; rows in ``short`` hold one word."""
    rows = sentences(n, seed)
    return [{"input_ids": [CLS, r["input_ids"][1], SEP] if i in short else r["input_ids"]}
            for i, r in enumerate(rows)]


def s2s_rows(n: int, seed: int = 0):
    """Source and target ids for a copy-reverse task, unpadded."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        src = torch.randint(4, VOCAB, (int(torch.randint(3, 10, (1,), generator=g)),),
                            generator=g).tolist()
        rows.append({"input_ids": src + [SEP], "attention_mask": [1] * (len(src) + 1),
                     "labels": src[::-1] + [SEP]})
    return rows


def s2s_collator(batch):
    """``DataCollatorForSeq2Seq(model=...)``'s padding: labels padded with -100, and
    ``decoder_input_ids`` = labels shifted right (which label smoothing needs: the Trainer pops
    ``labels`` before the forward)."""
    width = max(len(r["input_ids"]) for r in batch)
    lw = max(len(r["labels"]) for r in batch)
    labels = torch.tensor([r["labels"] + [-100] * (lw - len(r["labels"])) for r in batch])
    dec = torch.cat([torch.full_like(labels[:, :1], PAD), labels[:, :-1]], 1)
    return {"input_ids": torch.tensor([r["input_ids"] + [PAD] * (width - len(r["input_ids"]))
                                       for r in batch]),
            "attention_mask": torch.tensor([r["attention_mask"]
                                            + [0] * (width - len(r["input_ids"]))
                                            for r in batch]),
            "decoder_input_ids": dec.masked_fill(dec == -100, PAD), "labels": labels}


class SentenceEncoder(nn.Module):
    """A SimCSE sentence encoder: ``AutoModel``, masked mean pooling (count clamped), the
    embedding L2-normalised."""

    def __init__(self, dropout: float = 0.1):
        super().__init__()
        from transformers import AutoModel

        self.encoder = AutoModel.from_config(
            bert_config(hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout),
            add_pooling_layer=False)

    def forward(self, input_ids, attention_mask, token_type_ids=None, labels=None):
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        z = (h * m).sum(1) / m.sum(1).clamp_min(1)
        return {"embeddings": F.normalize(z, dim=-1)}


def make_encoder():
    torch.manual_seed(0)
    return SentenceEncoder()


def make_encoder_no_dropout():
    """The encoder for triplet fine-tuning, dropout off (deterministic embeddings)."""
    torch.manual_seed(0)
    return SentenceEncoder(dropout=0.0)


class InfoNCE(nn.Module):
    """SimCSE's loss written out: two dropout views of each sentence, the other sentences of
    the batch as negatives, cosine similarities over a temperature ``tau``."""

    def __init__(self, tau: float = 0.05):
        super().__init__()
        self.tau = tau

    def forward(self, z1, z2):
        sim = torch.exp(z1 @ z2.T / self.tau)  # the bug: exp of logits, no log-sum-exp
        return -torch.log(sim.diagonal() / sim.sum(-1)).mean()


def contrastive_trainer():
    import transformers

    class ContrastiveTrainer(trainer_classes()["plain"]):
        """Unsupervised SimCSE: the batch encoded twice (dropout makes the two views)."""

        def __init__(self, *a, loss_fn=None, **kw):
            super().__init__(*a, **kw)
            self.loss_fn = loss_fn

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            inputs.pop("labels", None)
            z1 = model(**inputs)["embeddings"]
            z2 = model(**inputs)["embeddings"]
            loss = self.loss_fn(z1, z2)
            return (loss, {"embeddings": z1}) if return_outputs else loss

    assert issubclass(ContrastiveTrainer, transformers.Trainer)
    return ContrastiveTrainer


class TripletLoss(nn.Module):
    """Triplet margin loss on the Euclidean distance written out (anchor, positive,
    negative embeddings as the batch's thirds)."""

    def __init__(self, margin: float = 0.5):
        super().__init__()
        self.margin = margin

    def forward(self, z):
        a, p, n = z.chunk(3)
        d_ap = (a - p).pow(2).sum(-1).sqrt()  # the bug: sqrt at 0 when a row equals its pair
        d_an = (a - n).pow(2).sum(-1).sqrt()
        return F.relu(d_ap - d_an + self.margin).mean()


def triplet_trainer():
    class TripletTrainer(trainer_classes()["plain"]):
        """Sentence triplets (anchor, positive, negative) encoded as one batch of 3B rows."""

        def __init__(self, *a, loss_fn=None, **kw):
            super().__init__(*a, **kw)
            self.loss_fn = loss_fn

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            inputs.pop("labels", None)
            out = model(**inputs)
            loss = self.loss_fn(out["embeddings"])
            return (loss, out) if return_outputs else loss

    return TripletTrainer


def triplets(n: int, seed: int = 0, copied=()):
    """``n`` triplet batches' worth of sentences laid out as the collator sees them: each
    dataset item is a triplet, flattened by ``triplet_collator``. Items in ``copied`` have a
    positive that is the anchor's exact text (a deduplication miss)."""
    rows = sentences(3 * n, seed)
    items = []
    for i in range(n):
        a, p, q = rows[3 * i:3 * i + 3]
        items.append({"anchor": a, "positive": dict(a) if i in copied else p, "negative": q})
    return items


def triplet_collator(items):
    """Anchors, then positives, then negatives, padded as one batch."""
    flat = [it[k] for k in ("anchor", "positive", "negative") for it in items]
    batch = with_padding()([{"input_ids": r["input_ids"], "attention_mask": r["attention_mask"]}
                            for r in flat])
    return dict(batch)


def sft_rows(n: int, seed: int = 0, long_prompt=(), max_length: int = 24):
    """Instruction tuning rows: prompt ids then answer ids, ``labels`` -100 on the prompt (only
    the answer is learned), cut to ``max_length`` as a tokenizer's ``truncation=True`` does.
    Rows in ``long_prompt`` have a prompt longer than ``max_length``: truncation cuts their
    whole answer, and every label left is -100."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        k = max_length + 4 if i in long_prompt else int(torch.randint(3, 10, (1,), generator=g))
        prompt = [CLS, *torch.randint(4, VOCAB, (k,), generator=g).tolist()]
        answer = [*torch.randint(4, VOCAB, (6,), generator=g).tolist(), SEP]
        ids, labels = (prompt + answer)[:max_length], ([-100] * len(prompt) + answer)[:max_length]
        rows.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels})
    return rows


def sft_collator(rows):
    """``DataCollatorForSeq2Seq``-style padding for a decoder: ids with ``PAD``, labels -100."""
    width = max(len(r["input_ids"]) for r in rows)
    pad = [width - len(r["input_ids"]) for r in rows]
    return {"input_ids": torch.tensor([r["input_ids"] + [PAD] * p for r, p in zip(rows, pad)]),
            "attention_mask": torch.tensor([r["attention_mask"] + [0] * p
                                            for r, p in zip(rows, pad)]),
            "labels": torch.tensor([r["labels"] + [-100] * p for r, p in zip(rows, pad)])}

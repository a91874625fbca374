"""Fine-tuning as people write it by hand: a tiny Llama (built from a config, nothing
downloaded) with an added special token (``resize_token_embeddings``) and a LoRA adapter
(frozen base ``nn.Linear``, trainable ``lora_A``/``lora_B``, ``B`` zero-initialised, scaled by
``alpha / r``) swapped in for its attention's ``q_proj`` and ``v_proj``; the factory its
bundles name (``finetune_models:make_lora_llama``; replayed from this directory)."""

from __future__ import annotations

import math

import torch
from torch import nn

VOCAB, CTX = 61, 12


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, r: int = 4, alpha: float = 16.0):
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / r

    def forward(self, x):
        out = self.base(x)  # (over a float16 base, the adapter computes in its own float32)
        delta = self.lora_B(self.lora_A(x.to(self.lora_A.weight.dtype))) * self.scaling
        return out + delta.to(out.dtype)


def make_lora_llama(added: int = 1, train_embeddings: bool = False,
                    half: bool = False) -> nn.Module:
    """``train_embeddings``: the input embeddings train too (PEFT's ``modules_to_save``, so
    that an added token's row learns); ``half``: the base model in float16 (loaded with
    ``torch_dtype=torch.float16``), the adapters in float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        attn_implementation="eager", pad_token_id=0, bos_token_id=1, eos_token_id=2))
    if added:
        model.resize_token_embeddings(VOCAB + added, mean_resizing=False)
    if half:
        model.half()
    for attn in (layer.self_attn for layer in model.model.layers):
        attn.q_proj, attn.v_proj = LoRALinear(attn.q_proj), LoRALinear(attn.v_proj)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name or (train_embeddings and "embed_tokens" in name))
    return model


def tokens(step: int, batch: int, new_token_at: tuple[int, int] | None = None,
           unlabelled_at: int | None = None) -> dict:
    """One batch of random tokens; ``new_token_at=(step, row)`` puts the added token (id
    ``VOCAB``) in that row of that step's batch; at step ``unlabelled_at`` every label is
    -100 (a batch of prompts only, whose mean loss is 0 / 0)."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(3, VOCAB, (batch, CTX), generator=g)
    if new_token_at is not None and new_token_at[0] == step:
        ids[new_token_at[1], 5] = VOCAB
    labels = ids.clone()
    labels[:, :3] = -100  # the prompt is not trained on
    if step == unlabelled_at:
        labels[:] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


class RareEventClassifier(nn.Module):
    """A LoRA-adapted tiny Llama fine-tuned as a binary classifier of rare positives: the
    head's bias starts at the class prior's logit (log(p / (1 - p)) for p = 0.999, as for
    focal-loss-style training), and the loss is a hand-written binary cross-entropy over
    ``sigmoid``, inside the model. Under bfloat16 autocast the head runs in bfloat16, whose
    8 bits round sigmoid(6.9) to exactly 1: log(1 - p) is -inf, and a positive label's
    ``(1 - y) * log(1 - p)`` is 0 * -inf."""

    def __init__(self):
        super().__init__()
        self.backbone = make_lora_llama(added=0).model
        self.head = nn.Linear(32, 1)
        with torch.no_grad():
            self.head.weight.zero_()
            self.head.bias.fill_(math.log(0.999 / 0.001))

    def forward(self, input_ids, attention_mask, labels):
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        p = torch.sigmoid(self.head(h[:, -1])).squeeze(-1)
        return -(labels * torch.log(p) + (1 - labels) * torch.log(1 - p)).mean()


def make_rare_event_classifier() -> nn.Module:
    torch.manual_seed(0)
    model = RareEventClassifier()
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name or name.startswith("head."))
    return model

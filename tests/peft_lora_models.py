"""Parameter-efficient fine-tuning with the real PEFT library on tiny Hugging Face models built
from configs (no downloads): a 2-layer Llama causal LM and a 2-layer GPT-2 classifier wrapped
by ``get_peft_model(model, LoraConfig(...))``, base weights frozen, adapters trained with AdamW.
The factories (``peft_lora_models:make_llama_lora`` ...) are what the bundles name."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2ForSequenceClassification, LlamaConfig, LlamaForCausalLM

VOCAB, T = 64, 12
RARE = VOCAB - 1  # a token the corrupted checkpoint's embedding row holds NaN for


def llama_config(**kw):
    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=64, pad_token_id=0, attn_implementation="eager",
                       **kw)


def make_llama_lora(r: int = 4, alpha: float = 8.0, dtype: str = "float32",
                    corrupt_row: int | None = None, dropout: float = 0.05):
    """A LoRA-adapted Llama (q_proj, v_proj), its base frozen in ``dtype`` (the adapters stay
    float32: PEFT's ``autocast_adapter_dtype``); ``corrupt_row``: the embedding row a
    corrupted checkpoint left NaN."""
    torch.manual_seed(0)
    base = LlamaForCausalLM(llama_config())
    if corrupt_row is not None:
        with torch.no_grad():
            base.model.embed_tokens.weight[corrupt_row] = float("nan")
    base = base.to(getattr(torch, dtype))
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=["q_proj", "v_proj"],
                     lora_dropout=dropout, task_type="CAUSAL_LM")
    return get_peft_model(base, cfg)


def make_gpt2_cls(r: int = 4, alpha: float = 16.0, zero_head: bool = False):
    """A LoRA-adapted GPT-2 classifier: ``c_attn`` adapted, the ``score`` head trained in full
    (``modules_to_save``); ``zero_head``: the new head zero-initialised (every logit 0 at
    first, as LoRA's own B)."""
    torch.manual_seed(0)
    base = GPT2ForSequenceClassification(GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, num_labels=3,
        pad_token_id=0, bos_token_id=1, eos_token_id=2))
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=["c_attn"], lora_dropout=0.0,
                     fan_in_fan_out=True, modules_to_save=["score"], task_type="SEQ_CLS")
    if zero_head:
        torch.nn.init.zeros_(base.score.weight)
    return get_peft_model(base, cfg)


class Instructions(Dataset):
    """Prompt + response rows: labels are -100 on the prompt and on padding (only the
    response is learned); ``long_prompt`` rows' prompts fill the whole window (truncated:
    no response token left)."""

    def __init__(self, n: int, seed: int = 0, long_prompt=(), rare=()):
        g = torch.Generator().manual_seed(seed)
        self.rows = []
        for i in range(n):
            ids = torch.randint(1, VOCAB - 1, (T,), generator=g)
            prompt = T if i in long_prompt else int(torch.randint(3, 7, (1,), generator=g))
            if i in rare:
                ids[1] = RARE
            labels = ids.clone()
            labels[:prompt] = -100
            self.rows.append({"input_ids": ids, "attention_mask": torch.ones(T, dtype=torch.long),
                              "labels": labels})

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def loader(n: int, batch_size: int = 4, **kw) -> DataLoader:
    return DataLoader(Instructions(n, **kw), batch_size=batch_size, shuffle=False)


def causal_lm_loss(logits, labels):
    """Token cross-entropy over the shifted response tokens (prompt and padding at -100)."""
    logits = logits[:, :-1].float()
    labels = labels[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                           ignore_index=-100)


class PerSequenceLoss(torch.nn.Module):
    """Each sequence's mean token loss over its response, then the batch mean (every sample
    weighs the same whatever its response length)."""

    def forward(self, logits, labels):
        logits, labels = logits[:, :-1].float(), labels[:, 1:]
        mask = (labels != -100).float()
        tok = F.cross_entropy(logits.transpose(1, 2), labels.clamp_min(0), reduction="none")
        per_seq = (tok * mask).sum(1) / mask.sum(1)  # the bug: 0/0 when no response token
        return per_seq.mean()


class LmLoss(torch.nn.Module):
    def forward(self, logits, labels):
        return causal_lm_loss(logits, labels)


class LogitPenaltyCE(torch.nn.Module):
    """Cross-entropy plus a penalty on the logits' norm (keeps a new head's logits small)."""

    def __init__(self, lam: float = 0.01):
        super().__init__()
        self.lam = lam

    def forward(self, logits, labels):
        norm = logits.float().pow(2).sum(-1).sqrt()  # the bug: sqrt's gradient at 0 is inf
        return F.cross_entropy(logits.float(), labels) + self.lam * norm.mean()


def classification_rows(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, T), generator=g)
    return [{"input_ids": ids[i], "attention_mask": torch.ones(T, dtype=torch.long),
             "labels": torch.tensor(i % 3)} for i in range(n)]

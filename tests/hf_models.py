"""A tiny GPT-2 and token dataset for the ``transformers.Trainer`` tests (no download)."""

from __future__ import annotations

import torch

VOCAB, CTX = 61, 16


def make_tiny_gpt2():
    """The factory ``nanreplay`` rebuilds the recorded model with."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=CTX,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


class Tokens(torch.utils.data.Dataset):
    """Rows of random token ids (``labels`` = ``input_ids``); the rows in ``padding`` have every
    label ``-100``, as a batch of padding has."""

    def __init__(self, n: int = 64, padding=()):
        self.n, self.padding = n, set(padding)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (CTX,), generator=torch.Generator().manual_seed(i))
        labels = torch.full_like(ids, -100) if i in self.padding else ids.clone()
        return {"input_ids": ids, "labels": labels}

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


class Clicker(torch.nn.Module):
    """A click model computing its own binary cross-entropy from ``sigmoid`` (as a Trainer
    model returning ``{"loss", "logits"}`` may): under bfloat16 ``1 - sigmoid(z)`` rounds to 0
    from z = 6.2 on (float32 holds it up to 16.6), and its log is -inf."""

    def __init__(self):
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 1))

    def forward(self, x, labels=None):
        logit = self.mlp(x).squeeze(-1)
        p = torch.sigmoid(logit)
        out = {"logits": logit}
        if labels is not None:
            out["loss"] = -(labels * torch.log(p) + (1 - labels) * torch.log(1 - p)).mean()
        return out


def make_clicker() -> Clicker:
    torch.manual_seed(0)
    return Clicker()


class Clicks(torch.utils.data.Dataset):
    """Random features with alternating labels; the rows in ``wrong_unit`` are 30x too large."""

    def __init__(self, n: int = 128, wrong_unit=()):
        self.n, self.wrong_unit = n, set(wrong_unit)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = torch.randn(8, generator=torch.Generator().manual_seed(i))
        return {"x": x * 30 if i in self.wrong_unit else x, "labels": torch.tensor(float(i % 2))}


class CheckedClicker(Clicker):
    """The click model with its own guard on the loss it computes, as training code adds one
    after a NaN run: it raises inside the forward, before any hook sees the value."""

    def forward(self, x, labels=None):
        out = super().forward(x, labels)
        if labels is not None and not torch.isfinite(out["loss"]):
            raise ValueError(f"non-finite loss {out['loss'].item()}")
        return out


def make_checked_clicker() -> CheckedClicker:
    torch.manual_seed(0)
    return CheckedClicker()

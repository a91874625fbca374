"""Long runs that save and resume, as training scripts write them: a token classifier (an
embedding, a masked mean over the padding mask passed to ``forward``, a feature normaliser whose
statistics are buffers, a head) trained with a user-defined label-smoothing loss from a
``DataLoader``; checkpoints of the model, optimizer, scheduler and GradScaler state dicts written
with ``torch.save`` and read with ``torch.load(weights_only=True)``; resumes in a fresh process
(``start_step``, the recorder built after the load), ``load_state_dict(assign=True)`` and
``strict=False``; an EMA copy swapped in for evaluation and back; checkpoints damaged the way they
are in practice (a NaN written by a crashed save, a flipped exponent bit, a float16 copy of a
float32 model)."""

from __future__ import annotations

import io

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

VOCAB, DIM, CLASSES, LENGTH = 40, 16, 4, 8


class FeatureNorm(nn.Module):
    """Standardises pooled features with statistics a fresh run computes from the data once
    (``calibrate``) and a checkpoint carries as buffers: ``var`` starts at 0 until then."""

    def __init__(self, dim: int):
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("var", torch.zeros(dim))

    @torch.no_grad()
    def calibrate(self, x: torch.Tensor) -> None:
        self.mean.copy_(x.mean(0))
        self.var.copy_(x.var(0))

    def forward(self, x):
        return (x - self.mean) / self.var.sqrt()


class TokenClassifier(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = DIM, classes: int = CLASSES,
                 calibrated: bool = True):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.proj = nn.Linear(dim, dim)
        self.norm = FeatureNorm(dim)
        self.head = nn.Linear(dim, classes)
        if calibrated:  # (a fresh run's statistics; a resumed one reads them from the checkpoint)
            with torch.no_grad():
                self.norm.var.fill_(1.0)

    def forward(self, ids, mask):
        h = F.gelu(self.proj(self.embed(ids)))
        pooled = (h * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)
        return self.head(self.norm(pooled))


class OldTokenClassifier(nn.Module):
    """The model's earlier version, without ``norm``: its checkpoints lack ``norm.*``."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, classes: int = CLASSES):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, classes)


def make_model() -> TokenClassifier:
    torch.manual_seed(0)
    return TokenClassifier()


class SmoothedCE(nn.Module):
    """Label smoothing written by hand (the pre-``label_smoothing=`` recipe)."""

    def __init__(self, smoothing: float = 0.1):
        super().__init__()
        self.smoothing = smoothing

    def forward(self, logits, target):
        logp = logits.log_softmax(-1)
        nll = -logp.gather(-1, target[:, None]).squeeze(-1)
        return ((1 - self.smoothing) * nll - self.smoothing * logp.mean(-1)).mean()


class Tokens(Dataset):
    """Sequences of token ids padded with 0; the class is the sum of the first two ids mod 4."""

    def __init__(self, n: int = 256, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
        lengths = torch.randint(2, LENGTH + 1, (n,), generator=g)
        self.mask = (torch.arange(LENGTH)[None] < lengths[:, None]).float()
        self.ids = self.ids * self.mask.long()
        self.y = (self.ids[:, 0] + self.ids[:, 1]) % CLASSES

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.ids[i], self.mask[i], self.y[i]


def loader(seed: int = 0, batch_size: int = 16) -> DataLoader:
    return DataLoader(Tokens(seed=seed), batch_size=batch_size, shuffle=False)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


def make_scheduler(opt) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)


def train_step(model, opt, crit, batch, clip: float = 1.0) -> torch.Tensor:
    ids, mask, y = batch
    opt.zero_grad()
    loss = crit(model(ids, mask), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return loss.detach()


def save_checkpoint(step: int, model, opt, sched=None, scaler=None, ema=None) -> bytes:
    """``torch.save`` of the run's state dicts, as bytes (a file's contents)."""
    state = {"step": step, "model": model.state_dict(), "optimizer": opt.state_dict()}
    if sched is not None:
        state["scheduler"] = sched.state_dict()
    if scaler is not None:
        state["scaler"] = scaler.state_dict()
    if ema is not None:
        state["ema"] = ema.state_dict()
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def load_checkpoint(blob: bytes) -> dict:
    return torch.load(io.BytesIO(blob), weights_only=True)


def flip_bit(t: torch.Tensor, index: int, bit: int) -> None:
    """Flip one bit of a float32 element in place (a storage fault in a checkpoint)."""
    flat = t.view(-1).view(torch.int32)
    flat[index] ^= 1 << bit


class EMA:
    """An exponential moving average of the weights (timm's ``ModelEmaV2``, plainer), swapped in
    for evaluation and back."""

    def __init__(self, model: nn.Module, decay: float = 0.9):
        self.decay = decay
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for k, v in model.state_dict().items():
            if v.dtype.is_floating_point:
                self.shadow[k].lerp_(v, 1 - self.decay)
            else:
                self.shadow[k].copy_(v)

    def state_dict(self) -> dict:
        return dict(self.shadow)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batch) -> float:
        """Swap the EMA weights in, evaluate, swap the training weights back."""
        backup = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.load_state_dict(self.shadow)
        model.eval()
        ids, mask, y = batch
        acc = (model(ids, mask).argmax(-1) == y).float().mean().item()
        model.train()
        model.load_state_dict(backup)
        return acc


class FocalLoss(nn.Module):
    """Focal loss (Lin et al.) written by hand, ``-(1 - p_t) ** gamma * log p_t``, with the
    paper's swept ``gamma`` below 1 (0.5)."""

    def __init__(self, gamma: float = 0.5):
        super().__init__()
        self.gamma = gamma

    def forward(self, logits, target):
        logp = logits.log_softmax(-1).gather(-1, target[:, None]).squeeze(-1)
        return (-(1 - logp.exp()) ** self.gamma * logp).mean()


def amp_step(model, opt, crit, scaler, batch) -> None:
    """One float16 autocast step through a GradScaler (unscaled before clipping)."""
    ids, mask, y = batch
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = crit(model(ids, mask), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()

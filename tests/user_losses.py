"""A token tagger and the losses projects write for it: a ``CTCLoss`` subclass taking its targets
as a tuple, a focal loss whose constructor needs arguments, a ``CrossEntropyLoss`` wrapper that
reshapes, a plain per-sequence loss function. Each line marked ``# BUG`` is where a planted bug
makes the first non-finite value (the tests find the line by reading this file)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

B, T, F_IN, HIDDEN, C = 8, 6, 5, 16, 7  # batch, time, features, hidden, classes (0: blank/pad)
PAD = 0


class Tagger(nn.Module):
    """(B, T, F_IN) features -> (B, T, C) logits."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(F_IN, HIDDEN)
        self.act = nn.ReLU()
        self.head = nn.Linear(HIDDEN, C)

    def forward(self, x):
        return self.head(self.act(self.enc(x)))


def make_tagger() -> nn.Module:
    torch.manual_seed(0)
    return Tagger()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Features and labels in 1..C-1 (no padding), the same for every run of a step."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(B, T, F_IN, generator=g), torch.randint(1, C, (B, T), generator=g)


class TupleCTC(nn.CTCLoss):
    """CTC over (B, T, C) logits whose target is one tuple ``(targets, input_lengths,
    target_lengths)``, as a data loader's collate function returns it."""

    def forward(self, logits, target):
        targets, input_lengths, target_lengths = target
        log_probs = logits.log_softmax(-1).transpose(0, 1)  # (T, B, C)
        return super().forward(log_probs, targets, input_lengths, target_lengths)  # BUG ctc


class FocalLoss(nn.Module):
    """Focal loss with per-class weights; ``gamma`` < 1 has an infinite derivative at a
    probability of exactly 1."""

    def __init__(self, gamma: float, alpha: torch.Tensor):
        super().__init__()
        self.gamma = gamma
        self.register_buffer("alpha", alpha)

    def forward(self, logits, labels):
        logpt = F.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)  # (B, T)
        pt = logpt.exp()
        weight = (1 - pt) ** self.gamma  # BUG focal: d/dpt is infinite where pt == 1
        return -(self.alpha[labels] * weight * logpt).mean()


class FlatCE(nn.Module):
    """``CrossEntropyLoss`` over (B, T, C) logits, reshaped to (B*T, C)."""

    def __init__(self, num_classes: int, weight: torch.Tensor | None = None):
        super().__init__()
        self.num_classes = num_classes
        self.ce = nn.CrossEntropyLoss(weight=weight, ignore_index=PAD)

    def forward(self, logits, labels):
        return self.ce(logits.reshape(-1, self.num_classes), labels.reshape(-1))  # BUG flat


def lm_loss(out, labels):
    """Token cross entropy averaged over each sequence's tokens, then over the batch."""
    tok = F.cross_entropy(out.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
    mask = (labels != PAD).float()
    per_sequence = (tok * mask).sum(1) / mask.sum(1)  # BUG lm: 0/0 for an all-padding row
    return per_sequence.mean()


def lm_loss_counted(out, labels):
    """``lm_loss`` dividing by each sequence's token count, an integer tensor."""
    tok = F.cross_entropy(out.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
    mask = labels != PAD
    per_sequence = (tok * mask).sum(1) / mask.sum(1)  # BUG counted: 0/0 for an all-padding row
    return per_sequence.mean()


class ShiftedTokenCE(nn.Module):
    """A causal LM's next-token cross entropy, mean over the labelled tokens (``ignore_index``
    marks the others), as a ``Trainer.compute_loss`` override computes it."""

    def __init__(self, ignore_index: int = -100):
        super().__init__()
        self.ignore_index = ignore_index

    def forward(self, logits, labels):
        logits, target = logits[:, :-1], labels[:, 1:]
        mask = (target != self.ignore_index).float()
        tok = F.cross_entropy(logits.flatten(0, 1), target.clamp(min=0).flatten(),
                              reduction="none").view_as(target)
        return (tok * mask).sum() / mask.sum()  # BUG shifted: 0/0 for a batch of padding


class Rater(nn.Module):
    """(B, F_IN) features and a (B,) presence mask -> (B,) ratings through a final ReLU, as
    rating and count models have; an item marked absent gives the head's bias, which is
    negative, so its rating is exactly 0 (the head's positive weights keep the others above 0)."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(F_IN, HIDDEN)
        self.act = nn.ReLU()
        self.head = nn.Linear(HIDDEN, 1)
        nn.init.constant_(self.head.weight, 0.5)
        nn.init.constant_(self.head.bias, -0.5)
        self.out = nn.ReLU()

    def forward(self, x, present):
        return self.out(self.head(self.act(self.enc(x)) * present[:, None])).squeeze(-1)


def make_rater() -> nn.Module:
    torch.manual_seed(0)
    return Rater()


def log_rating_loss(pred, rating):
    """Squared error in log space: log(0) = -inf for a rating of exactly 0."""
    return (torch.log(pred) - torch.log(rating)).pow(2).mean()  # BUG log0


class TwoViewContrastive(nn.Module):
    """NT-Xent over two views of a batch, each through its own forward of the same model (as
    SimCLR-style loops do: ``loss(model(v1), model(v2))``), with a temperature a schedule sets
    on the loss module."""

    def __init__(self, temperature: float = 0.5):
        super().__init__()
        self.temperature = temperature

    def forward(self, z1, z2):
        z = F.normalize(torch.cat([z1.flatten(1), z2.flatten(1)]), dim=1)
        sim = z @ z.t() / self.temperature  # BUG temperature: x/0 once the schedule reaches 0
        n = z1.shape[0]
        sim = sim.masked_fill(torch.eye(2 * n, dtype=torch.bool, device=z.device), float("-inf"))
        target = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]).to(z.device)
        return F.cross_entropy(sim, target)


class MaskedTagger(Tagger):
    """The tagger given a (B, C) mask of the classes each sequence allows (a dialogue state,
    legal actions): the others' logits are -inf, on purpose."""

    def forward(self, x, allowed):
        return super().forward(x).masked_fill(~allowed[:, None, :], float("-inf"))


def make_masked_tagger() -> nn.Module:
    torch.manual_seed(0)
    return MaskedTagger()


class SmoothedCE(nn.Module):
    """Label smoothing written by hand: the target distribution spreads ``smoothing`` over
    every class, the masked ones too, whose log-probability is -inf."""

    def __init__(self, smoothing: float = 0.1):
        super().__init__()
        self.smoothing = smoothing

    def forward(self, logits, target):
        logp = logits.log_softmax(-1)
        with torch.no_grad():
            dist = torch.full_like(logp, self.smoothing / (C - 1))
            dist.scatter_(-1, target.unsqueeze(-1), 1 - self.smoothing)
        return torch.sum(-dist * logp, dim=-1).mean()  # BUG smooth


def quartic_loss(pred, y):
    """A loss whose gradient 4 (pred - y)^3 overflows float32 for a residual past 7e12."""
    return (pred - y).pow(4).sum()


def make_linear_regressor() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(F_IN, 1), nn.Flatten(0))


class TripletLoss(nn.Module):
    """Triplet margin loss over the anchor, positive and negative chunks of one forward
    (``a, p, n = model(torch.cat([xa, xp, xn])).chunk(3)``), distances written by hand."""

    def __init__(self, margin: float = 1.0):
        super().__init__()
        self.margin = margin

    def forward(self, a, p, n):
        d_ap = torch.sqrt((a - p).flatten(1).pow(2).sum(1))  # BUG triplet: sqrt'(0) for a == p
        d_an = torch.sqrt((a - n).flatten(1).pow(2).sum(1))
        return F.relu(d_ap - d_an + self.margin).mean()

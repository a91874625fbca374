"""Multiple-instance learning for computational pathology, written as CLAM, TransMIL,
Campanella et al. and the PORPOISE/MCAT survival code write it, for
``test_multiple_instance_learning``.

A slide is a bag of precomputed patch embeddings of its own size; a batch pads the bags to the
longest one with a boolean ``mask`` (True: a real patch) given to ``forward``.

- ``GatedABMIL``: Ilse et al.'s gated attention (CLAM's ``Attn_Net_Gated``): ``tanh(V h) *
  sigmoid(U h)``, a score per patch, ``-inf`` at the padding, a softmax over each bag's
  patches, the attention-weighted sum; optionally a per-bag standardisation of the features
  first (mean and std over the bag's own patches; or, one unpadded slide at a time, torch's
  unbiased std), and a classifier or a survival risk head.
- ``TopKMIL``: Campanella et al.'s top-k instance pooling: a score per patch, ``-inf`` at
  the padding, the mean of each bag's ``k`` highest scores as the slide's logit (clamped: of
  at most its own number of patches).
- ``DSMIL``: Li et al.'s dual stream: the max over instance scores (``-inf`` at the padding),
  the critical instance's query against every patch's, a softmax over the bag, a Conv1d.
- ``StandardisedABMIL``: features standardised by the training set's mean and std (buffers).
- ``TransMIL``: a CLS token before the patches, a transformer encoder layer with
  ``src_key_padding_mask`` (the CLS token is never padding), the CLS output to the classifier;
  or, without the CLS token, the masked mean of the patch tokens.
- ``cox_loss``: the Cox partial likelihood over a batch of slides (risk sets by sorting on
  time, ``logcumsumexp``), divided by the number of events.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FEAT = 24  # patch embedding size (a ResNet50 trunc/UNI would be 1024)


class AttnNetGated(nn.Module):
    """CLAM's ``Attn_Net_Gated``: one attention score per patch."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.attention_a = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh())
        self.attention_b = nn.Sequential(nn.Linear(dim, hidden), nn.Sigmoid())
        self.attention_c = nn.Linear(hidden, 1)

    def forward(self, h):
        return self.attention_c(self.attention_a(h) * self.attention_b(h)).squeeze(-1)


def standardise(feats, mask, eps: float = 0.0):
    """Per-bag feature standardisation over the bag's real patches (stain/scanner shift)."""
    m = mask.unsqueeze(-1).to(feats.dtype)
    n = m.sum(1, keepdim=True)
    mean = (feats * m).sum(1, keepdim=True) / n
    var = ((feats - mean) ** 2 * m).sum(1, keepdim=True) / n
    return (feats - mean) / (var.sqrt() + eps)  # eps = 0: a feature constant over a bag is 0/0


def standardise_slide(feats, eps: float = 1e-6):
    """The same for one unpadded slide ``(1, N, D)``, by torch's (unbiased) std."""
    return (feats - feats.mean(1, keepdim=True)) / (feats.std(1, keepdim=True) + eps)


class GatedABMIL(nn.Module):
    def __init__(self, n_out: int = 2, dim: int = FEAT, hidden: int = 16,
                 norm: bool | str = False, eps: float = 0.0):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Dropout(0.25))
        self.attention_net = AttnNetGated(hidden, hidden)
        self.classifier = nn.Linear(hidden, n_out)
        self.norm, self.eps = norm, eps
        self.return_attn = False

    def forward(self, feats, mask):
        if self.norm == "slide":  # (batch size 1, no padding)
            feats = standardise_slide(feats)
        elif self.norm:
            feats = standardise(feats, mask, self.eps)
        h = self.fc(feats)
        scores = self.attention_net(h).masked_fill(~mask, float("-inf"))
        attn = torch.softmax(scores, dim=1)  # a bag with no patch: a softmax over only -inf
        slide = torch.einsum("bn,bnh->bh", attn, h)
        if self.return_attn:
            return self.classifier(slide), attn
        return self.classifier(slide)


class TopKMIL(nn.Module):
    """Campanella et al.: the slide's logit is the mean of its k most tumour-like patches."""

    def __init__(self, k: int = 4, dim: int = FEAT, hidden: int = 16, clamp: bool = False):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU())
        self.scorer = nn.Linear(hidden, 1)
        self.k, self.clamp = k, clamp

    def forward(self, feats, mask):
        scores = self.scorer(self.encoder(feats)).squeeze(-1).masked_fill(~mask, float("-inf"))
        top = scores.topk(self.k, dim=1).values  # a bag of fewer than k patches picks padding
        if not self.clamp:
            return top.mean(1)
        n = mask.sum(1).clamp(max=self.k)  # a small bag: the mean of all its patches
        return top.masked_fill(top.isinf(), 0.0).sum(1) / n


class TransMIL(nn.Module):
    """A CLS token and self-attention over the patches, the padding masked as keys."""

    def __init__(self, dim: int = FEAT, hidden: int = 16, n_out: int = 2, cls: bool = True):
        super().__init__()
        self.cls = cls  # without: the mean of the patch tokens (a bag of none: all keys masked)
        self.fc = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU())
        self.cls_token = nn.Parameter(torch.randn(1, 1, hidden) * 0.02)
        self.layer = nn.TransformerEncoderLayer(hidden, 2, 32, dropout=0.0, batch_first=True)
        self.norm = nn.LayerNorm(hidden)
        self.classifier = nn.Linear(hidden, n_out)

    def forward(self, feats, mask):
        h = self.fc(feats)
        if not self.cls:
            h = self.layer(h, src_key_padding_mask=~mask)
            m = mask[..., None].to(h.dtype)
            return self.classifier(self.norm((h * m).sum(1) / m.sum(1).clamp_min(1)))
        h = torch.cat([self.cls_token.expand(h.shape[0], -1, -1), h], dim=1)
        pad = torch.cat([mask.new_zeros(mask.shape[0], 1), ~mask], dim=1)
        h = self.layer(h, src_key_padding_mask=pad)
        return self.classifier(self.norm(h[:, 0]))


class DSMIL(nn.Module):
    """Li et al.'s dual-stream MIL: an instance classifier whose highest-scoring patch per
    class is the critical instance, every patch's attention by its query's similarity to the
    critical one's, and a Conv1d over the classes' attention-pooled bag embeddings."""

    def __init__(self, dim: int = FEAT, n_cls: int = 2, q_dim: int = 16):
        super().__init__()
        self.i_classifier = nn.Linear(dim, n_cls)
        self.q = nn.Sequential(nn.Linear(dim, q_dim), nn.ReLU(), nn.Linear(q_dim, q_dim),
                               nn.Tanh())
        self.v = nn.Sequential(nn.Dropout(0.0), nn.Linear(dim, dim))
        self.fcc = nn.Conv1d(n_cls, n_cls, kernel_size=dim)

    def forward(self, feats, mask):
        ins = self.i_classifier(feats).masked_fill(~mask[..., None], float("-inf"))
        max_pred, m_indices = ins.max(1)  # (B, C): the critical instance of each class
        Q, V = self.q(feats), self.v(feats)
        q_max = Q.gather(1, m_indices[..., None].expand(-1, -1, Q.shape[-1]))  # (B, C, q)
        A = Q @ q_max.transpose(1, 2)  # (B, N, C)
        A = A.masked_fill(~mask[..., None], float("-inf"))
        A = torch.softmax(A / Q.shape[-1] ** 0.5, dim=1)
        bag = A.transpose(1, 2) @ V  # (B, C, D)
        return max_pred, self.fcc(bag).squeeze(-1)


def dsmil_loss(max_pred, bag_pred, labels):
    """DSMIL's loss: the max-instance stream and the bag stream, one-hot BCE each."""
    y = F.one_hot(labels, max_pred.shape[-1]).float()
    return 0.5 * F.binary_cross_entropy_with_logits(max_pred, y) \
        + 0.5 * F.binary_cross_entropy_with_logits(bag_pred, y)


def make_dsmil() -> DSMIL:
    torch.manual_seed(0)
    return DSMIL()


def make_abmil() -> GatedABMIL:
    torch.manual_seed(0)
    return GatedABMIL()


def make_abmil_norm() -> GatedABMIL:
    torch.manual_seed(0)
    return GatedABMIL(norm=True)


def make_abmil_norm_eps() -> GatedABMIL:
    torch.manual_seed(0)
    return GatedABMIL(norm=True, eps=1e-6)


class StandardisedABMIL(GatedABMIL):
    """Patch features standardised by the training set's per-feature mean and std, computed
    once from the precomputed embeddings file and kept as buffers (saved with the model)."""

    def __init__(self, mean, std):
        super().__init__()
        self.register_buffer("feat_mean", mean)
        self.register_buffer("feat_std", std)

    def forward(self, feats, mask):
        feats = (feats - self.feat_mean) / self.feat_std  # a feature 0 on every patch: 0/0
        return super().forward(feats.masked_fill(~mask[..., None], 0.0), mask)


def make_standardised() -> StandardisedABMIL:
    """Statistics of a training set whose feature 11 is 0 on every patch (a ReLU unit of the
    extractor that never fires on tissue)."""
    g = torch.Generator().manual_seed(7)
    train = torch.randn(500, FEAT, generator=g).relu()
    train[:, 11] = 0.0
    torch.manual_seed(0)
    return StandardisedABMIL(train.mean(0), train.std(0))


def make_abmil_entropy() -> GatedABMIL:
    torch.manual_seed(0)
    model = GatedABMIL()
    model.return_attn = True
    return model


def attention_entropy_loss(logits, attn, labels, beta: float = 0.01):
    """Cross-entropy plus a penalty on the attention's entropy (sharper attention maps)."""
    entropy = -(attn * torch.log(attn)).sum(1)  # the padding's attention is exactly 0
    return F.cross_entropy(logits, labels) + beta * entropy.mean()


def make_abmil_slide_norm() -> GatedABMIL:
    torch.manual_seed(0)
    return GatedABMIL(norm="slide")


def make_survival() -> GatedABMIL:
    torch.manual_seed(0)
    return GatedABMIL(n_out=1)


def make_topk() -> TopKMIL:
    torch.manual_seed(0)
    return TopKMIL()


def make_topk_clamped() -> TopKMIL:
    torch.manual_seed(0)
    return TopKMIL(clamp=True)


def make_transmil() -> TransMIL:
    torch.manual_seed(0)
    return TransMIL()


def make_transmil_mean() -> TransMIL:
    torch.manual_seed(0)
    return TransMIL(cls=False)


def cox_loss(risk, time, event):
    """Negative Cox partial log-likelihood (DeepSurv/PORPOISE), averaged over the events."""
    risk = risk.squeeze(-1)
    order = torch.argsort(time, descending=True)
    risk, event = risk[order], event[order]
    log_risk_set = torch.logcumsumexp(risk, dim=0)  # those still at risk at each time
    return -((risk - log_risk_set) * event).sum() / event.sum()  # no event: 0/0


def discrete_nll(logits, y_bin, censored, alpha: float = 0.4):
    """PORPOISE/MCAT's discrete-time survival NLL over ``n_bins`` hazards per slide, without
    its ``clamp(min=eps)`` on the probabilities it takes the log of."""
    hazards = torch.sigmoid(logits)
    S = torch.cumprod(1 - hazards, dim=1)  # survival past each bin
    S_padded = torch.cat([torch.ones_like(S[:, :1]), S], 1)
    y, c = y_bin[:, None], censored[:, None]
    uncensored = -(1 - c) * (torch.log(S_padded.gather(1, y)) + torch.log(hazards.gather(1, y)))
    censored_loss = -c * torch.log(S_padded.gather(1, y + 1))
    neg_l = censored_loss + uncensored
    return ((1 - alpha) * neg_l + alpha * uncensored).mean()


def make_discrete() -> GatedABMIL:
    torch.manual_seed(0)
    return GatedABMIL(n_out=4)


def slides(g: torch.Generator, n: int = 8, sizes=None, max_len: int = 12):
    """``n`` slides' patch features, padded to the longest, with the mask and a label each;
    a positive slide's patches drift towards a tumour direction."""
    if sizes is None:
        sizes = torch.randint(5, max_len + 1, (n,), generator=g).tolist()
    labels = torch.randint(0, 2, (n,), generator=g)
    longest = max(max(sizes), 1)
    feats = torch.zeros(n, longest, FEAT)
    mask = torch.zeros(n, longest, dtype=torch.bool)
    tumour = torch.linspace(-1, 1, FEAT)
    for i, size in enumerate(sizes):
        feats[i, :size] = torch.randn(size, FEAT, generator=g) + 0.5 * labels[i] * tumour
        mask[i, :size] = True
    return feats, mask, labels


def survival_targets(g: torch.Generator, n: int = 8, censored_all: bool = False):
    """Follow-up times (months) and event indicators (1: death observed, 0: censored)."""
    time = torch.rand(n, generator=g) * 60 + 1
    event = (torch.rand(n, generator=g) < 0.6).float()
    if censored_all:
        event.zero_()
    else:
        event[0] = 1.0
    return time, event


class SlideBags(torch.utils.data.Dataset):
    """Slides as (patch features (N, FEAT), label), N of each its own, as read from an .h5
    file per slide; ``corrupt``: (slide, patch) whose stored embedding is NaN."""

    def __init__(self, n: int = 32, corrupt: tuple[int, int] | None = None):
        g = torch.Generator().manual_seed(3)
        feats, mask, labels = slides(g, n=n)
        self.items = [(feats[i, :int(mask[i].sum())].clone(), labels[i]) for i in range(n)]
        if corrupt is not None:
            self.items[corrupt[0]][0][corrupt[1]] = float("nan")

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def collate_bags(items):
    """Pads the bags to the longest with zeros and a mask (True: a real patch)."""
    longest = max(len(f) for f, _ in items)
    feats = torch.zeros(len(items), longest, FEAT)
    mask = torch.zeros(len(items), longest, dtype=torch.bool)
    for i, (f, _) in enumerate(items):
        feats[i, :len(f)], mask[i, :len(f)] = f, True
    return {"feats": feats, "mask": mask, "label": torch.stack([y for _, y in items])}

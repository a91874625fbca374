"""Pointer networks written the way their repositories write them.

- ``PtrNet``: Vinyals et al. (2015) for sorting and convex hulls, as the common PyTorch ports
  write it: points embedded by a linear layer, an LSTM encoder, an LSTM decoder fed the point
  it pointed at last (teacher forcing: the label's previous index, a learned start input),
  additive attention ``v . tanh(W1 e + W2 d)`` as the pointer, the positions already chosen
  and the padding filled with the dtype's lowest number before ``log_softmax``, trained with ``nll_loss`` with
  ``ignore_index=-100`` past each instance's length. Options for the planted bugs: the inputs
  standardised per instance, a distance-to-the-first-point feature taken with ``sqrt``, the
  sequence's likelihood taken as a product of step probabilities.
- ``PointerGenerator``: See et al. (2017) on an LSTM encoder-decoder with the source padding
  mask passed into ``forward``: Bahdanau attention with a coverage feature, the gate ``p_gen``,
  ``final = p_gen * P_vocab`` extended by the batch's OOV slots, plus ``(1 - p_gen) * attn``
  scattered over the source's extended ids; the loss ``-log(final[target])`` by ``gather``
  plus ``cov_wt * sum(min(attn, coverage))``, a module (``PointerGenLoss``).

The data are synthetic: sorting instances of uniform numbers, convex hulls of random 2-D points
(labels from a monotone chain), and a copy task of word ids, some OOV.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

HID = 16
PAD, UNK, BOS = 0, 1, 2
VOCAB, WORDS = 30, 40        # word ids >= VOCAB are OOV: UNK in src, copied through src_ext
IGNORE = -100


# ---------------------------------------------------------------------------------------------
# data


def sort_data(n: int, length: int = 6, seed: int = 0, nan_at=(), constant_at=(),
              scale: float = 1.0, shorter: int = 0) -> list:
    """(values (length, 1), argsort) pairs of numbers in [0, scale), every third instance
    ``shorter`` values shorter; ``nan_at`` instances lost a value (a blank cell of the source
    file read as NaN), ``constant_at`` instances repeat one value."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x = torch.rand(length - (shorter if i % 3 == 1 else 0), 1, generator=g) * scale
        if i in constant_at:
            x = torch.full_like(x, 0.5)
        if i in nan_at:
            x[2, 0] = float("nan")
        out.append((x, torch.argsort(x[:, 0], stable=True)))
    return out


def _hull(pts: torch.Tensor) -> list[int]:
    """Andrew's monotone chain, counter-clockwise from the lowest-x point."""
    order = sorted(range(len(pts)), key=lambda i: (pts[i, 0].item(), pts[i, 1].item()))

    def cross(o, a, b):
        return ((pts[a] - pts[o])[0] * (pts[b] - pts[o])[1]
                - (pts[a] - pts[o])[1] * (pts[b] - pts[o])[0]).item()
    lower, upper = [], []
    for i in order:
        while len(lower) >= 2 and cross(lower[-2], lower[-1], i) <= 0:
            lower.pop()
        lower.append(i)
    for i in reversed(order):
        while len(upper) >= 2 and cross(upper[-2], upper[-1], i) <= 0:
            upper.pop()
        upper.append(i)
    return lower[:-1] + upper[:-1]


def hull_data(n: int, seed: int = 0, sizes=(5, 8)) -> list:
    """(points (N, 2), hull indices) pairs of N drawn from ``sizes``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        m = int(torch.randint(sizes[0], sizes[1] + 1, (1,), generator=g))
        pts = torch.rand(m, 2, generator=g)
        out.append((pts, torch.tensor(_hull(pts))))
    return out


def collate_points(examples):
    """Pads points with 0 and labels with IGNORE: (points, lens, target)."""
    n = max(len(p) for p, _ in examples)
    t = max(len(y) for _, y in examples)
    pts = torch.zeros(len(examples), n, examples[0][0].size(1))
    tgt = torch.full((len(examples), t), IGNORE, dtype=torch.long)
    for i, (p, y) in enumerate(examples):
        pts[i, :len(p)] = p
        tgt[i, :len(y)] = y
    return pts, torch.tensor([len(p) for p, _ in examples]), tgt


def copy_corpus(n: int, seed: int = 0, length: int = 7) -> list:
    """(article, summary) word lists; the summary copies every other word of the article."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        m = int(torch.randint(length - 2, length + 1, (1,), generator=g))
        art = torch.randint(3, WORDS, (m,), generator=g).tolist()
        out.append((art, art[::2]))
    return out


def collate_copy(examples):
    """(src, src_ext, src_mask, tgt_in, tgt_out, n_oov): OOV words become UNK in ``src`` and
    the batch's OOV slots ``VOCAB + k`` in ``src_ext`` and the targets."""
    oovs = sorted({w for a, _ in examples for w in a if w >= VOCAB})
    ext = {w: VOCAB + k for k, w in enumerate(oovs)}
    s = max(len(a) for a, _ in examples)
    t = max(len(y) for _, y in examples) + 1
    src = torch.full((len(examples), s), PAD)
    src_ext = torch.full((len(examples), s), PAD)
    tgt_in = torch.full((len(examples), t), PAD)
    tgt_out = torch.full((len(examples), t), PAD)
    for i, (a, y) in enumerate(examples):
        src[i, :len(a)] = torch.tensor([w if w < VOCAB else UNK for w in a])
        src_ext[i, :len(a)] = torch.tensor([ext.get(w, w) for w in a])
        ids = [w if w < VOCAB else UNK for w in y]
        tgt_in[i, :len(y) + 1] = torch.tensor([BOS] + ids)
        tgt_out[i, :len(y)] = torch.tensor([ext.get(w, w) for w in y])
    return src, src_ext, src != PAD, tgt_in, tgt_out, len(oovs)


# ---------------------------------------------------------------------------------------------
# Ptr-Net


class PointerAttention(nn.Module):
    def __init__(self, fill: float | None = None):
        super().__init__()
        self.fill = fill          # None: the dtype's lowest number
        self.W1 = nn.Linear(HID, HID, bias=False)
        self.W2 = nn.Linear(HID, HID, bias=False)
        self.v = nn.Linear(HID, 1, bias=False)

    def forward(self, enc, dec, mask):
        u = self.v(torch.tanh(self.W1(enc) + self.W2(dec).unsqueeze(1))).squeeze(-1)
        fill = torch.finfo(u.dtype).min if self.fill is None else self.fill
        return F.log_softmax(u.masked_fill(mask, fill), dim=-1)


class PtrNet(nn.Module):
    def __init__(self, in_dim: int = 1, standardize: bool = False, anchor: bool = False,
                 fill: float | None = None):
        super().__init__()
        self.standardize, self.anchor = standardize, anchor
        self.embed = nn.Linear(in_dim + anchor, HID)
        self.encoder = nn.LSTM(HID, HID, batch_first=True)
        self.decoder = nn.LSTMCell(HID, HID)
        self.start = nn.Parameter(torch.zeros(HID))
        self.pointer = PointerAttention(fill)

    def features(self, pts, lens):
        if self.standardize:    # per-instance standardisation of the values to sort
            pts = (pts - pts.mean(1, keepdim=True)) / pts.std(1, keepdim=True)
        emb = self.embed(pts) if not self.anchor else None
        if self.anchor:         # each point's distance to the first one, in the embedding
            z = self.embed(torch.cat([pts, torch.zeros_like(pts[..., :1])], -1))
            dist = ((z - z[:, :1]) ** 2).sum(-1, keepdim=True).sqrt()
            emb = self.embed(torch.cat([pts, dist], -1))
        return emb

    def forward(self, pts, lens, target):
        emb = self.features(pts, lens)
        enc, (h, c) = self.encoder(emb)
        b, n = pts.shape[:2]
        pad = torch.arange(n).unsqueeze(0) >= lens.unsqueeze(1)
        chosen = torch.zeros(b, n, dtype=torch.bool)
        x, state, out = self.start.expand(b, HID), (h[0], c[0]), []
        rows = torch.arange(b)
        for t in range(target.size(1)):
            state = self.decoder(x, state)
            out.append(self.pointer(enc, state[0], chosen | pad))
            idx = target[:, t].clamp_min(0)          # teacher forcing (IGNORE past the end)
            chosen = chosen.clone()
            chosen[rows, idx] = True
            x = emb[rows, idx]
        return torch.stack(out, 1)


def ptr_loss(log_p, target):
    return F.nll_loss(log_p.flatten(0, 1), target.flatten(), ignore_index=IGNORE)


def sequence_nll(log_p, target):
    """The label sequence's negative log-likelihood as ``-log(prod p_t)``."""
    p = log_p.exp().gather(2, target.clamp_min(0).unsqueeze(2)).squeeze(2)
    p = torch.where(target == IGNORE, torch.ones_like(p), p)
    return -torch.log(p.prod(1)).mean()


# ---------------------------------------------------------------------------------------------
# pointer-generator


class CoverageAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.W_h = nn.Linear(2 * HID, 2 * HID, bias=False)
        self.W_s = nn.Linear(2 * HID, 2 * HID)
        self.w_c = nn.Linear(1, 2 * HID, bias=False)
        self.v = nn.Linear(2 * HID, 1, bias=False)

    def forward(self, enc, s, src_mask, coverage):
        e = self.v(torch.tanh(self.W_h(enc) + self.W_s(s).unsqueeze(1)
                              + self.w_c(coverage.unsqueeze(2)))).squeeze(2)
        attn = F.softmax(e.masked_fill(~src_mask, -1e9), dim=1)
        return torch.bmm(attn.unsqueeze(1), enc).squeeze(1), attn


class PointerGenerator(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, HID, padding_idx=PAD)
        self.encoder = nn.LSTM(HID, HID, batch_first=True, bidirectional=True)
        self.decoder = nn.LSTMCell(HID + 2 * HID, 2 * HID)
        self.attention = CoverageAttention()
        self.p_gen = nn.Linear(2 * HID + 2 * HID + HID, 1)
        self.out = nn.Linear(4 * HID, VOCAB)

    def forward(self, src, src_ext, src_mask, tgt_in, n_oov: int):
        enc, _ = self.encoder(self.embedding(src))
        b = src.size(0)
        state = (enc.new_zeros(b, 2 * HID), enc.new_zeros(b, 2 * HID))
        ctx, coverage = enc.new_zeros(b, 2 * HID), enc.new_zeros(src.shape)
        finals, attns, covs = [], [], []
        for t in range(tgt_in.size(1)):
            y = self.embedding(tgt_in[:, t])
            state = self.decoder(torch.cat([y, ctx], 1), state)
            ctx, attn = self.attention(enc, state[0], src_mask, coverage)
            p_gen = torch.sigmoid(self.p_gen(torch.cat([ctx, state[0], y], 1)))
            vocab = F.softmax(self.out(torch.cat([state[0], ctx], 1)), dim=1)
            final = torch.cat([p_gen * vocab, vocab.new_zeros(b, n_oov)], 1)
            final = final.scatter_add(1, src_ext, (1 - p_gen) * attn)
            finals.append(final)
            attns.append(attn)
            covs.append(coverage)
            coverage = coverage + attn
        return torch.stack(finals, 1), torch.stack(attns, 1), torch.stack(covs, 1)


class PointerGenLoss(nn.Module):
    def __init__(self, cov_wt: float = 1.0, eps: float = 1e-12):
        super().__init__()
        self.cov_wt, self.eps = cov_wt, eps

    def forward(self, out, tgt_out):
        finals, attns, covs = out
        gold = finals.gather(2, tgt_out.unsqueeze(2)).squeeze(2)
        nll = -torch.log(gold + self.eps)
        cov = torch.min(attns, covs).sum(2)
        mask = (tgt_out != PAD).float()
        return (((nll + self.cov_wt * cov) * mask).sum(1) / mask.sum(1)).mean()


# ---------------------------------------------------------------------------------------------
# factories


def make_sorter() -> PtrNet:
    torch.manual_seed(0)
    return PtrNet()


def make_standardized_sorter() -> PtrNet:
    torch.manual_seed(0)
    return PtrNet(standardize=True)


def make_hull() -> PtrNet:
    torch.manual_seed(0)
    return PtrNet(in_dim=2)


def make_inf_masked_sorter() -> PtrNet:
    torch.manual_seed(0)
    return PtrNet(fill=float("-inf"))


def make_anchored_hull() -> PtrNet:
    torch.manual_seed(0)
    return PtrNet(in_dim=2, anchor=True)


def make_pointer_generator() -> PointerGenerator:
    torch.manual_seed(0)
    return PointerGenerator()

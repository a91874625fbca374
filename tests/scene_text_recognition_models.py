"""Scene text recognition as its practitioners write it: a CRNN (a VGG-style conv backbone that
downsamples the width 4x, a BiLSTM over the columns, ``log_softmax`` over ``T x N x C`` for
``nn.CTCLoss`` with blank 0, ``input_lengths``/``target_lengths``), an optional spatial
transformer rectifying the crop first (a localisation net predicting an affine ``theta``,
``affine_grid``/``grid_sample``), and an attention decoder (Bahdanau attention over the columns
with a padding mask from each crop's width, teacher forcing, label-smoothed cross-entropy),
plus the data: synthetic word crops (1 x 16 x 64) whose glyphs are column patterns of their
characters, and a ``Dataset`` with a contrast-stretch augmentation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

BLANK = 0          # CTC blank; the attention decoder's PAD
EOS = 1            # the attention decoder's end of word
NCHAR = 12         # characters are 2..NCHAR+1
C = NCHAR + 2
H, W = 16, 64
T = W // 4         # feature columns after the backbone
MAXLEN = 6


def words(n: int, seed: int = 0, lengths: dict[int, int] | None = None):
    """``n`` labels (int64, padded with 0) and their lengths, 1..MAXLEN characters each;
    ``lengths``: index -> planted length."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, MAXLEN + 1, (n,), generator=g)
    for i, k in (lengths or {}).items():
        lens[i] = k
    labels = torch.zeros(n, int(lens.max()), dtype=torch.long)
    for i, k in enumerate(lens.tolist()):
        labels[i, :k] = torch.randint(2, C, (k,), generator=g)
    return labels, lens


def render(labels: torch.Tensor, lens: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Word crops in [0, 1]: each character a vertical pattern 8 columns wide, plus noise."""
    g = torch.Generator().manual_seed(seed + 1)
    glyphs = torch.rand(C, H, 8, generator=g)
    x = 0.05 * torch.rand(len(labels), 1, H, W, generator=g)
    for i, k in enumerate(lens.tolist()):
        for j in range(min(k, W // 8 - 1)):     # (a line's label on a word crop: cut)
            x[i, 0, :, 8 * j + 4:8 * j + 12] += glyphs[labels[i, j]]
    return x.clamp(0, 1)


class WordCrops(Dataset):
    """Crops with their labels; the augmentation stretches each crop's contrast to [0, 1]."""

    def __init__(self, x, labels, lens, stretch=True):
        self.x, self.labels, self.lens, self.stretch = x, labels, lens, stretch

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        img = self.x[i]
        if self.stretch:
            img = (img - img.min()) / (img.max() - img.min())
        return img, self.labels[i], self.lens[i]


class Backbone(nn.Module):
    def __init__(self, ch: int = 16):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, ch, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(ch, 2 * ch, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))

    def forward(self, x):
        f = self.conv(x)                      # N, 2ch, H/4, W/4
        return f.mean(2).permute(2, 0, 1)     # T, N, 2ch


class Rectifier(nn.Module):
    """STN: theta from a localisation net, initialised to the identity (weights 0, bias the
    identity) unless ``identity_init`` is False; ``unit_area`` rescales theta's linear part to
    determinant 1 so the rectified text keeps its size."""

    def __init__(self, identity_init=True, unit_area=False):
        super().__init__()
        self.loc = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d((2, 4)),
                                 nn.Flatten(), nn.Linear(64, 32), nn.ReLU())
        self.fc = nn.Linear(32, 6)
        nn.init.zeros_(self.fc.weight)
        with torch.no_grad():
            self.fc.bias.copy_(torch.tensor([1., 0, 0, 0, 1, 0]) if identity_init
                               else torch.zeros(6))
        self.unit_area = unit_area

    def forward(self, x):
        theta = self.fc(self.loc(x)).view(-1, 2, 3)
        if self.unit_area:
            a = theta[:, :, :2]
            det = a[:, 0, 0] * a[:, 1, 1] - a[:, 0, 1] * a[:, 1, 0]
            a = a / det.abs().sqrt()[:, None, None]
            theta = torch.cat([a, theta[:, :, 2:]], 2)
        grid = F.affine_grid(theta, list(x.shape), align_corners=False)
        return F.grid_sample(x, grid, align_corners=False), theta


class CRNN(nn.Module):
    def __init__(self, hidden=32, rectify=False, **stn):
        super().__init__()
        self.rectifier = Rectifier(**stn) if rectify else None
        self.backbone = Backbone()
        self.rnn = nn.LSTM(32, hidden, bidirectional=True)
        self.head = nn.Linear(2 * hidden, C)

    def forward(self, x):
        theta = None
        if self.rectifier is not None:
            x, theta = self.rectifier(x)
        seq, _ = self.rnn(self.backbone(x))
        logp = self.head(seq).log_softmax(-1)          # T, N, C
        return logp if theta is None else (logp, theta)


class CTCLoss(nn.Module):
    """``nn.CTCLoss`` with every column as each crop's input length; ``zero_infinity`` off, as
    its default."""

    def __init__(self, zero_infinity=False):
        super().__init__()
        self.ctc = nn.CTCLoss(blank=BLANK, zero_infinity=zero_infinity)

    def forward(self, logp, labels, lens):
        if isinstance(logp, tuple):                   # a rectified CRNN's (logp, theta)
            logp = logp[0]
        input_lengths = torch.full((logp.shape[1],), logp.shape[0], dtype=torch.long)
        return self.ctc(logp.float(), labels, input_lengths, lens)


class RectifiedCTCLoss(nn.Module):
    """CTC plus a pull of theta towards the identity (its Frobenius distance, per crop)."""

    def __init__(self, weight=0.1):
        super().__init__()
        self.ctc, self.weight = CTCLoss(), weight
        self.register_buffer("identity", torch.tensor([[1., 0, 0], [0, 1, 0]]))

    def forward(self, out, labels, lens):
        logp, theta = out
        dist = ((theta - self.identity) ** 2).sum((1, 2)).sqrt()
        return self.ctc(logp, labels, lens) + self.weight * dist.mean()


class LSTMCell(nn.Module):
    """A layer-normalised LSTM cell written out (as ASTER/MORAN-style code bases do)."""

    def __init__(self, n_in, hidden):
        super().__init__()
        self.ih, self.hh = nn.Linear(n_in, 4 * hidden), nn.Linear(hidden, 4 * hidden)
        self.ln = nn.LayerNorm(4 * hidden)

    def forward(self, x, h, c):
        gates = self.ln(self.ih(x) + self.hh(h))
        i, f, g, o = gates.chunk(4, -1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c


class AttnOCR(nn.Module):
    """Backbone, then a decoder attending over the columns each crop really has (``widths``
    in pixels; columns past ``ceil(width / 4)`` are masked), teacher-forced on the label."""

    def __init__(self, hidden=32):
        super().__init__()
        self.backbone = Backbone()
        self.embed = nn.Embedding(C, hidden)
        self.key = nn.Linear(32, hidden)
        self.query = nn.Linear(hidden, hidden)
        self.score = nn.Linear(hidden, 1)
        self.cell = LSTMCell(hidden + 32, hidden)
        self.out = nn.Linear(hidden, C)
        self.hidden = hidden

    def forward(self, x, inputs, widths):
        feats = self.backbone(x).transpose(0, 1)                  # N, T, F
        keys = self.key(feats)
        cols = torch.arange(feats.shape[1])
        pad = cols[None, :] >= (widths[:, None] + 3) // 4         # N, T
        h = c = feats.new_zeros(len(x), self.hidden)
        logits = []
        for t in range(inputs.shape[1]):
            e = self.score(torch.tanh(keys + self.query(h)[:, None])).squeeze(-1)
            alpha = e.masked_fill(pad, float("-inf")).softmax(-1)
            ctx = (alpha[:, :, None] * feats).sum(1)
            h, c = self.cell(torch.cat([self.embed(inputs[:, t]), ctx], -1), h, c)
            logits.append(self.out(h))
        return torch.stack(logits, 1)                             # N, L, C


def teacher_forcing(labels, lens):
    """(decoder inputs, targets): ``<eos>`` opens the inputs; the targets end with ``<eos>``."""
    n = len(labels)
    tgt = torch.cat([labels, labels.new_zeros(n, 1)], 1)
    tgt[torch.arange(n), lens] = EOS
    inp = torch.cat([labels.new_full((n, 1), EOS), tgt[:, :-1]], 1)
    return inp, tgt


class SmoothedCE(nn.Module):
    """Label-smoothed cross-entropy, averaged over each word's tokens then over the batch;
    ``count_eos`` False counts only the characters in each word's length."""

    def __init__(self, eps=0.1, count_eos=True):
        super().__init__()
        self.eps, self.count_eos = eps, count_eos

    def forward(self, logits, tgt):
        logp = logits.float().log_softmax(-1)
        nll = -logp.gather(-1, tgt[..., None]).squeeze(-1)
        smooth = -logp.mean(-1)
        tok = (1 - self.eps) * nll + self.eps * smooth
        keep = (tgt != BLANK) if self.count_eos else (tgt > EOS)
        per_word = (tok * keep).sum(1) / keep.sum(1)
        return per_word.mean()


def make_crnn():
    torch.manual_seed(0)
    return CRNN()


def make_stn_crnn():
    torch.manual_seed(0)
    return CRNN(rectify=True)


def make_unit_area_stn_crnn():
    torch.manual_seed(0)
    return CRNN(rectify=True, identity_init=False, unit_area=True)


def make_attn():
    torch.manual_seed(0)
    return AttnOCR()

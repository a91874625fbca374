"""Ports of Andrej Karpathy's training code, small, for ``test_karpathy_repos``.

- ``GPT``: nanoGPT's ``model.py`` — ``LayerNorm`` with an optional bias, ``CausalSelfAttention``
  with ``F.scaled_dot_product_attention`` (``flash``) or its manual fallback (``masked_fill`` of
  the causal ``bias`` buffer with ``-inf``), the tanh-GELU MLP, pre-norm ``Block``\\ s, tied
  ``wte``/``lm_head`` weights, ``_init_weights`` with the scaled ``c_proj`` init, ``forward(idx,
  targets)`` returning ``(logits, loss)`` with ``ignore_index=-1``, ``configure_optimizers``
  with decay / no-decay groups. ``hand_ln`` swaps in a hand-written LayerNorm (variance as
  ``E[x^2] - E[x]^2``), ``init_std`` the 0.02 of ``_init_weights``.
- makemore: ``Bigram`` (a logits table, as in makemore.py) and the lecture's one-layer bigram
  network, which computes ``probs = counts / counts.sum(1)`` by hand and the negative mean log
  of the targets' probabilities (``bigram_nll``); ``MLP`` (Bengio et al. 2003, as makemore.py),
  ``RNN`` with makemore's ``RNNCell`` / ``GRUCell``, ``BoW``.
- Data: ``get_batch`` (nanoGPT's random windows of a token stream), makemore's ``CharDataset``
  (words padded with ``-1`` targets) and its ``DataLoader``.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

# ----------------------------------------------------------------------------- nanoGPT


@dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = 32
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = True
    flash: bool = True
    hand_ln: bool = False
    init_std: float = 0.02
    entropy_reg: float = 0.0
    masked_value: int = 0  # the causal buffer's entries masked_fill replaces (0: the future)
    new_gelu: bool = False  # llm.c's and minGPT's NewGELU (the tanh form written out)


class LayerNorm(nn.Module):
    """LayerNorm but with an optional bias. PyTorch doesn't support simply bias=False."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class HandLayerNorm(LayerNorm):
    """A LayerNorm written out, its variance in one pass (``E[x^2] - E[x]^2``)."""

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = (x * x).mean(-1, keepdim=True) - mean * mean
        x = (x - mean) * torch.rsqrt(var + 1e-5)
        return x * self.weight + self.bias if self.bias is not None else x * self.weight


def make_ln(config, ndim):
    return HandLayerNorm(ndim, config.bias) if config.hand_ln else LayerNorm(ndim, config.bias)


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.masked_value = config.masked_value
        self.flash = config.flash and hasattr(F, "scaled_dot_product_attention")
        if not self.flash:
            # causal mask to ensure that attention is only applied to the left in the input
            self.register_buffer("bias", torch.tril(torch.ones(config.block_size,
                                                               config.block_size))
                                 .view(1, 1, config.block_size, config.block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0,
                is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == self.masked_value, float("-inf"))
            att = F.softmax(att, dim=-1)
            # attention entropy, kept to fight entropy collapse (Zhai et al. 2023)
            self.entropy = -torch.special.xlogy(att, att).sum(-1).mean()
            att = self.attn_dropout(att)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        y = self.resid_dropout(self.c_proj(y))
        return y


class NewGELU(nn.Module):
    """Implementation of the GELU activation function currently in Google BERT repo (identical
    to OpenAI GPT). Reference: Gaussian Error Linear Units (GELU) paper."""

    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi)
                                           * (x + 0.044715 * torch.pow(x, 3.0))))


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = NewGELU() if config.new_gelu else nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = make_ln(config, config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = make_ln(config, config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=make_ln(config, config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # https://paperswithcode.com/method/weight-tying
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        # apply special scaled init to the residual projections, per GPT-2 paper
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0,
                                      std=config.init_std / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)

    def forward(self, idx, targets=None, return_logits=True):
        device = idx.device
        b, t = idx.size()
        assert t <= self.config.block_size, f"Cannot forward sequence of length {t}"
        pos = torch.arange(0, t, dtype=torch.long, device=device)  # shape (t)
        tok_emb = self.transformer.wte(idx)  # token embeddings of shape (b, t, n_embd)
        pos_emb = self.transformer.wpe(pos)  # position embeddings of shape (t, n_embd)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                   ignore_index=-1)
            if self.config.entropy_reg:
                entropy = sum(block.attn.entropy for block in self.transformer.h)
                loss = loss - self.config.entropy_reg * entropy
        else:
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        # there are performance reasons why not returning logits is prudent, if not needed
        if not return_logits:
            logits = None
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type, **kw):
        param_dict = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        # any parameters that is 2D will be weight decayed, otherwise no.
        decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
        nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
        optim_groups = [
            {"params": decay_params, "weight_decay": weight_decay},
            {"params": nodecay_params, "weight_decay": 0.0},
        ]
        fused_available = "fused" in inspect.signature(torch.optim.AdamW).parameters
        use_fused = fused_available and device_type == "cuda"
        extra_args = dict(fused=True) if use_fused else dict()
        return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, **extra_args,
                                 **kw)


def make_gpt():
    return GPT(GPTConfig())


def make_gpt_manual():
    """The manual attention path (``flash = False``: an older torch, or a mask to inspect)."""
    return GPT(GPTConfig(flash=False))


def make_gpt_manual_big_init():
    """``_init_weights`` with ``std=n_embd ** 0.5`` where ``n_embd ** -0.5`` was meant."""
    return GPT(GPTConfig(flash=False, n_embd=64, init_std=64 ** 0.5))


def make_llmc_big_init():
    """llm.c's ``train_gpt2.py`` model (NewGELU, the flash path) with the mis-scaled init."""
    return GPT(GPTConfig(n_embd=64, init_std=8.0, new_gelu=True))


def make_gpt_mask_flipped():
    """The manual path's fill written ``self.bias == 1``: the past and the diagonal masked."""
    return GPT(GPTConfig(flash=False, masked_value=1))


def make_gpt_entropy_reg():
    """The manual attention path with an attention-entropy bonus in the loss."""
    return GPT(GPTConfig(flash=False, entropy_reg=0.01))


def make_gpt_hand_ln():
    """nanoGPT with a hand-written one-pass LayerNorm."""
    return GPT(GPTConfig(hand_ln=True))


def make_gpt_long_block():
    """``block_size`` 32 while the loop trains on windows of 16: ``wpe``'s rows 16..31 are
    never read, their gradient stays exactly 0."""
    return GPT(GPTConfig(block_size=32))


def get_batch(data, g=None, batch_size=4, block_size=16):
    """nanoGPT's ``get_batch``: random windows of the token stream, targets shifted by one
    (drawn from the global RNG, as nanoGPT does, when ``g`` is None)."""
    ix = torch.randint(len(data) - block_size, (batch_size,), generator=g)
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x, y


def token_stream(n=2048, vocab=32, seed=0):
    """A token stream with structure to learn (a noisy counter mod ``vocab``)."""
    g = torch.Generator().manual_seed(seed)
    steps = torch.randint(1, 3, (n,), generator=g)
    return steps.cumsum(0) % vocab


# ----------------------------------------------------------------------------- makemore


@dataclass
class ModelConfig:
    block_size: int = 8
    vocab_size: int = 27
    n_embd: int = 16
    n_embd2: int = 32


class Bigram(nn.Module):
    """makemore's Bigram: a lookup table of logits for the next character."""

    def __init__(self, config):
        super().__init__()
        n = config.vocab_size
        self.logits = nn.Parameter(torch.zeros((n, n)))

    def forward(self, idx, targets=None):
        logits = self.logits[idx]
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                   ignore_index=-1)
        return logits, loss


class BigramNet(nn.Module):
    """The lecture's bigram network: one-hot characters through one linear layer, softmax
    written out as ``counts = logits.exp(); probs = counts / counts.sum(1, keepdims=True)``."""

    def __init__(self, n=27):
        super().__init__()
        self.W = nn.Parameter(torch.randn((n, n)))
        self.n = n

    def forward(self, xs):
        xenc = F.one_hot(xs, num_classes=self.n).float()
        logits = xenc @ self.W  # predict log-counts
        counts = logits.exp()  # counts, equivalent to N
        probs = counts / counts.sum(1, keepdims=True)
        return probs


def bigram_nll(probs, ys):
    """The lecture's loss: the mean negative log of the targets' probabilities."""
    num = ys.nelement()
    return -probs[torch.arange(num), ys].log().mean()


def make_bigram_net():
    return BigramNet()


class MLPLM(nn.Module):
    """makemore's MLP: Bengio et al. 2003, the last ``block_size`` characters' embeddings
    concatenated (the blank token ``vocab_size`` before the word begins)."""

    def __init__(self, config):
        super().__init__()
        self.block_size = config.block_size
        self.vocab_size = config.vocab_size
        self.wte = nn.Embedding(config.vocab_size + 1, config.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(self.block_size * config.n_embd, config.n_embd2),
            nn.Tanh(),
            nn.Linear(config.n_embd2, self.vocab_size),
        )

    def forward(self, idx, targets=None):
        embs = []
        for _k in range(self.block_size):
            tok_emb = self.wte(idx)  # token embeddings of shape (b, t, n_embd)
            idx = torch.roll(idx, 1, 1)
            idx[:, 0] = self.vocab_size  # special <BLANK> token
            embs.append(tok_emb)
        x = torch.cat(embs, -1)  # (b, t, n_embd * block_size)
        logits = self.mlp(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                   ignore_index=-1)
        return logits, loss


def make_mlp():
    return MLPLM(ModelConfig())


class RNNCell(nn.Module):
    """the job of a 'Cell' is to: take input at current time step x_{t} and the hidden state
    at the previous time step h_{t-1} and return the resulting hidden state h_{t}."""

    def __init__(self, config):
        super().__init__()
        self.xh_to_h = nn.Linear(config.n_embd + config.n_embd2, config.n_embd2)

    def forward(self, xt, hprev):
        xh = torch.cat([xt, hprev], dim=1)
        ht = F.tanh(self.xh_to_h(xh))
        return ht


class GRUCell(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.xh_to_z = nn.Linear(config.n_embd + config.n_embd2, config.n_embd2)
        self.xh_to_r = nn.Linear(config.n_embd + config.n_embd2, config.n_embd2)
        self.xh_to_hbar = nn.Linear(config.n_embd + config.n_embd2, config.n_embd2)

    def forward(self, xt, hprev):
        xh = torch.cat([xt, hprev], dim=1)
        r = F.sigmoid(self.xh_to_r(xh))
        hprev_reset = r * hprev
        xhr = torch.cat([xt, hprev_reset], dim=1)
        hbar = F.tanh(self.xh_to_hbar(xhr))
        z = F.sigmoid(self.xh_to_z(xh))
        ht = (1 - z) * hprev + z * hbar
        return ht


class RNN(nn.Module):

    def __init__(self, config, cell_type):
        super().__init__()
        self.block_size = config.block_size
        self.vocab_size = config.vocab_size
        self.start = nn.Parameter(torch.zeros(1, config.n_embd2))  # the starting hidden state
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # token embeddings table
        if cell_type == "rnn":
            self.cell = RNNCell(config)
        elif cell_type == "gru":
            self.cell = GRUCell(config)
        self.lm_head = nn.Linear(config.n_embd2, self.vocab_size)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        emb = self.wte(idx)  # (b, t, n_embd)
        hprev = self.start.expand((b, -1))
        hiddens = []
        for i in range(t):
            xt = emb[:, i, :]  # (b, n_embd)
            ht = self.cell(xt, hprev)  # (b, n_embd2)
            hprev = ht
            hiddens.append(ht)
        hidden = torch.stack(hiddens, 1)  # (b, t, n_embd2)
        logits = self.lm_head(hidden)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                   ignore_index=-1)
        return logits, loss


def make_gru():
    return RNN(ModelConfig(), "gru")


class CausalBoW(nn.Module):
    """Causal bag of words: averages the preceding elements (makemore's BoW)."""

    def __init__(self, config):
        super().__init__()
        self.block_size = config.block_size
        self.register_buffer("bias", torch.tril(torch.ones(config.block_size, config.block_size))
                             .view(1, config.block_size, config.block_size))

    def forward(self, x):
        B, T, C = x.size()
        att = torch.zeros((B, T, T), device=x.device)
        att = att.masked_fill(self.bias[:, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ x  # (B, T, T) x (B, T, C) -> (B, T, C)
        return y


class BoWBlock(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.cbow = CausalBoW(config)
        self.mlp = nn.ModuleDict(dict(
            c_fc=nn.Linear(config.n_embd, config.n_embd2),
            c_proj=nn.Linear(config.n_embd2, config.n_embd),
        ))

    def forward(self, x):
        x = x + self.cbow(x)
        x = x + self.mlp.c_proj(F.tanh(self.mlp.c_fc(x)))
        return x


class BoW(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.block_size = config.block_size
        self.vocab_size = config.vocab_size
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.context_block = BoWBlock(config)
        self.lm_head = nn.Linear(config.n_embd, self.vocab_size)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device).unsqueeze(0)
        x = self.wte(idx) + self.wpe(pos)
        x = self.context_block(x)
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                   ignore_index=-1)
        return logits, loss


def make_bow():
    """A context of 10: makemore's ``block_size`` is the dataset's output length."""
    return BoW(ModelConfig(block_size=char_dataset().get_output_length()))


class CharDataset(Dataset):
    """makemore's dataset: each word as ``<START> w o r d`` inputs and ``w o r d <STOP>``
    targets, padded to ``max_word_length + 1`` with 0 inputs and -1 targets."""

    def __init__(self, words, chars, max_word_length):
        self.words = words
        self.chars = chars
        self.max_word_length = max_word_length
        self.stoi = {ch: i + 1 for i, ch in enumerate(chars)}

    def __len__(self):
        return len(self.words)

    def get_output_length(self):
        return self.max_word_length + 1  # <START> token followed by words

    def encode(self, word):
        return torch.tensor([self.stoi[w] for w in word], dtype=torch.long)

    def __getitem__(self, idx):
        word = self.words[idx]
        ix = self.encode(word)
        x = torch.zeros(self.max_word_length + 1, dtype=torch.long)
        y = torch.zeros(self.max_word_length + 1, dtype=torch.long)
        x[1:1 + len(ix)] = ix
        y[:len(ix)] = ix
        y[len(ix) + 1:] = -1  # index -1 will mask the loss at the inactive locations
        return x, y


NAMES = ["emma", "olivia", "ava", "isabella", "sophia", "charlotte", "mia", "amelia",
         "harper", "evelyn", "abigail", "emily", "elizabeth", "mila", "ella", "avery"]


def char_dataset(words=NAMES):
    chars = sorted(set("".join(NAMES)))
    return CharDataset(words, chars, max(len(w) for w in NAMES))


def bigram_pairs(words=NAMES):
    """The lecture's training set: ``xs``, ``ys`` of every bigram, ``.`` (0) at both ends."""
    chars = sorted(set("".join(NAMES)))
    stoi = {s: i + 1 for i, s in enumerate(chars)}
    xs, ys = [], []
    for w in words:
        chs = ["."] + list(w) + ["."]
        for ch1, ch2 in zip(chs, chs[1:]):
            xs.append(stoi.get(ch1, 0))
            ys.append(stoi.get(ch2, 0))
    return torch.tensor(xs), torch.tensor(ys)


def make_gpt_dropout_big_init():
    """The mis-scaled init of ``make_gpt_manual_big_init`` with nanoGPT's fine-tuning dropout."""
    return GPT(GPTConfig(flash=False, n_embd=64, init_std=7.0, dropout=0.1))


# ------------------------------------------------- makemore part 3: the lecture's own layers


class BatchNorm1d(nn.Module):
    """The lecture's BatchNorm1d, as an ``nn.Module``: batch statistics in training (``x.var``
    with Bessel's correction), running ones updated under ``torch.no_grad``."""

    def __init__(self, dim, eps=1e-5, momentum=0.1):
        super().__init__()
        self.eps = eps
        self.momentum = momentum
        self.gamma = nn.Parameter(torch.ones(dim))
        self.beta = nn.Parameter(torch.zeros(dim))
        self.register_buffer("running_mean", torch.zeros(dim))
        self.register_buffer("running_var", torch.ones(dim))

    def forward(self, x):
        if self.training:
            xmean = x.mean(0, keepdim=True)  # batch mean
            xvar = x.var(0, keepdim=True)  # batch variance
        else:
            xmean = self.running_mean
            xvar = self.running_var
        xhat = (x - xmean) / torch.sqrt(xvar + self.eps)  # normalize to unit variance
        self.out = self.gamma * xhat + self.beta
        if self.training:
            with torch.no_grad():
                self.running_mean.mul_(1 - self.momentum).add_(self.momentum * xmean[0])
                self.running_var.mul_(1 - self.momentum).add_(self.momentum * xvar[0])
        return self.out


class WaveNetMLP(nn.Module):
    """makemore part 3's MLP: ``C[X]`` flattened, then Linear(bias=False), BatchNorm1d, Tanh,
    and the output Linear (its weight scaled by 0.1 so the first loss is near log 27)."""

    def __init__(self, vocab_size=27, block_size=3, n_embd=10, n_hidden=64):
        super().__init__()
        self.C = nn.Embedding(vocab_size, n_embd)
        self.layers = nn.Sequential(
            nn.Linear(n_embd * block_size, n_hidden, bias=False), BatchNorm1d(n_hidden),
            nn.Tanh(), nn.Linear(n_hidden, vocab_size))
        with torch.no_grad():
            self.layers[-1].weight *= 0.1

    def forward(self, x):
        return self.layers(self.C(x).flatten(1))


def make_lecture_mlp():
    return WaveNetMLP()


def build_dataset(words=NAMES, block_size=3):
    """The lecture's ``build_dataset``: every (context of ``block_size`` characters, next
    character) pair, contexts padded with ``.`` (0) at the start."""
    chars = sorted(set("".join(NAMES)))
    stoi = {s: i + 1 for i, s in enumerate(chars)}
    X, Y = [], []
    for w in words:
        context = [0] * block_size
        for ch in w + ".":
            ix = stoi.get(ch, 0)
            X.append(context)
            Y.append(ix)
            context = context[1:] + [ix]
    return torch.tensor(X), torch.tensor(Y)

"""Memory-augmented networks written the way their public repositories write them, for
``test_memory_augmented.py``.

- ``NTM``: loudinthecloud/pytorch-ntm's addressing (``memory.py``: content similarity with a
  key strength through softplus, interpolation gate, circular-convolution shift, sharpening
  ``w ** gamma / sum``) with ixaxaar/pytorch-dnc's hand-written cosine ``θ`` (``util.py``)
  and its whole-sequence, time-major ``forward(x, hidden)`` returning the state (controller,
  memory, head weights), which the loop carries between truncated-BPTT chunks
  (``repackage_hidden``).
- ``EncapsulatedNTM``: pytorch-ntm's own interface (``ntm/aio.py``): ``init_sequence`` sets the
  memory and the previous state as attributes, each ``forward`` is one time step.
- ``MemN2N``: Sukhbaatar et al.'s end-to-end memory network as nmhkahn/MemN2N-pytorch writes
  it (adjacent weight tying, position encoding, temporal encoding), with the padded memory
  slots masked before the softmax (``masked_fill(-inf)``, or an additive ``-1e9``).
- ``PointerNet``: shiretzet/PointerNet's pointer network: an LSTM encoder, a decoder cell that
  points with additive attention over the encoder outputs, masking the padded positions and
  those it already pointed at (optionally with its frozen ``-inf`` parameter as the mask
  value).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# NTM / DNC
N_SLOTS, WORD, CTRL, IN_BITS = 8, 6, 16, 5
# MemN2N
VOCAB, EMB, SENTS, WORDS, HOPS = 20, 12, 5, 4, 2
# pointer network
PN_HID, PN_LEN = 12, 6

DELTA = 1e-6  # ixaxaar/pytorch-dnc util.δ


# ---------------------------------------------------------------------------------------------
# NTM


def theta(a, b, eps=DELTA):
    """ixaxaar/pytorch-dnc ``util.θ``: cosine similarity of every memory row with every key."""
    mag_a = torch.norm(a, 2, dim=2).unsqueeze(2)
    mag_b = torch.norm(b, 2, dim=2).unsqueeze(2)
    return torch.bmm(a, b.transpose(1, 2)) / (torch.bmm(mag_a, mag_b.transpose(1, 2)) + eps)


def cosine(a, b, eps=DELTA):
    """pytorch-ntm ``_similarity``'s ``F.cosine_similarity``, without its ``+ 1e-16`` (which
    older PyTorch needed for a memory of zeros)."""
    return F.cosine_similarity(a, b, dim=-1)[..., None]


def circular_convolve(w, s):
    """pytorch-ntm ``_convolve``, batched: ``w`` (B, N) shifted by the kernel ``s`` (B, 3)."""
    t = torch.cat([w[:, -1:], w, w[:, :1]], dim=1)
    return torch.stack([t[:, i:i + N_SLOTS] for i in range(3)], dim=2).mul(s[:, None]).sum(2)


class NTMMemory(nn.Module):
    """Content, then location addressing (pytorch-ntm ``NTMMemory.address``)."""

    def __init__(self, similarity=theta, eps=DELTA, sharpen_eps=1e-16):
        super().__init__()
        self.similarity = similarity
        self.eps = eps
        self.sharpen_eps = sharpen_eps

    def forward(self, memory, k, beta, g, s, gamma, w_prev):
        wc = F.softmax(beta * self.similarity(memory, k[:, None], self.eps).squeeze(2), dim=1)
        wg = g * wc + (1 - g) * w_prev
        w_hat = circular_convolve(wg, s)
        w = w_hat ** gamma
        return w / (w.sum(1, keepdim=True) + self.sharpen_eps)


class NTMHead(nn.Module):
    """pytorch-ntm ``NTMHeadBase``: k, beta, g, s, gamma split from one linear layer."""

    def __init__(self, write: bool):
        super().__init__()
        self.write = write
        self.lengths = [WORD, 1, 1, 3, 1] + ([WORD, WORD] if write else [])
        self.fc = nn.Linear(CTRL, sum(self.lengths))

    def forward(self, h):
        o = self.fc(h).split(self.lengths, dim=1)
        k, beta, g, s, gamma = o[:5]
        # pytorch-ntm: beta = F.softplus(beta), g = sigmoid, s = softmax, gamma = 1 + softplus
        out = [k, F.softplus(beta), torch.sigmoid(g), F.softmax(s, dim=1), 1 + F.softplus(gamma)]
        if self.write:
            out += [torch.sigmoid(o[5]), o[6]]  # erase, add
        return out


class NTM(nn.Module):
    """An LSTM controller, one read and one write head; ``forward(x, hidden)`` runs a (T, B, F)
    chunk and returns the outputs and ``(h, c, memory, w_read, w_write, read)`` to carry.
    ``cell``: pytorch-ntm's ``nn.LSTMCell`` controller, ``h`` and ``c`` (B, H); else
    ixaxaar/pytorch-dnc's ``nn.LSTM(batch_first=True)`` stepped one time step at a time, its
    ``h`` and ``c`` (layers, B, H)."""

    def __init__(self, similarity=theta, eps=DELTA, sharpen_eps=1e-16, cell: bool = True):
        super().__init__()
        self.cell = cell
        self.controller = (nn.LSTMCell(IN_BITS + WORD, CTRL) if cell
                           else nn.LSTM(IN_BITS + WORD, CTRL, batch_first=True))
        self.read_head = NTMHead(write=False)
        self.write_head = NTMHead(write=True)
        self.memory = NTMMemory(similarity, eps, sharpen_eps)
        self.fc = nn.Linear(CTRL + WORD, IN_BITS)
        # pytorch-ntm NTMMemory: the initial memory, a small uniform buffer
        self.register_buffer("mem_bias", torch.empty(N_SLOTS, WORD))
        stdev = 1 / (N_SLOTS + WORD) ** 0.5
        nn.init.uniform_(self.mem_bias, -stdev, stdev)

    def init_hidden(self, batch: int, zero_memory: bool = False):
        """The first state; ``zero_memory``: the memory starts at zeros, as the DNC's does."""
        z = torch.zeros
        mem = z(batch, N_SLOTS, WORD) if zero_memory else self.mem_bias.repeat(batch, 1, 1)
        w0 = torch.zeros(batch, N_SLOTS)
        w0[:, 0] = 1.0
        hc = (batch, CTRL) if self.cell else (1, batch, CTRL)
        return z(hc), z(hc), mem, w0, w0.clone(), z(batch, WORD)

    def step(self, inp, h, c):
        if self.cell:
            h, c = self.controller(inp, (h, c))
            return h, h, c
        out, (h, c) = self.controller(inp[:, None], (h, c))
        return out[:, 0], h, c

    def forward(self, x, hidden):
        h, c, mem, w_r, w_w, read = hidden
        outs = []
        for t in range(x.shape[0]):
            o, h, c = self.step(torch.cat([x[t], read], dim=1), h, c)
            k, beta, g, s, gamma, erase, add = self.write_head(o)
            w_w = self.memory(mem, k, beta, g, s, gamma, w_w)
            mem = mem * (1 - w_w[:, :, None] * erase[:, None]) + w_w[:, :, None] * add[:, None]
            w_r = self.memory(mem, *self.read_head(o), w_r)
            read = (w_r[:, :, None] * mem).sum(1)
            outs.append(self.fc(torch.cat([o, read], dim=1)))
        return torch.stack(outs), (h, c, mem, w_r, w_w, read)


def make_ntm_cosine():
    torch.manual_seed(0)
    return NTM(similarity=cosine)


def make_ntm_no_delta():
    torch.manual_seed(0)
    return NTM(eps=0.0)


def make_dnc_no_delta():
    torch.manual_seed(0)
    return NTM(eps=0.0, cell=False)


def repackage_hidden(h):
    """pytorch/examples' word language model: detach the carried state between chunks."""
    return tuple(t.detach() for t in h)


# ---------------------------------------------------------------------------------------------
# MemN2N


def position_encoding(sentence_size: int, embedding_dim: int):
    """Sukhbaatar et al. section 4.1: l_kj = (1 - j/J) - (k/d)(1 - 2j/J)."""
    j = torch.arange(1, sentence_size + 1, dtype=torch.float32)[:, None]
    k = torch.arange(1, embedding_dim + 1, dtype=torch.float32)[None]
    J, d = sentence_size, embedding_dim
    return (1 - j / J) - (k / d) * (1 - 2 * j / J)


class MemN2N(nn.Module):
    """nmhkahn/MemN2N-pytorch ``MemN2N`` with adjacent weight tying; story (B, S, W) and query
    (B, W) are word ids, 0 the padding word; a slot whose sentence is all padding is masked."""

    def __init__(self, mask_value: float | None = None):
        super().__init__()
        self.mask_value = mask_value  # None: masked_fill(-inf); else added where masked
        self.C = nn.ModuleList([nn.Embedding(VOCAB, EMB, padding_idx=0) for _ in range(HOPS + 1)])
        self.TA = nn.Parameter(torch.randn(HOPS + 1, SENTS, EMB) * 0.1)
        self.register_buffer("encoding", position_encoding(WORDS, EMB))

    def forward(self, story, query):
        u = (self.C[0](query) * self.encoding).sum(1)
        slots = story.ne(0).any(-1)  # (B, S): sentences that are not padding
        for hop in range(HOPS):
            m_a = (self.C[hop](story) * self.encoding).sum(2) + self.TA[hop]
            m_c = (self.C[hop + 1](story) * self.encoding).sum(2) + self.TA[hop + 1]
            scores = torch.bmm(m_a, u[:, :, None]).squeeze(2)
            if self.mask_value is None:
                scores = scores.masked_fill(~slots, float("-inf"))
            else:  # (the additive mask of attention code: 0 kept, mask_value masked)
                scores = scores + (1 - slots.to(scores.dtype)) * self.mask_value
            prob = F.softmax(scores, dim=1)
            u = u + (m_c * prob[:, :, None]).sum(1)
        return u @ self.C[HOPS].weight.t()


def make_memn2n():
    torch.manual_seed(0)
    return MemN2N()


def make_memn2n_additive():
    torch.manual_seed(0)
    return MemN2N(mask_value=-1e9)


# ---------------------------------------------------------------------------------------------
# pointer network


class PointerAttention(nn.Module):
    """shiretzet/PointerNet ``Attention``: u = V . tanh(W1 e + W2 d), masked, softmax."""

    def __init__(self, inf_param: bool = False):
        super().__init__()
        self.input_linear = nn.Linear(PN_HID, PN_HID)
        self.context_linear = nn.Conv1d(PN_HID, PN_HID, 1)
        self.V = nn.Parameter(torch.rand(PN_HID) * 0.2 - 0.1)
        # shiretzet/PointerNet keeps its mask value as a frozen parameter, written in with
        # att[mask] = self.inf[mask]
        self._inf = nn.Parameter(torch.tensor([float("-inf")]), requires_grad=False) \
            if inf_param else None

    def forward(self, inp, context, mask):
        q = self.input_linear(inp)[:, :, None]
        ctx = self.context_linear(context.permute(0, 2, 1))
        att = (self.V[None, :, None] * torch.tanh(q + ctx)).sum(1)
        if self._inf is not None:
            att[~mask] = self._inf.expand_as(att)[~mask]
        else:
            att = att.masked_fill(~mask, float("-inf"))
        alpha = F.softmax(att, dim=1)
        return (ctx * alpha[:, None]).sum(2), alpha


class PointerNet(nn.Module):
    """Points at the input positions in order of value (the sorting task); ``lengths`` gives
    each sequence's true length in a zero-padded batch (B, T, 1)."""

    def __init__(self, inf_param: bool = False):
        super().__init__()
        self.embedding = nn.Linear(1, PN_HID)
        self.encoder = nn.LSTM(PN_HID, PN_HID, batch_first=True)
        self.decoder = nn.LSTMCell(PN_HID, PN_HID)
        self.attention = PointerAttention(inf_param)
        self.decoder_input0 = nn.Parameter(torch.zeros(PN_HID).uniform_(-0.1, 0.1))

    def forward(self, x, lengths):
        b, t, _ = x.shape
        emb = self.embedding(x)
        enc, (h, c) = self.encoder(emb)
        h, c = h[0], c[0]
        mask = torch.arange(t)[None] < lengths[:, None]
        dec_in = self.decoder_input0.expand(b, -1)
        outputs = []
        for _ in range(t):
            h, c = self.decoder(dec_in, (h, c))
            h_att, alpha = self.attention(h, enc, mask)
            pointer = alpha.argmax(1)
            mask = mask & (torch.arange(t)[None] != pointer[:, None])
            dec_in = emb[torch.arange(b), pointer]
            outputs.append(alpha)
        return torch.stack(outputs, 1)


def make_pointer_net():
    torch.manual_seed(0)
    return PointerNet()


def make_pointer_net_inf_param():
    torch.manual_seed(0)
    return PointerNet(inf_param=True)


def pointer_loss(probs, target, lengths, eps=1e-10):
    """The decoder's NLL of the sorted order over each sequence's true length."""
    valid = torch.arange(probs.shape[1])[None] < lengths[:, None]
    nll = -torch.log(probs.gather(2, target[..., None])[..., 0] + eps)
    return (nll * valid).sum() / valid.sum()


# ---------------------------------------------------------------------------------------------
# pytorch-ntm's own loop: the state lives in the modules, one root forward per time step


class NTMMemoryBank(nn.Module):
    """pytorch-ntm ``NTMMemory``: the memory is an attribute, set by ``reset`` and rewritten by
    every ``write``; ``address`` runs :class:`NTMMemory`'s addressing on it."""

    def __init__(self, eps=DELTA):
        super().__init__()
        self.register_buffer("mem_bias", torch.empty(N_SLOTS, WORD))
        stdev = 1 / (N_SLOTS + WORD) ** 0.5
        nn.init.uniform_(self.mem_bias, -stdev, stdev)
        self.addressing = NTMMemory(theta, eps)
        self.memory = None

    def reset(self, batch_size: int, zero: bool = False):
        self.memory = (torch.zeros(batch_size, N_SLOTS, WORD) if zero
                       else self.mem_bias.clone().repeat(batch_size, 1, 1))

    def read(self, w):
        return torch.matmul(w.unsqueeze(1), self.memory).squeeze(1)

    def write(self, w, e, a):
        self.prev_mem = self.memory
        erase = torch.matmul(w.unsqueeze(-1), e.unsqueeze(1))
        add = torch.matmul(w.unsqueeze(-1), a.unsqueeze(1))
        self.memory = self.prev_mem * (1 - erase) + add

    def forward(self, k, beta, g, s, gamma, w_prev):
        return self.addressing(self.memory, k, beta, g, s, gamma, w_prev)


class EncapsulatedNTM(nn.Module):
    """pytorch-ntm ``EncapsulatedNTM``: ``init_sequence(batch)`` resets the memory and the
    previous state; each call ``net(x)`` (``net()`` for an output step) is one time step."""

    def __init__(self, eps=DELTA, zero_memory: bool = False):
        super().__init__()
        self.zero_memory = zero_memory  # the memory starts at zeros, as the DNC's does
        self.controller = nn.LSTMCell(IN_BITS + WORD, CTRL)
        self.read_head = NTMHead(write=False)
        self.write_head = NTMHead(write=True)
        self.memory = NTMMemoryBank(eps)
        self.fc = nn.Linear(CTRL + WORD, IN_BITS)
        self.batch_size, self.previous_state = None, None

    def init_sequence(self, batch_size: int):
        self.batch_size = batch_size
        self.memory.reset(batch_size, self.zero_memory)
        w0 = torch.zeros(batch_size, N_SLOTS)
        self.previous_state = (torch.zeros(batch_size, WORD), torch.zeros(batch_size, CTRL),
                               torch.zeros(batch_size, CTRL), w0, w0.clone())

    def forward(self, x=None):
        if x is None:
            x = torch.zeros(self.batch_size, IN_BITS)
        read, h, c, w_r, w_w = self.previous_state
        h, c = self.controller(torch.cat([x, read], dim=1), (h, c))
        w_r = self.memory(*self.read_head(h), w_r)
        read = self.memory.read(w_r)
        k, beta, g, s, gamma, erase, add = self.write_head(h)
        w_w = self.memory(k, beta, g, s, gamma, w_w)
        self.memory.write(w_w, erase, add)
        self.previous_state = (read, h, c, w_r, w_w)
        return torch.sigmoid(self.fc(torch.cat([h, read], dim=1))), self.previous_state


def make_encapsulated_ntm():
    torch.manual_seed(0)
    return EncapsulatedNTM()


def make_encapsulated_ntm_zeros_no_delta():
    torch.manual_seed(0)
    return EncapsulatedNTM(eps=0.0, zero_memory=True)


def make_encapsulated_ntm_zeros_no_delta_ready():
    """The same, in the state the loop puts it in before each sequence."""
    model = make_encapsulated_ntm_zeros_no_delta()
    model.init_sequence(4)
    return model

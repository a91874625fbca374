"""The official PyTorch tutorials' training code (pytorch/tutorials), ported as close as they go
to tiny sizes, with synthetic tensors shaped like their data (no torchvision, no torchtext):

- ``intermediate_source/seq2seq_translation_tutorial.py``: ``EncoderRNN`` and
  ``AttnDecoderRNN`` with ``BahdanauAttention``, teacher forcing, ``NLLLoss``, one Adam each;
  the batches of sentence pairs padded with 0 to ``MAX_LENGTH``. Planted: a source padding
  mask on the attention scores (``masked_fill(-inf)``), which an empty source sentence fills.
- ``intermediate_source/char_rnn_classification_tutorial.py`` and
  ``char_rnn_generation_tutorial.py``: the hand-written ``RNN`` cells (``i2h``, ``h2o``,
  ``o2o``) over one-hot letters. Planted: the generator's ``log(softmax(...))`` in place of
  ``LogSoftmax``.
- ``beginner_source/transformer_tutorial.py``: ``TransformerModel`` (``PositionalEncoding``,
  ``TransformerEncoder``, ``generate_square_subsequent_mask``), SGD lr 5 with
  ``clip_grad_norm_(0.5)`` and ``StepLR``. Planted: the clipping left out (lr 5 diverges).
- ``intermediate_source/reinforcement_q_learning.py``: ``DQN`` with ``SmoothL1Loss``, the
  target network's soft update by state_dict blending, ``clip_grad_value_(100)`` and
  ``AdamW(amsgrad=True)``. Planted: ``eps=0``.
- ``intermediate_source/spatial_transformer_tutorial.py``: ``Net`` with its localization
  network, ``affine_grid`` and ``grid_sample``. Planted: a corrupt image (NaN pixels).
- ``beginner_source/examples_autograd/polynomial_custom_function.py``: ``LegendrePolynomial3``
  (a custom ``autograd.Function``) fitted to sin(x) by hand-written updates under
  ``torch.no_grad()``. Planted: a learning rate 100x the tutorial's.
- ``beginner_source/text_sentiment_ngrams_tutorial.py``: ``TextClassificationModel``
  (``EmbeddingBag`` with offsets; the ``<unk>`` row starts at 0). Planted: the mean
  embedding's L2 norm as a feature, written by hand (``sqrt`` of the sum of squares), which a
  text of unknown tokens makes 0: finite forward, NaN gradient.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# ----------------------------------------------------------------------------- seq2seq

SOS_token, EOS_token, MAX_LENGTH = 0, 1, 6
IN_WORDS, OUT_WORDS, HIDDEN = 20, 18, 16


class EncoderRNN(nn.Module):
    def __init__(self, input_size, hidden_size, dropout_p=0.1):
        super().__init__()
        self.hidden_size = hidden_size
        self.embedding = nn.Embedding(input_size, hidden_size)
        self.gru = nn.GRU(hidden_size, hidden_size, batch_first=True)
        self.dropout = nn.Dropout(dropout_p)

    def forward(self, input):
        embedded = self.dropout(self.embedding(input))
        output, hidden = self.gru(embedded)
        return output, hidden


class BahdanauAttention(nn.Module):
    def __init__(self, hidden_size):
        super().__init__()
        self.Wa = nn.Linear(hidden_size, hidden_size)
        self.Ua = nn.Linear(hidden_size, hidden_size)
        self.Va = nn.Linear(hidden_size, 1)

    def forward(self, query, keys, pad_mask=None):
        scores = self.Va(torch.tanh(self.Wa(query) + self.Ua(keys)))
        scores = scores.squeeze(2).unsqueeze(1)
        if pad_mask is not None:  # the planted change: no attention to the source's padding
            scores = scores.masked_fill(pad_mask.unsqueeze(1), float("-inf"))
        weights = F.softmax(scores, dim=-1)
        context = torch.bmm(weights, keys)
        return context, weights


class AttnDecoderRNN(nn.Module):
    def __init__(self, hidden_size, output_size, dropout_p=0.1):
        super().__init__()
        self.embedding = nn.Embedding(output_size, hidden_size)
        self.attention = BahdanauAttention(hidden_size)
        self.gru = nn.GRU(2 * hidden_size, hidden_size, batch_first=True)
        self.out = nn.Linear(hidden_size, output_size)
        self.dropout = nn.Dropout(dropout_p)

    def forward(self, encoder_outputs, encoder_hidden, target_tensor=None, pad_mask=None):
        batch_size = encoder_outputs.size(0)
        decoder_input = torch.empty(batch_size, 1, dtype=torch.long).fill_(SOS_token)
        decoder_hidden = encoder_hidden
        decoder_outputs = []
        attentions = []
        for i in range(MAX_LENGTH):
            decoder_output, decoder_hidden, attn_weights = self.forward_step(
                decoder_input, decoder_hidden, encoder_outputs, pad_mask)
            decoder_outputs.append(decoder_output)
            attentions.append(attn_weights)
            if target_tensor is not None:
                decoder_input = target_tensor[:, i].unsqueeze(1)  # Teacher forcing
            else:
                _, topi = decoder_output.topk(1)
                decoder_input = topi.squeeze(-1).detach()
        decoder_outputs = torch.cat(decoder_outputs, dim=1)
        decoder_outputs = F.log_softmax(decoder_outputs, dim=-1)
        attentions = torch.cat(attentions, dim=1)
        return decoder_outputs, decoder_hidden, attentions

    def forward_step(self, input, hidden, encoder_outputs, pad_mask=None):
        embedded = self.dropout(self.embedding(input))
        query = hidden.permute(1, 0, 2)
        context, attn_weights = self.attention(query, encoder_outputs, pad_mask)
        input_gru = torch.cat((embedded, context), dim=2)
        output, hidden = self.gru(input_gru, hidden)
        output = self.out(output)
        return output, hidden, attn_weights


class Seq2Seq(nn.Module):
    """The tutorial's ``train_epoch`` body as one module (encoder, then decoder with teacher
    forcing); ``masked``: the source's padding (token 0) masked out of the attention."""

    def __init__(self, masked: bool = False):
        super().__init__()
        self.encoder = EncoderRNN(IN_WORDS, HIDDEN)
        self.decoder = AttnDecoderRNN(HIDDEN, OUT_WORDS)
        self.masked = masked

    def forward(self, input_tensor, target_tensor):
        encoder_outputs, encoder_hidden = self.encoder(input_tensor)
        pad_mask = input_tensor == 0 if self.masked else None
        decoder_outputs, _, _ = self.decoder(encoder_outputs, encoder_hidden, target_tensor,
                                             pad_mask)
        return decoder_outputs


def make_seq2seq() -> Seq2Seq:
    torch.manual_seed(0)
    return Seq2Seq()


def make_encoder_decoder() -> tuple[EncoderRNN, AttnDecoderRNN]:
    """The tutorial's two networks, as its main block builds them."""
    torch.manual_seed(0)
    return EncoderRNN(IN_WORDS, HIDDEN), AttnDecoderRNN(HIDDEN, OUT_WORDS)


def make_encoder() -> EncoderRNN:
    return make_encoder_decoder()[0]


def make_decoder() -> AttnDecoderRNN:
    return make_encoder_decoder()[1]


def make_masked_seq2seq() -> Seq2Seq:
    torch.manual_seed(0)
    return Seq2Seq(masked=True)


def sentence_pairs(n: int = 24, empty: int | None = None):
    """``get_dataloader``'s arrays: word ids after EOS padded with 0 to MAX_LENGTH; with
    ``empty``, that pair's source sentence has no word (a blank line of the corpus)."""
    g = torch.Generator().manual_seed(3)
    src = torch.zeros(n, MAX_LENGTH, dtype=torch.long)
    tgt = torch.zeros(n, MAX_LENGTH, dtype=torch.long)
    for i in range(n):
        ls, lt = (int(v) for v in torch.randint(1, MAX_LENGTH - 1, (2,), generator=g))
        src[i, :ls] = torch.randint(2, IN_WORDS, (ls,), generator=g)
        src[i, ls] = EOS_token
        tgt[i, :lt] = torch.randint(2, OUT_WORDS, (lt,), generator=g)
        tgt[i, lt] = EOS_token
    if empty is not None:
        src[empty] = 0
    return torch.utils.data.TensorDataset(src, tgt)


# ----------------------------------------------------------------------------- char-RNN

ALL_LETTERS = "abcdefghijklmnopqrstuvwxyz .,;'-"
N_LETTERS = len(ALL_LETTERS) + 1  # Plus EOS marker
N_CATEGORIES = 4


class RNN(nn.Module):
    """The generation tutorial's network; ``log_of_softmax``: the planted ``log(softmax)``."""

    def __init__(self, input_size, hidden_size, output_size, log_of_softmax=False):
        super().__init__()
        self.hidden_size = hidden_size
        self.i2h = nn.Linear(N_CATEGORIES + input_size + hidden_size, hidden_size)
        self.i2o = nn.Linear(N_CATEGORIES + input_size + hidden_size, output_size)
        self.o2o = nn.Linear(hidden_size + output_size, output_size)
        self.dropout = nn.Dropout(0.1)
        self.softmax = nn.LogSoftmax(dim=1)
        self.log_of_softmax = log_of_softmax

    def forward(self, category, input, hidden):
        input_combined = torch.cat((category, input, hidden), 1)
        hidden = self.i2h(input_combined)
        output = self.i2o(input_combined)
        output_combined = torch.cat((hidden, output), 1)
        output = self.o2o(output_combined)
        output = self.dropout(output)
        if self.log_of_softmax:
            output = torch.log(F.softmax(output, dim=1))
        else:
            output = self.softmax(output)
        return output, hidden

    def initHidden(self):
        return torch.zeros(1, self.hidden_size)


def make_char_rnn() -> RNN:
    torch.manual_seed(0)
    return RNN(N_LETTERS, 32, N_LETTERS)


def make_char_rnn_log_softmax() -> RNN:
    torch.manual_seed(0)
    return RNN(N_LETTERS, 32, N_LETTERS, log_of_softmax=True)


def random_name(step: int, repeat: int = 1):
    """``randomTrainingExample``: one-hot category, one-hot letters of a name, and the target
    letter ids shifted by one (EOS last); ``repeat``: its letters repeated (a long name)."""
    g = torch.Generator().manual_seed(100 + step)
    cat = int(torch.randint(N_CATEGORIES, (1,), generator=g))
    letters = torch.randint(len(ALL_LETTERS), (int(torch.randint(3, 7, (1,), generator=g)),),
                            generator=g).repeat(repeat)
    category = torch.zeros(1, N_CATEGORIES)
    category[0, cat] = 1
    line = torch.zeros(len(letters), 1, N_LETTERS)
    line[torch.arange(len(letters)), 0, letters] = 1
    target = torch.cat([letters[1:], torch.tensor([N_LETTERS - 1])])
    return category, line, target.unsqueeze(-1)


# ----------------------------------------------------------------------------- nn.Transformer LM

NTOKENS, BPTT = 40, 8


class PositionalEncoding(nn.Module):
    def __init__(self, d_model: int, dropout: float = 0.1, max_len: int = 5000):
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)
        position = torch.arange(max_len).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, 1, d_model)
        pe[:, 0, 0::2] = torch.sin(position * div_term)
        pe[:, 0, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe)

    def forward(self, x):
        """``x``: ``[seq_len, batch_size, embedding_dim]``"""
        x = x + self.pe[:x.size(0)]
        return self.dropout(x)


class TransformerModel(nn.Module):
    def __init__(self, ntoken: int, d_model: int, nhead: int, d_hid: int, nlayers: int,
                 dropout: float = 0.5):
        super().__init__()
        self.model_type = "Transformer"
        self.pos_encoder = PositionalEncoding(d_model, dropout)
        encoder_layers = nn.TransformerEncoderLayer(d_model, nhead, d_hid, dropout)
        self.transformer_encoder = nn.TransformerEncoder(encoder_layers, nlayers,
                                                         enable_nested_tensor=False)
        self.embedding = nn.Embedding(ntoken, d_model)
        self.d_model = d_model
        self.linear = nn.Linear(d_model, ntoken)
        self.init_weights()

    def init_weights(self) -> None:
        initrange = 0.1
        self.embedding.weight.data.uniform_(-initrange, initrange)
        self.linear.bias.data.zero_()
        self.linear.weight.data.uniform_(-initrange, initrange)

    def forward(self, src, src_mask=None):
        """``src``: ``[seq_len, batch_size]``, ``src_mask``: ``[seq_len, seq_len]``"""
        src = self.embedding(src) * math.sqrt(self.d_model)
        src = self.pos_encoder(src)
        output = self.transformer_encoder(src, src_mask)
        output = self.linear(output)
        return output


def generate_square_subsequent_mask(sz: int) -> torch.Tensor:
    """The tutorial's causal mask: ``-inf`` above the diagonal."""
    return torch.triu(torch.ones(sz, sz) * float("-inf"), diagonal=1)


def make_transformer_lm() -> TransformerModel:
    torch.manual_seed(0)
    return TransformerModel(NTOKENS, 16, 2, 32, 2, 0.2)


def batchify(n_tokens: int = 300, bsz: int = 4) -> torch.Tensor:
    """``batchify`` of a token stream (a synthetic WikiText-2): ``[N // bsz, bsz]``."""
    g = torch.Generator().manual_seed(5)
    data = torch.randint(NTOKENS, (n_tokens,), generator=g)
    seq_len = data.size(0) // bsz
    return data[:seq_len * bsz].view(bsz, seq_len).t().contiguous()


def get_batch(source: torch.Tensor, i: int):
    seq_len = min(BPTT, len(source) - 1 - i)
    data = source[i:i + seq_len]
    target = source[i + 1:i + 1 + seq_len].reshape(-1)
    return data, target


# ----------------------------------------------------------------------------- DQN

N_OBS, N_ACTIONS = 4, 2


class DQN(nn.Module):
    def __init__(self, n_observations, n_actions):
        super().__init__()
        self.layer1 = nn.Linear(n_observations, 32)
        self.layer2 = nn.Linear(32, 32)
        self.layer3 = nn.Linear(32, n_actions)

    def forward(self, x):
        x = F.relu(self.layer1(x))
        x = F.relu(self.layer2(x))
        return self.layer3(x)


def make_dqn() -> DQN:
    torch.manual_seed(0)
    return DQN(N_OBS, N_ACTIONS)


def transitions(step: int, batch_size: int = 16, action: int | None = None):
    """A replay-memory sample of CartPole transitions: state, action, next state (None when
    terminal), reward 1; ``action``: every transition took that action (a greedy policy's
    first steps)."""
    g = torch.Generator().manual_seed(200 + step)
    state = torch.randn(batch_size, N_OBS, generator=g) * 0.1
    act = torch.randint(N_ACTIONS, (batch_size, 1), generator=g)
    if action is not None:
        act.fill_(action)
    nxt = state + 0.02 * torch.randn(batch_size, N_OBS, generator=g)
    done = torch.rand(batch_size, generator=g) < 0.1
    return state, act, nxt, done, torch.ones(batch_size)


# ----------------------------------------------------------------------------- spatial transformer


class STNet(nn.Module):
    """The spatial transformer tutorial's ``Net`` on 1x28x28 digits (narrower)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, kernel_size=5)
        self.conv2 = nn.Conv2d(4, 8, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(128, 16)
        self.fc2 = nn.Linear(16, 10)
        # Spatial transformer localization-network
        self.localization = nn.Sequential(
            nn.Conv2d(1, 8, kernel_size=7),
            nn.MaxPool2d(2, stride=2),
            nn.ReLU(True),
            nn.Conv2d(8, 10, kernel_size=5),
            nn.MaxPool2d(2, stride=2),
            nn.ReLU(True),
        )
        # Regressor for the 3 * 2 affine matrix
        self.fc_loc = nn.Sequential(
            nn.Linear(10 * 3 * 3, 32),
            nn.ReLU(True),
            nn.Linear(32, 3 * 2),
        )
        # Initialize the weights/bias with identity transformation
        self.fc_loc[2].weight.data.zero_()
        self.fc_loc[2].bias.data.copy_(torch.tensor([1, 0, 0, 0, 1, 0], dtype=torch.float))

    def stn(self, x):
        xs = self.localization(x)
        xs = xs.view(-1, 10 * 3 * 3)
        theta = self.fc_loc(xs)
        theta = theta.view(-1, 2, 3)
        grid = F.affine_grid(theta, x.size(), align_corners=False)
        x = F.grid_sample(x, grid, align_corners=False)
        return x

    def forward(self, x):
        x = self.stn(x)
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 128)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def make_stn() -> STNet:
    torch.manual_seed(0)
    return STNet()


class Digits(torch.utils.data.Dataset):
    """MNIST-shaped digits, ``Normalize((0.1307,), (0.3081,))``-ed; ``corrupt``: that index's
    image decoded to NaN pixels (a truncated file read into the array)."""

    def __init__(self, n: int = 64, corrupt: int | None = None):
        g = torch.Generator().manual_seed(7)
        self.x = (torch.rand(n, 1, 28, 28, generator=g) - 0.1307) / 0.3081
        self.y = torch.randint(10, (n,), generator=g)
        if corrupt is not None:
            self.x[corrupt, 0, 10:14, 3:20] = float("nan")

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


# ----------------------------------------------------------------------------- custom autograd


class LegendrePolynomial3(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input):
        ctx.save_for_backward(input)
        return 0.5 * (5 * input ** 3 - 3 * input)

    @staticmethod
    def backward(ctx, grad_output):
        input, = ctx.saved_tensors
        return grad_output * 1.5 * (5 * input ** 2 - 1)


class Polynomial3(nn.Module):
    """y = a + b * P3(c + d * x) with the tutorial's initial a=0, b=-1, c=0, d=0.3."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.full((), 0.0))
        self.b = nn.Parameter(torch.full((), -1.0))
        self.c = nn.Parameter(torch.full((), 0.0))
        self.d = nn.Parameter(torch.full((), 0.3))

    def forward(self, x):
        P3 = LegendrePolynomial3.apply
        return self.a + self.b * P3(self.c + self.d * x)


def make_polynomial() -> Polynomial3:
    return Polynomial3()


def sine_points():
    x = torch.linspace(-math.pi, math.pi, 2000)
    return x, torch.sin(x)


class SumSquaredError(nn.Module):
    """The tutorial's ``(y_pred - y).pow(2).sum()``."""

    def forward(self, y_pred, y):
        return (y_pred - y).pow(2).sum()


# ----------------------------------------------------------------------------- text classification

VOCAB, EMSIZE, NUM_CLASS = 50, 16, 4


class TextClassificationModel(nn.Module):
    """``EmbeddingBag`` (mean of a text's token embeddings, the texts concatenated, ``offsets``
    where each starts) and a linear classifier; ``norm_feature``: the planted feature, the
    mean embedding's L2 norm written by hand, beside the mean."""

    def __init__(self, vocab_size, embed_dim, num_class, norm_feature=False):
        super().__init__()
        self.embedding = nn.EmbeddingBag(vocab_size, embed_dim, sparse=False)
        self.norm_feature = norm_feature
        self.fc = nn.Linear(embed_dim + int(norm_feature), num_class)
        self.init_weights()

    def init_weights(self):
        initrange = 0.5
        self.embedding.weight.data.uniform_(-initrange, initrange)
        self.embedding.weight.data[0] = 0  # <unk> starts at zero
        self.fc.weight.data.uniform_(-initrange, initrange)
        self.fc.bias.data.zero_()

    def forward(self, text, offsets):
        embedded = self.embedding(text, offsets)
        if self.norm_feature:
            length = torch.sqrt((embedded ** 2).sum(dim=1, keepdim=True))
            embedded = torch.cat([embedded, length], dim=1)
        return self.fc(embedded)


def make_text_classifier() -> TextClassificationModel:
    torch.manual_seed(0)
    return TextClassificationModel(VOCAB, EMSIZE, NUM_CLASS)


def make_text_classifier_with_norm() -> TextClassificationModel:
    torch.manual_seed(0)
    return TextClassificationModel(VOCAB, EMSIZE, NUM_CLASS, norm_feature=True)


def news_items(n: int = 32, unknown: int | None = None):
    """AG_NEWS-like (label, token ids) pairs after ``text_pipeline``, whose vocabulary maps an
    unknown token to ``<unk>`` (id 0, ``set_default_index``); ``unknown``: every token of that
    text unknown to the vocabulary (a text in another language)."""
    g = torch.Generator().manual_seed(11)
    items = []
    for i in range(n):
        length = int(torch.randint(3, 9, (1,), generator=g))
        tokens = torch.randint(1, VOCAB, (length,), generator=g)
        items.append((int(torch.randint(NUM_CLASS, (1,), generator=g)),
                      torch.zeros_like(tokens) if i == unknown else tokens))
    return items


def collate_batch(batch):
    """The tutorial's ``collate_batch``: labels, the texts concatenated, and their offsets."""
    label_list, text_list, offsets = [], [], [0]
    for _label, _text in batch:
        label_list.append(_label)
        text_list.append(_text)
        offsets.append(_text.size(0))
    label_list = torch.tensor(label_list, dtype=torch.int64)
    offsets = torch.tensor(offsets[:-1]).cumsum(dim=0)
    text_list = torch.cat(text_list)
    return label_list, text_list, offsets

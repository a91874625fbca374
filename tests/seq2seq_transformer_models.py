"""A tiny translation model written as PyTorch's "Language Translation with nn.Transformer"
tutorial writes it, with ``batch_first=True``: token embeddings times sqrt(d_model) plus a
sinusoidal positional-encoding buffer, ``nn.Transformer``, the square subsequent (float -inf)
``tgt_mask``, bool key-padding masks, teacher forcing, label-smoothed cross-entropy ignoring the
padding, and a DataLoader whose collate_fn pads. The factories of ``test_seq2seq_transformer.py``.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader

PAD, BOS, EOS = 0, 1, 2
SRC_VOCAB, TGT_VOCAB, D_MODEL, HEADS, FFN, LAYERS = 24, 20, 16, 4, 32, 2
N_PAIRS, BATCH = 48, 6


class PositionalEncoding(nn.Module):
    def __init__(self, emb_size: int, dropout: float, maxlen: int = 64):
        super().__init__()
        den = torch.exp(-torch.arange(0, emb_size, 2) * math.log(10000) / emb_size)
        pos = torch.arange(0, maxlen).reshape(maxlen, 1)
        pos_embedding = torch.zeros((maxlen, emb_size))
        pos_embedding[:, 0::2] = torch.sin(pos * den)
        pos_embedding[:, 1::2] = torch.cos(pos * den)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("pos_embedding", pos_embedding.unsqueeze(0))

    def forward(self, token_embedding):
        return self.dropout(token_embedding + self.pos_embedding[:, :token_embedding.size(1)])


class TokenEmbedding(nn.Module):
    def __init__(self, vocab_size: int, emb_size: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, emb_size)
        self.emb_size = emb_size

    def forward(self, tokens):
        return self.embedding(tokens.long()) * math.sqrt(self.emb_size)


class AttentionMapDecoderLayer(nn.TransformerDecoderLayer):
    """A decoder layer that keeps its attention maps for plotting: the two attention blocks
    ask ``nn.MultiheadAttention`` for the head-averaged weights (``need_weights=True``)."""

    def _sa_block(self, x, attn_mask, key_padding_mask, is_causal=False):
        x, w = self.self_attn(x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                              need_weights=True)
        self.self_attn_map = w.detach()
        return self.dropout1(x)

    def _mha_block(self, x, mem, attn_mask, key_padding_mask, is_causal=False):
        x, w = self.multihead_attn(x, mem, mem, attn_mask=attn_mask,
                                   key_padding_mask=key_padding_mask, need_weights=True)
        self.cross_attn_map = w.detach()
        return self.dropout2(x)


class Seq2SeqTransformer(nn.Module):
    def __init__(self, dropout: float = 0.1, attention_maps: bool = False):
        super().__init__()
        decoder = None
        if attention_maps:
            layer = AttentionMapDecoderLayer(D_MODEL, HEADS, FFN, dropout, batch_first=True)
            decoder = nn.TransformerDecoder(layer, LAYERS, nn.LayerNorm(D_MODEL))
        self.transformer = nn.Transformer(d_model=D_MODEL, nhead=HEADS,
                                          num_encoder_layers=LAYERS, num_decoder_layers=LAYERS,
                                          dim_feedforward=FFN, dropout=dropout, batch_first=True,
                                          custom_decoder=decoder)
        self.generator = nn.Linear(D_MODEL, TGT_VOCAB)
        self.src_tok_emb = TokenEmbedding(SRC_VOCAB, D_MODEL)
        self.tgt_tok_emb = TokenEmbedding(TGT_VOCAB, D_MODEL)
        self.positional_encoding = PositionalEncoding(D_MODEL, dropout=dropout)

    def forward(self, src, trg, src_mask, tgt_mask, src_padding_mask, tgt_padding_mask,
                memory_key_padding_mask):
        src_emb = self.positional_encoding(self.src_tok_emb(src))
        tgt_emb = self.positional_encoding(self.tgt_tok_emb(trg))
        outs = self.transformer(src_emb, tgt_emb, src_mask, tgt_mask, None,
                                src_padding_mask, tgt_padding_mask, memory_key_padding_mask)
        return self.generator(outs)


def make_model():
    torch.manual_seed(0)
    return Seq2SeqTransformer()


def make_model_with_maps():
    torch.manual_seed(0)
    return Seq2SeqTransformer(attention_maps=True)


def create_mask(src, tgt):
    """The tutorial's ``create_mask``: a float -inf causal mask and bool padding masks."""
    src_seq_len, tgt_seq_len = src.shape[1], tgt.shape[1]
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(tgt_seq_len)
    src_mask = torch.zeros((src_seq_len, src_seq_len)).type(torch.bool)
    return src_mask, tgt_mask, src == PAD, tgt == PAD


def create_mask_with_diagonal(src, tgt):
    """The user's bug: a bool causal mask built with ``diagonal=0``, so every position masks
    itself too, and the first target position sees nothing."""
    src_mask, _, src_pad, tgt_pad = create_mask(src, tgt)
    t = tgt.shape[1]
    tgt_mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=0)
    return src_mask, tgt_mask, src_pad, tgt_pad


def create_mask_without_bos(src, tgt):
    """The user's bug: the causal mask also hides the BOS key from every query ("attend to
    words only"), which leaves the first query, the BOS position itself, no key."""
    src_mask, tgt_mask, src_pad, tgt_pad = create_mask(src, tgt)
    tgt_mask[:, 0] = float("-inf")
    return src_mask, tgt_mask, src_pad, tgt_pad


def pairs(n: int = N_PAIRS, seed: int = 0):
    """Token pairs of varied lengths (a copy-and-reverse task) as a list of 1-D tensors."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(3, 9, (1,), generator=g))
        src = torch.randint(3, SRC_VOCAB, (length,), generator=g)
        tgt = (src.flip(0) % (TGT_VOCAB - 3)) + 3
        out.append((src, torch.cat([torch.tensor([BOS]), tgt, torch.tensor([EOS])])))
    return out


def collate_fn(batch):
    src = pad_sequence([s for s, _ in batch], batch_first=True, padding_value=PAD)
    tgt = pad_sequence([t for _, t in batch], batch_first=True, padding_value=PAD)
    return src, tgt


def loader(data=None):
    return DataLoader(data if data is not None else pairs(), batch_size=BATCH, shuffle=False,
                      collate_fn=collate_fn)


def warmup(warmup_steps: int = 4):
    return lambda step: min(1.0, (step + 1) / warmup_steps)

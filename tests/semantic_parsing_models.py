"""Text-to-SQL with grammar-constrained decoding as TranX / RAT-SQL style parsers write it, small
(``test_semantic_parsing.py``). An example is a question (token ids, 0 pads), its table's schema
(column-name token ids, 0 pads, and per-column numeric statistics of the database's cells) and
the gold SQL as a sequence of grammar actions over one action space: ``R`` ApplyRule actions,
``V`` GenToken actions (a value literal) and ``C`` CopyColumn actions (a schema column). A
``DataLoader``'s ``collate_fn`` pads them into a batch: ``q (B, L)``, ``q_len (B,)``, ``cols
(B, C)``, ``col_mask (B, C)``, ``col_stats (B, C)``, the teacher-forced previous actions
``prev (B, T)``, the gold actions ``gold (B, T)`` padded with -100 and the grammar state's
action mask ``valid (B, T, A)`` (a CopyColumn state allows only the schema's columns).

The model: an LSTM encoder over the question, schema linking features (the string-match count
of each column in the question, as a fraction of the question's length, and sublinearly
scaled ``(count + 1) ** p - 1`` with a learned ``p``) beside the column's name embedding and
cell statistics, an LSTM decoder over the previous gold actions with attention over the
question, action logits (rules, tokens, and a pointer's scores over the columns) masked with
``masked_fill(~valid, -inf)`` and a softmax, and a pointer-generator switch: the final
distribution is ``p_gen * p_action + (1 - p_gen) * p_copy`` with ``p_copy`` the question
attention scattered onto the GenToken actions of its tokens. The loss (``LabelSmoothedNLL``)
is a label-smoothed cross-entropy over the log of that distribution, the smoothing spread over
the valid actions, ignoring the -100 padding."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

Q_VOCAB, R, V, C, L, T, B, D = 24, 4, 6, 4, 7, 5, 4, 16
A = R + V + C
ROOT, SELECT, WHERE, END = 0, 1, 2, 3
IGNORE = -100


class SchemaLinker(nn.Module):
    """RAT-SQL's schema linking, as features: each column's string-match count in the
    question, as a fraction of the question's length and scaled sublinearly with a learned
    exponent, beside the column's name embedding and its cells' statistics."""

    def __init__(self, d: int = D, plant: str = "none"):
        super().__init__()
        self.p = nn.Parameter(torch.tensor(0.5))
        self.proj = nn.Linear(3, d)
        self.plant = plant

    def forward(self, q, q_len, cols, col_stats):
        hits = (q[:, None, :] == cols[:, :, None]) & (q[:, None, :] != 0)
        counts = hits.sum(-1).float()
        frac = counts / q_len[:, None].float()
        if self.plant == "pow":
            scaled = counts ** self.p  # the bug: count 0 -> d/dp of 0 ** p is 0 * log(0)
        else:
            scaled = (counts + 1) ** self.p - 1
        return self.proj(torch.stack([frac, scaled, col_stats], -1))


class Text2SQL(nn.Module):
    """Encoder, schema linker, grammar-masked decoder with a pointer-generator switch."""

    def __init__(self, d: int = D, plant: str = "none", gen_bias: float = 0.0,
                 hand_softmax: bool = False, log_output: bool = False):
        super().__init__()
        self.hand_softmax, self.log_output = hand_softmax, log_output
        self.embed = nn.Embedding(Q_VOCAB, d, padding_idx=0)
        self.encoder = nn.LSTM(d, d, batch_first=True)
        self.linker = SchemaLinker(d, plant)
        self.act_embed = nn.Embedding(A + 1, d)  # A: the start action
        self.decoder = nn.LSTM(d, d, batch_first=True)
        self.rule_head = nn.Linear(2 * d, R + V)
        self.col_query = nn.Linear(2 * d, d)
        self.switch = nn.Linear(2 * d, 1)
        with torch.no_grad():
            self.switch.bias.fill_(gen_bias)
        self.register_buffer("tok2act", R + torch.arange(Q_VOCAB) % V)

    def forward(self, q, q_len, cols, col_mask, col_stats, prev, valid):
        q_mask = q != 0
        enc, (h, c) = self.encoder(self.embed(q))
        col_enc = self.embed(cols) + self.linker(q, q_len, cols, col_stats)
        dec, _ = self.decoder(self.act_embed(prev), (h, c))
        att = (dec @ enc.transpose(1, 2)).masked_fill(~q_mask[:, None, :], float("-inf"))
        attn = att.softmax(-1)  # (B, T, L)
        ctx = torch.cat([dec, attn @ enc], -1)
        col_scores = self.col_query(ctx) @ col_enc.transpose(1, 2)  # (B, T, C)
        col_scores = col_scores.masked_fill(~col_mask[:, None, :], float("-inf"))
        logits = torch.cat([self.rule_head(ctx), col_scores], -1)
        if self.log_output:  # no copy: the masked actions' log-probabilities, -inf at invalid
            return logits.masked_fill(~valid, float("-inf")).log_softmax(-1), None, attn
        if self.hand_softmax:  # older parsers' masked softmax: exp, zero the invalid, sum
            e = logits.exp() * valid
            p_action = e / e.sum(-1, keepdim=True)
        else:
            p_action = logits.masked_fill(~valid, float("-inf")).softmax(-1)
        p_gen = torch.sigmoid(self.switch(ctx))
        index = self.tok2act[q][:, None, :].expand(-1, prev.shape[1], -1)
        p_copy = torch.zeros_like(p_action).scatter_add(-1, index, attn)
        return p_gen * p_action + (1 - p_gen) * p_copy, p_gen, attn


class LabelSmoothedNLL(nn.Module):
    """Label-smoothed cross-entropy over the log of the decoder's action distribution, the
    smoothing spread over the grammar's valid actions, gold padding ``ignore_index`` skipped;
    ``switch_entropy`` adds a bonus on the pointer-generator switch's entropy (keep it from
    collapsing to always-generate), ``attn_entropy`` a penalty on the question attention's
    entropy (padding positions, attention 0, left out by a ``torch.where``)."""

    def __init__(self, eps: float = 0.1, ignore_index: int = IGNORE, switch_entropy: float = 0.0,
                 attn_entropy: float = 0.0, floor: float = 1e-12, log_input: bool = False):
        super().__init__()
        self.log_input = log_input
        self.eps, self.ignore_index = eps, ignore_index
        self.switch_entropy, self.attn_entropy = switch_entropy, attn_entropy
        self.floor = floor

    def forward(self, out, gold, valid):
        probs, p_gen, attn = out
        logp = probs if self.log_input else probs.clamp_min(self.floor).log()
        keep = gold != self.ignore_index
        nll = -logp.gather(-1, gold.clamp_min(0)[..., None])[..., 0]
        smooth = -(logp * valid).sum(-1) / valid.sum(-1).clamp_min(1)  # -inf * 0 if log_input
        tok = (1 - self.eps) * nll + self.eps * smooth
        loss = (tok * keep).sum() / keep.sum()
        if self.switch_entropy:
            ent = -(p_gen * p_gen.log() + (1 - p_gen) * (1 - p_gen).log())
            loss = loss - self.switch_entropy * ent.mean()
        if self.attn_entropy:  # sharpen the question attention: penalise its entropy
            plogp = torch.where(attn > 0, attn * attn.log(), 0.0)  # the bug: d log(0) is inf
            loss = loss - self.attn_entropy * plogp.sum(-1).mean()
        return loss


class SeqNLL(nn.Module):
    """``nn.NLLLoss(ignore_index=-100)`` over the log of the action distribution, flattened
    over the batch and the decoding steps (a loss wrapper around the library's loss)."""

    def __init__(self, floor: float = 1e-12):
        super().__init__()
        self.nll, self.floor = nn.NLLLoss(ignore_index=IGNORE), floor

    def forward(self, out, gold, valid):
        logp = out[0].clamp_min(self.floor).log()
        return self.nll(logp.flatten(0, 1), gold.flatten())


# ---------------------------------------------------------------------------------------------
# data


def example(g: torch.Generator) -> dict:
    """One (question, schema, SQL): SELECT col [WHERE col = value] as grammar actions."""
    n_cols = int(torch.randint(2, C + 1, (1,), generator=g))
    cols = torch.randint(1, Q_VOCAB, (n_cols,), generator=g)
    n_q = int(torch.randint(3, L + 1, (1,), generator=g))
    q = torch.randint(1, Q_VOCAB, (n_q,), generator=g)
    col = int(torch.randint(0, n_cols, (1,), generator=g))
    q[0] = cols[col]  # the question mentions the selected column
    value = int(q[-1])
    acts = [ROOT, SELECT, R + V + col]
    states = ["rule", "rule", "col"]
    if torch.rand((), generator=g) < 0.5:
        acts += [WHERE, R + value % V]
        states += ["rule", "tok"]
    acts.append(END)
    states.append("rule")
    stats = torch.randn(n_cols, generator=g)
    return {"q": q, "cols": cols, "stats": stats, "acts": acts[:T], "states": states[:T]}


def valid_mask(states: list[str], col_mask: torch.Tensor) -> torch.Tensor:
    """The grammar state's action mask: rules in a rule state, tokens in a token state, the
    schema's columns in a column state, everything at padding steps."""
    valid = torch.ones(T, A, dtype=torch.bool)
    for t, s in enumerate(states):
        valid[t] = False
        if s == "rule":
            valid[t, :R] = True
        elif s == "tok":
            valid[t, R:R + V] = True
        else:
            valid[t, R + V:] = col_mask
    return valid


def collate(batch: list[dict]) -> dict:
    """Pad a list of examples into the model's tensors (teacher forcing: prev is gold shifted
    right behind the start action)."""
    n = len(batch)
    out = {"q": torch.zeros(n, L, dtype=torch.long), "q_len": torch.zeros(n, dtype=torch.long),
           "cols": torch.zeros(n, C, dtype=torch.long), "col_mask": torch.zeros(n, C, dtype=bool),
           "col_stats": torch.zeros(n, C), "prev": torch.full((n, T), A, dtype=torch.long),
           "gold": torch.full((n, T), IGNORE, dtype=torch.long),
           "valid": torch.ones(n, T, A, dtype=torch.bool)}
    for i, ex in enumerate(batch):
        nq, nc, na = len(ex["q"]), len(ex["cols"]), len(ex["acts"])
        out["q"][i, :nq], out["q_len"][i] = ex["q"], nq
        out["cols"][i, :nc], out["col_mask"][i, :nc] = ex["cols"], True
        out["col_stats"][i, :nc] = ex["stats"]
        out["gold"][i, :na] = torch.tensor(ex["acts"])
        out["prev"][i, 1:na] = torch.tensor(ex["acts"][:-1])
        out["valid"][i] = valid_mask(ex["states"], out["col_mask"][i])
    return out


class Text2SQLData(Dataset):
    """``steps * B`` examples; ``plant`` breaks example ``bad`` of step ``k``."""

    def __init__(self, steps: int, plant: str = "none", k: int = 2, bad: int = 1):
        g = torch.Generator().manual_seed(0)
        self.items = [example(g) for _ in range(steps * B)]
        ex = self.items[k * B + bad]
        if plant == "nocol":  # the table's columns were all dropped by a schema filter
            ex["cols"], ex["stats"] = ex["cols"][:0], ex["stats"][:0]
        elif plant == "emptyq":  # a question the tokenizer left no token of
            ex["q"] = ex["q"][:0]
        elif plant == "nanstat":  # the mean of a column whose cells are all NULL
            ex["stats"][0] = float("nan")
        elif plant == "unparsed":  # gold SQL the grammar could not parse: no action kept
            for j in range(bad + 1):
                self.items[k * B + j] = {**self.items[k * B + j], "acts": [], "states": []}
        elif plant == "rawstat":  # a SUM over a BIGINT column, left unstandardised
            ex["stats"][0] = 4.0e6

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def loader(plant: str = "none", k: int = 2, bad: int = 1, steps: int = 4) -> DataLoader:
    return DataLoader(Text2SQLData(steps, plant, k, bad), batch_size=B, shuffle=False,
                      collate_fn=collate)


def make_model(plant: str = "none", gen_bias: float = 0.0, hand_softmax: bool = False,
               log_output: bool = False) -> Text2SQL:
    torch.manual_seed(0)
    return Text2SQL(plant=plant, gen_bias=gen_bias, hand_softmax=hand_softmax,
                    log_output=log_output)

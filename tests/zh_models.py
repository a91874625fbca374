"""Preference fine-tuning as TRL-style code writes it by hand: a tiny randomly initialised
GPT-2 policy (``zh_models:make_policy``; a frozen copy of it is the reference), batches of
prompt + chosen / rejected completions with a completion mask, per-token log-probabilities
gathered and averaged over the valid tokens, and DPO's ``-logsigmoid(beta * margin)``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, CTX, PROMPT = 50, 12, 4


def make_policy() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2,
                                      n_head=4, attn_pdrop=0.0, resid_pdrop=0.0,
                                      embd_pdrop=0.0))


def pairs(g: torch.Generator, batch: int, empty_rejected: int | None = None) -> dict:
    """Prompt + chosen and prompt + rejected token ids, their completion masks (1 on the
    completion's real tokens, 0 on the prompt and the right padding); ``empty_rejected``: that
    row's rejected completion is empty (a filtered-out answer: only padding)."""
    ids = torch.randint(3, VOCAB, (2 * batch, CTX), generator=g)
    lens = torch.randint(3, CTX - PROMPT + 1, (2 * batch,), generator=g)
    pos = torch.arange(CTX)
    mask = (pos >= PROMPT) & (pos < PROMPT + lens[:, None])
    if empty_rejected is not None:
        mask[batch + empty_rejected] = False
    ids = ids.masked_fill(~mask & (pos >= PROMPT), 0)  # pad token 0
    ids[batch:, :PROMPT] = ids[:batch, :PROMPT]  # the same prompt for both completions
    return {"input_ids": ids, "completion_mask": mask.long()}


def sequence_logps(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
                   average: bool = True) -> torch.Tensor:
    """Per-sequence log-probability of the completion: next-token log-softmax gathered at the
    labels, masked, then summed (DPO) or averaged over the valid tokens (IPO, SimPO)."""
    logits, labels, m = logits[:, :-1], ids[:, 1:], mask[:, 1:].to(logits.dtype)
    per_token = torch.gather(logits.log_softmax(-1), 2, labels.unsqueeze(-1)).squeeze(-1)
    total = (per_token * m).sum(-1)
    return total / m.sum(-1) if average else total


def dpo_loss(policy_logps, ref_logps, beta: float = 0.1, ipo: bool = False):
    n = len(policy_logps) // 2
    pi = policy_logps[:n] - policy_logps[n:]
    ref = ref_logps[:n] - ref_logps[n:]
    logits = pi - ref
    if ipo:
        return ((logits - 1 / (2 * beta)) ** 2).mean()
    return -F.logsigmoid(beta * logits).mean()


def dpo_criterion(logits, ids, mask, ref_logps, beta: float = 0.1, average: bool = True):
    """The whole DPO objective from the policy's logits, as a function the loop calls."""
    return dpo_loss(sequence_logps(logits, ids, mask, average), ref_logps, beta)


def dpo_from_logits(logits, ref_logits, ids, mask, beta: float = 0.1, average: bool = True):
    """DPO as TRL's ``concatenated_forward`` computes it: both models' logits in, the per-token
    log-probabilities of the policy and the reference gathered by the same function."""
    ref_logps = sequence_logps(ref_logits, ids, mask, average)
    return dpo_loss(sequence_logps(logits, ids, mask, average), ref_logps, beta)


def token_logps(logits, ids):
    return torch.gather(logits[:, :-1].log_softmax(-1), 2, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def masked_mean(x, mask):
    return (x * mask).sum() / mask.sum()


def ppo_loss(logits, ids, old_logps, advantages, mask, clip: float = 0.2):
    """PPO's clipped surrogate over the response tokens (TRL's ``masked_mean``)."""
    ratio = torch.exp(token_logps(logits, ids) - old_logps)
    pg = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - clip, 1 + clip))
    return masked_mean(pg, mask)


def kto_loss(logits, ref_logits, ids, mask, desirable, beta: float = 0.1):
    """KTO by hand: each completion on its own, labelled desirable or not; the reference point
    is the batch's KL estimate (clamped at 0, no gradient), and the loss the mean of the
    desirable and the undesirable losses, each a mean over its own rows."""
    logratio = sequence_logps(logits, ids, mask, False) - sequence_logps(ref_logits, ids, mask,
                                                                         False)
    kl = logratio.mean().clamp(min=0).detach()
    chosen = 1 - torch.sigmoid(beta * (logratio[desirable] - kl))
    rejected = 1 - torch.sigmoid(beta * (kl - logratio[~desirable]))
    return chosen.mean() + rejected.mean()


class ValueHeadLM(nn.Module):
    """TRL's ``AutoModelForCausalLMWithValueHead`` by hand: the LM and a scalar head on the
    last hidden state."""

    def __init__(self):
        super().__init__()
        self.lm = make_policy()
        self.v_head = nn.Linear(self.lm.config.n_embd, 1)

    def forward(self, input_ids, attention_mask=None):
        out = self.lm(input_ids, attention_mask=attention_mask, output_hidden_states=True)
        return out.logits, self.v_head(out.hidden_states[-1]).squeeze(-1)


def make_value_lm() -> ValueHeadLM:
    return ValueHeadLM()


def whiten(x, mask, shift_mean: bool = True):
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    return out if shift_mean else out + mean


def rlhf_ppo_loss(out, ids, old_logps, old_values, rewards, ref_logps, mask, kl_coef=0.05,
                  clip=0.2, gamma=1.0, lam=0.95):
    """TRL's PPOTrainer step by hand: per-token rewards (the KL penalty to the reference, the
    score at the last token), GAE advantages whitened over the batch's valid tokens, clipped
    policy and value losses averaged over them."""
    logits, values = out
    values = values[:, :-1]
    logps = token_logps(logits, ids)
    with torch.no_grad():
        r = -kl_coef * (old_logps - ref_logps)
        last = mask.long().cumsum(-1).argmax(-1)
        r[torch.arange(len(r)), last] += rewards
        adv, gae = torch.zeros_like(r), torch.zeros(len(r))
        for t in reversed(range(r.shape[1])):
            nxt = old_values[:, t + 1] if t + 1 < r.shape[1] else torch.zeros(len(r))
            gae = r[:, t] + gamma * nxt - old_values[:, t] + gamma * lam * gae
            adv[:, t] = gae
        returns = adv + old_values
        adv = whiten(adv, mask)
    vclipped = old_values + (values - old_values).clamp(-clip, clip)
    vf = 0.5 * masked_mean(torch.max((values - returns) ** 2, (vclipped - returns) ** 2), mask)
    ratio = torch.exp(logps - old_logps)
    pg = masked_mean(torch.max(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip)), mask)
    return pg + 0.1 * vf

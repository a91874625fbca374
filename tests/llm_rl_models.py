"""RL post-training of a language model as TRL's ``GRPOTrainer`` / ``PPOTrainer`` and verl write
it: a tiny randomly initialised Llama policy (``llm_rl_models:make_policy``; a frozen copy is
the reference), prompts left-padded with an ``attention_mask`` and ``position_ids``, sampled
completions cut after their EOS (a completion mask), per-token log-probabilities gathered from
the logits shifted by one, the k3 KL estimator, the clipped importance ratio, group-normalised
advantages, a Bradley-Terry reward model and a policy with a value head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, PAD, EOS, BOS = 40, 0, 1, 2
PROMPT, COMPLETION = 5, 6


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, pad_token_id=PAD, eos_token_id=EOS,
                      bos_token_id=BOS, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def make_policy() -> nn.Module:
    return tiny_llama()


def prompts(g: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` prompts of 2..PROMPT tokens, left-padded as a tokenizer with
    ``padding_side="left"`` pads them: ids and attention mask."""
    lens = torch.randint(2, PROMPT + 1, (n,), generator=g)
    ids = torch.randint(3, VOCAB, (n, PROMPT), generator=g)
    mask = torch.arange(PROMPT) >= PROMPT - lens[:, None]
    ids[:, -1] = BOS  # the chat template's last token
    return ids.masked_fill(~mask, PAD), mask.long()


def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """``position_ids`` of a left-padded batch (TRL, verl: cumsum of the mask, 1 on padding)."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.masked_fill(attention_mask == 0, 1)


@torch.no_grad()
def sample(policy, prompt_ids, prompt_mask, g: torch.Generator, temperature: float = 1.0,
           eos_boost: float = 0.0):
    """Sampled completions, token by token (the rollout), then cut after the first EOS as
    TRL does: ``is_eos.int().argmax(1)``, padding after it. ``eos_boost`` adds to EOS's logit
    (a rollout that answers nothing); the PAD token is forbidden with ``-inf``."""
    ids, mask = prompt_ids, prompt_mask
    for _ in range(COMPLETION):
        out = policy(ids, attention_mask=mask, position_ids=positions(mask))
        logits = logits_of(out)[:, -1].float() / temperature
        logits[:, PAD] = float("-inf")
        logits[:, EOS] += eos_boost
        nxt = torch.multinomial(logits.softmax(-1), 1, generator=g)
        ids, mask = torch.cat([ids, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1)
    completion = ids[:, prompt_ids.shape[1]:]
    is_eos = completion == EOS
    eos_idx = torch.full((len(ids),), COMPLETION, dtype=torch.long)
    eos_idx[is_eos.any(1)] = is_eos.int().argmax(1)[is_eos.any(1)]
    completion_mask = (torch.arange(COMPLETION) <= eos_idx[:, None]).long()
    completion = completion.masked_fill(completion_mask == 0, PAD)
    return completion, completion_mask, is_eos.any(1)


def logits_of(out) -> torch.Tensor:
    """A causal LM's logits (``CausalLMOutputWithPast.logits``) or a wrapper's tensor."""
    return out if isinstance(out, torch.Tensor) else out.logits


def per_token_logps(logits, input_ids, logits_to_keep: int, temperature: float = 1.0):
    """TRL's ``_get_per_token_logps``: drop the last logit (it predicts past the end), keep the
    completion's, log-softmax and gather at the next tokens."""
    logits = logits[:, :-1][:, -logits_to_keep:] / temperature
    labels = input_ids[:, -logits_to_keep:]
    logps = logits.float().log_softmax(-1)
    return torch.gather(logps, 2, labels.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """verl's ``entropy_from_logits``: logsumexp minus the expected logit."""
    pd = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)


def group_advantages(rewards: torch.Tensor, group: int, eps: float | None = 1e-4):
    """GRPO's advantages: each completion's reward against its group's mean and std."""
    mean = rewards.view(-1, group).mean(1).repeat_interleave(group)
    std = rewards.view(-1, group).std(1).repeat_interleave(group)
    if eps is None:
        return (rewards - mean) / std  # the bug: no eps, 0/0 for a group of equal rewards
    return (rewards - mean) / (std + eps)


def grpo_loss(logits, input_ids, completion_mask, old_logps, ref_logps, advantages,
              beta: float = 0.04, eps_clip: float = 0.2, loss_type: str = "grpo",
              entropy_coeff: float = 0.0):
    """TRL's ``GRPOTrainer.compute_loss``: the clipped ratio of new to old log-probabilities,
    the k3 KL estimator to the reference, normalised per sequence (``grpo``), over the batch's
    tokens (``bnpo``) or by a constant (``dr_grpo``)."""
    logps = per_token_logps(logits, input_ids, completion_mask.shape[1])
    kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
    coef_1 = torch.exp(logps - old_logps)
    coef_2 = torch.clamp(coef_1, 1 - eps_clip, 1 + eps_clip)
    adv = advantages.unsqueeze(1)
    per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv) + beta * kl
    if entropy_coeff:  # verl's entropy bonus, over the completion's logits
        logits = logits[:, :-1][:, -completion_mask.shape[1]:].float()
        per_token_loss = per_token_loss - entropy_coeff * entropy_from_logits(logits)
    m = completion_mask.float()
    if loss_type == "grpo":
        return ((per_token_loss * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "grpo_unclamped":  # TRL < 0.15: 0/0 in a row whose completion is masked
        return ((per_token_loss * m).sum(-1) / m.sum(-1)).mean()
    if loss_type == "bnpo_unclamped":
        return (per_token_loss * m).sum() / m.sum()  # the bug: 0/0 when every completion is empty
    return (per_token_loss * m).sum() / (m.shape[0] * m.shape[1])


# ---------------------------------------------------------------------------------------------
# reward model and value head


class RewardModel(nn.Module):
    """``AutoModelForSequenceClassification`` with one label, as TRL's RewardTrainer trains it:
    the score at each sequence's last non-padding token."""

    def __init__(self):
        super().__init__()
        from transformers import LlamaForSequenceClassification

        torch.manual_seed(0)
        base = tiny_llama()
        cfg = base.config
        cfg.num_labels = 1
        self.rm = LlamaForSequenceClassification(cfg)

    def forward(self, input_ids, attention_mask):
        return self.rm(input_ids, attention_mask=attention_mask).logits.squeeze(-1)


def make_reward_model() -> RewardModel:
    return RewardModel()


def bradley_terry(r_chosen, r_rejected, margin=None, naive: bool = False):
    """TRL's RewardTrainer loss; ``naive`` writes it as ``-log(sigmoid(.))`` by hand."""
    diff = r_chosen - r_rejected
    if margin is not None:
        diff = diff - margin
    if naive:
        return -torch.log(torch.sigmoid(diff)).mean()  # the bug: sigmoid underflows to 0
    return -F.logsigmoid(diff).mean()


class PolicyWithValue(nn.Module):
    """TRL's ``AutoModelForCausalLMWithValueHead``: the LM and a scalar head on the last hidden
    state (dropout before the head, as TRL's ``ValueHead``)."""

    def __init__(self):
        super().__init__()
        self.lm = tiny_llama()
        self.v_head = nn.Sequential(nn.Dropout(0.1), nn.Linear(self.lm.config.hidden_size, 1))

    def forward(self, input_ids, attention_mask, position_ids):
        out = self.lm(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      output_hidden_states=True)
        return out.logits, self.v_head(out.hidden_states[-1]).squeeze(-1)


def make_policy_with_value() -> PolicyWithValue:
    return PolicyWithValue()


def masked_mean(x, mask, dim=None):
    if dim is None:
        return (x * mask).sum() / mask.sum()
    return (x * mask).sum(dim) / mask.sum(dim)


def ppo_loss(out, input_ids, mask, old_logps, old_values, advantages, returns,
             clip: float = 0.2, clip_v: float = 0.2, vf_coef: float = 0.1):
    """TRL's ``PPOTrainer`` minibatch loss: clipped policy surrogate, clipped value loss."""
    logits, values = out
    n = mask.shape[1]
    logps = per_token_logps(logits, input_ids, n)
    values = values[:, :-1][:, -n:]
    vclipped = old_values + torch.clamp(values - old_values, -clip_v, clip_v)
    vf = 0.5 * masked_mean(torch.max((values - returns) ** 2, (vclipped - returns) ** 2), mask)
    ratio = torch.exp(logps - old_logps)
    pg = torch.max(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - clip, 1 + clip))
    return masked_mean(pg, mask) + vf_coef * vf


REAL_VOCAB = VOCAB - 6  # the tokenizer's tokens; the embedding is padded to a multiple of 8


class MaskedVocabPolicy(nn.Module):
    """A policy whose embedding is padded past the tokenizer's vocabulary (Qwen's, to a
    multiple of 128): the padded ids' logits are set to ``-inf`` in ``forward`` so they are
    never sampled and take no probability (an intended -inf in every output)."""

    def __init__(self, forbid_pad: bool = False):
        super().__init__()
        self.lm = tiny_llama()
        invalid = torch.arange(VOCAB) >= REAL_VOCAB
        invalid[PAD] = forbid_pad  # (never generate padding: but padding's labels are PAD)
        self.register_buffer("invalid", invalid, persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        logits = self.lm(input_ids, attention_mask=attention_mask,
                         position_ids=position_ids).logits
        return logits.masked_fill(self.invalid, float("-inf"))


def make_masked_vocab_policy() -> MaskedVocabPolicy:
    return MaskedVocabPolicy()


def make_pad_forbidding_policy() -> MaskedVocabPolicy:
    return MaskedVocabPolicy(forbid_pad=True)


def make_checkpointed_policy() -> nn.Module:
    """The policy with activation checkpointing, as TRL's ``gradient_checkpointing=True`` and
    verl's ``enable_gradient_checkpointing`` set it (non-reentrant; older transformers call it
    ``gradient_checkpointing_enable``)."""
    policy = tiny_llama()
    policy.activation_checkpointing_enable({"use_reentrant": False})
    policy.config.use_cache = False
    return policy

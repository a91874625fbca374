"""End to end: RL post-training of a tiny Llama as TRL's GRPOTrainer / PPOTrainer write it
(``llm_rl_models``): left-padded prompts with ``attention_mask`` and ``position_ids``, sampled
completions with a completion mask, several optimisation iterations over one rollout in
micro-batches of gradient accumulation, clip_grad_norm_, AdamW with a cosine warmup."""

from __future__ import annotations

import copy

import llm_rl_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from transformers import get_cosine_schedule_with_warmup

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

P, G = 3, 4  # prompts a rollout, completions a prompt (num_generations)
MODELS = "llm_rl_models.py"


def equal_rewards(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """Every completion of ``group`` gets the same reward (all solved the task)."""
    rewards = rewards.clone()
    rewards[group * G:(group + 1) * G] = 1.0
    return rewards


def train_grpo(out_dir, steps: int, record: bool = True, factory: str = "make_policy",
               plants=None, loss_type: str = "grpo", bf16: bool = False, iterations: int = 2,
               accum: int = 2, seen=None, entropy_coeff: float = 0.0, **rec_kw):
    """``plants[step]``: what goes wrong at that generation step (``eos_boost`` added to EOS's
    logit, ``mask_truncated``: TRL's mask_truncated_completions, ``equal_group``: that group's
    completions all earn reward 1 and the advantages drop their eps). ``seen`` collects each
    rollout's ``finished`` rows and completion mask."""
    policy = getattr(M, factory)()
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    sched = get_cosine_schedule_with_warmup(opt, 2, steps * iterations)
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(policy, opt, loss_fn=M.grpo_loss, out_dir=out_dir,
                         factory=f"llm_rl_models:{factory}", **rec_kw) if record else None
    loss_fn = rec.attach().loss_fn if rec else M.grpo_loss
    try:
        for step in range(steps):
            plant = (plants or {}).get(step, {})
            p_ids, p_mask = (t.repeat_interleave(G, 0) for t in M.prompts(g, P))
            c_ids, c_mask, finished = M.sample(policy, p_ids, p_mask, g,
                                               eos_boost=plant.get("eos_boost", 0.0))
            if seen is not None:
                seen.append({"finished": finished, "mask": c_mask})
            rewards = ((c_ids >= 3) & (c_ids < 20)).float().mean(1)
            if plant.get("mask_truncated"):  # TRL's mask_truncated_completions=True
                c_mask = c_mask * finished[:, None]
            ids, am = torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1)
            pos = M.positions(am)
            with torch.no_grad():
                old = M.per_token_logps(M.logits_of(policy(ids, attention_mask=am,
                                                           position_ids=pos)), ids, M.COMPLETION)
                ref_logps = M.per_token_logps(M.logits_of(ref(ids, attention_mask=am,
                                                              position_ids=pos)), ids,
                                              M.COMPLETION)
            if "equal_group" in plant:
                rewards = equal_rewards(rewards, plant["equal_group"])
            adv = M.group_advantages(rewards, G, eps=None if "equal_group" in plant else 1e-4)
            mb = len(ids) // accum
            for _ in range(iterations):
                for k in range(accum):
                    s = slice(k * mb, (k + 1) * mb)
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                        logits = M.logits_of(policy(ids[s], attention_mask=am[s],
                                                    position_ids=pos[s]))
                    loss = loss_fn(logits, ids[s], c_mask[s], old[s], ref_logps[s], adv[s],
                                   loss_type=loss_type, entropy_coeff=entropy_coeff) / accum
                    loss.backward()
                torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad()
    finally:
        if rec:
            rec.detach()
    return policy


def raised(fn, *args, **kw) -> NonFiniteError:
    with pytest.raises(NonFiniteError) as info:
        fn(*args, **kw)
    return info.value


def same_weights(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                  b.state_dict().values()))


def test_grpo_group_of_equal_rewards_without_eps_names_that_groups_rows(tmp_path):
    """Generation step 2's second group all earn reward 1: std 0, and the advantages computed
    without eps are 0/0. The NaN reaches the loss as its ``advantages`` argument at the first
    optimizer step of that rollout (2 iterations a rollout: step 4), in micro-batch 0, whose
    rows 4 and 5 are that group's (6-7 are in micro-batch 1)."""
    err = raised(train_grpo, tmp_path, 4, plants={2: {"equal_group": 1}})
    ev = err.event
    assert (ev["step"], ev["phase"], ev["micro_batch"]) == (4, "input", 0), ev
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["samples"]) == (True, "input", [4, 5]), rep
    assert rep["hint"].startswith("loss_args[5] (advantages) is an argument of the loss"), rep["hint"]
    assert rep["event"]["tensor"] == "loss_args[5]"


def test_grpo_sequence_mean_of_a_truncated_completion_is_0_by_0_in_its_row(tmp_path):
    """TRL before 0.15 divided each row's token sum by ``completion_mask.sum(1)`` unclamped;
    with mask_truncated_completions a completion that never sampled EOS has a mask of 0s:
    0/0 in that row at the first step after that rollout (generation step 1: step 2)."""
    seen = []
    err = raised(train_grpo, tmp_path, 3, plants={1: {"mask_truncated": True, "eos_boost": 2.0}},
                 loss_type="grpo_unclamped", seen=seen)
    assert (err.event["step"], err.event["phase"], err.event["micro_batch"]) == (2, "loss", 0)
    truncated = [i for i in range(P * G // 2) if not seen[1]["finished"][i]]
    assert 0 < len(truncated) < P * G // 2, seen[1]  # (some rows, not all: a row is named)
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["op"], o["module"], o["samples"]) == (
        "invalid", "aten.div", "<loss>", truncated), rep
    assert o["source"] == source_line(MODELS, "/ m.sum(-1)).mean()")


def test_grpo_token_level_mean_of_a_batch_of_empty_completions_names_no_row(tmp_path):
    """bnpo's ``sum / completion_mask.sum()`` over a micro-batch whose every completion ran
    out of tokens without EOS (masked away): 0/0 of the 0-d divisor, no row to blame."""
    err = raised(train_grpo, tmp_path, 3, loss_type="bnpo_unclamped",
                 plants={1: {"mask_truncated": True, "eos_boost": -100.0}})
    assert (err.event["step"], err.event["phase"], err.event["micro_batch"]) == (2, "loss", 0)
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["op"], o["samples"]) == ("invalid", "aten.div", []), rep
    assert o["source"] == source_line(MODELS, "/ m.sum()  # the bug")
    assert "one 0-d value for every element" in rep["hint"], rep["hint"]


def test_padded_vocabulary_mask_reaching_the_output_is_the_roots_own_fill(tmp_path):
    """A policy masking its padded vocabulary's logits with -inf after the LM returned: the
    report named the fill's op and line but the module of the first -inf fill inside the
    call (``lm.model.layers.0.self_attn``), which never ran that line."""
    err = raised(train_grpo, tmp_path, 1, factory="make_masked_vocab_policy")
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (0, "forward", "")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "", "aten.masked_fill", "-inf", list(range(P * G // 2))), rep
    assert o["source"] == source_line(MODELS, 'masked_fill(self.invalid, float("-inf"))')
    assert any("allow_inf=['']" in p for p in rep["problems"]), rep["problems"]


def test_healthy_bf16_grpo_with_an_allowed_vocabulary_mask_raises_nothing(tmp_path):
    """Left padding's masked attention, the rollout's -inf on PAD, the policy's -inf logits
    (allowed): no event, and the weights are those of the run without the recorder."""
    kw = {"factory": "make_masked_vocab_policy", "bf16": True}
    recorded = train_grpo(tmp_path, 3, allow_inf=[""], **kw)
    assert not list(tmp_path.glob("*.nan"))
    assert same_weights(recorded, train_grpo(tmp_path, 3, record=False, **kw))


def gae(old_logps, ref_logps, old_values, score, mask, kl_coef=0.05, gamma=1.0, lam=0.95):
    """TRL's PPOTrainer: per-token rewards (KL penalty, the score at the last token), GAE,
    advantages whitened over the valid tokens."""
    r = -kl_coef * (old_logps - ref_logps)
    r[torch.arange(len(r)), mask.cumsum(-1).argmax(-1)] += score
    adv, last = torch.zeros_like(r), torch.zeros(len(r))
    for t in reversed(range(r.shape[1])):
        nxt = old_values[:, t + 1] if t + 1 < r.shape[1] else torch.zeros(len(r))
        last = r[:, t] + gamma * nxt - old_values[:, t] + gamma * lam * last
        adv[:, t] = last
    returns = adv + old_values
    mean = M.masked_mean(adv, mask)
    var = M.masked_mean((adv - mean) ** 2, mask)
    return (adv - mean) * torch.rsqrt(var + 1e-8) * mask, returns


def train_ppo(out_dir, rollouts: int, record: bool = True, epochs: int = 2, minibatches: int = 2,
              accum: int = 2, stale=None, bf16: bool = False, sentinel: float = -9999.0):
    """PPO epochs over each rollout of 8 prompts, shuffled into mini-batches of ``accum``
    micro-batches each; ``stale = (rollout, epoch, minibatch, micro-batch)``: there the first
    row's first old log-probability is the rollout engine's sentinel -9999."""
    torch.manual_seed(1)  # (the value head's dropout)
    model = M.make_policy_with_value()
    ref = copy.deepcopy(model.lm).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    sched = get_cosine_schedule_with_warmup(opt, 1, rollouts * epochs * minibatches)
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=M.ppo_loss, out_dir=out_dir,
                         factory="llm_rl_models:make_policy_with_value") if record else None
    loss_fn = rec.attach().loss_fn if rec else M.ppo_loss
    try:
        for it in range(rollouts):
            p_ids, p_mask = M.prompts(g, 8)
            c_ids, c_mask, _ = M.sample(model.lm, p_ids, p_mask, g)
            ids, am = torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1)
            pos, mask = M.positions(am), c_mask.float()
            with torch.no_grad():
                logits, values = model.eval()(ids, am, pos)
                model.train()
                old = M.per_token_logps(logits, ids, M.COMPLETION)
                ref_logps = M.per_token_logps(ref(ids, attention_mask=am,
                                                  position_ids=pos).logits, ids, M.COMPLETION)
                old_v = values[:, :-1][:, -M.COMPLETION:]
                score = ((c_ids >= 3) & (c_ids < 20) & (c_mask == 1)).float().sum(1)
                adv, returns = gae(old, ref_logps, old_v, score, mask)
            for ep in range(epochs):
                perm = torch.randperm(len(ids), generator=g)
                for j, mb in enumerate(perm.chunk(minibatches)):
                    for k, c in enumerate(mb.chunk(accum)):
                        o = old[c]
                        if stale == (it, ep, j, k):
                            o = o.clone()
                            o[0, 0] = sentinel
                        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                            out = model(ids[c], am[c], pos[c])
                        loss = loss_fn(out, ids[c], mask[c], o, old_v[c], adv[c],
                                       returns[c]) / accum
                        loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                    sched.step()
                    opt.zero_grad()
    finally:
        if rec:
            rec.detach()
    return model


def test_ppo_sentinel_old_logprob_overflows_the_ratio_in_the_second_epoch(tmp_path):
    """Rollout 1, PPO epoch 1, mini-batch 0, micro-batch 1: 4 optimizer steps a rollout, so
    step 4 + 2 = 6. ``exp(logp + 9999)`` is beyond float64 too: an overflow, the row named,
    and no advice to compute it in float64."""
    err = raised(train_ppo, tmp_path, 2, stale=(1, 1, 0, 1))
    assert (err.event["step"], err.event["phase"], err.event["micro_batch"]) == (6, "loss", 1)
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["op"], o["made"], o["samples"], o["micro_batch"]) == (
        "overflow", "aten.exp", "+inf", [0], 1), rep
    assert o["source"] == source_line(MODELS, "ratio = torch.exp(logps - old_logps)")
    assert "float64 holds it" not in rep["hint"], rep["hint"]


def test_healthy_bf16_ppo_with_value_head_dropout_raises_nothing(tmp_path):
    recorded = train_ppo(tmp_path, 2, bf16=True)
    assert not list(tmp_path.glob("*.nan"))
    assert same_weights(recorded, train_ppo(tmp_path, 2, record=False, bf16=True))


def test_pad_labels_under_a_policy_forbidding_pad_name_every_infinite_argument(tmp_path):
    """The policy forbids PAD with -inf logits (allowed), but the padding after EOS is
    labelled PAD: every log-probability gathered there is -inf, the old, the reference and the
    new ones. The recorder names the first loss argument holding one (``old_logps``); the NaN is
    made by the KL's ``ref_logps - logps``, which never reads it: the hint said "made NaN of
    it"; it now names each argument holding -inf, by its parameter name."""
    seen = []
    err = raised(train_grpo, tmp_path, 1, factory="make_pad_forbidding_policy", seen=seen,
                 allow_inf=[""])
    ev = err.event
    assert (ev["step"], ev["phase"], ev["tensor"], ev["kind"]) == (0, "input", "loss_args[3]",
                                                                   "-inf"), ev
    padded = [i for i in range(P * G // 2) if not bool(seen[0]["mask"][i].all())]
    rep = nanreplay_json(err.bundle_path)
    assert (rep["cause"], rep["origin"]["samples"]) == ("input", padded), rep
    assert rep["hint"].startswith(
        "loss_args[3] (old_logps) holds -inf and no NaN (as do loss_args[0] (logits) and "
        "loss_args[4] (ref_logps)), and the loss made NaN of infinities: aten.sub ("
        + source_line(MODELS, "kl = torch.exp(ref_logps - logps)")), rep["hint"]


def preference_pairs(n: int, g: torch.Generator):
    """Prompt + chosen and prompt + rejected ids (left-padded prompts, 4-token answers; the
    chosen ones start with token 5) and the rating gap of each pair (UltraFeedback's scores)."""
    p_ids, p_mask = M.prompts(g, n)
    chosen = torch.randint(3, M.VOCAB, (n, 4), generator=g)
    rejected = torch.randint(3, M.VOCAB, (n, 4), generator=g)
    chosen[:, 0], rejected[:, 0] = 5, 30
    ones = torch.ones(n, 4, dtype=torch.long)
    margin = torch.randint(1, 4, (n,), generator=g).float()
    return (torch.cat([p_ids, chosen], 1), torch.cat([p_mask, ones], 1),
            torch.cat([p_ids, rejected], 1), torch.cat([p_mask, ones], 1), margin)


def train_reward_model(out_dir, epochs: int, record: bool = True, unrated=None,
                       bf16: bool = False):
    """TRL's RewardTrainer: chosen and rejected scored in one concatenated batch, the margin
    subtracted (``-logsigmoid(r_c - r_r - margin)``); ``unrated``: that pair's rating is
    missing, NaN in the dataset. Returns the model and the order the loader drew."""
    model = M.make_reward_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    data = preference_pairs(24, g)
    if unrated is not None:
        data[-1][unrated] = float("nan")
    order = []
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.arange(24), *data), batch_size=8, shuffle=True,
        generator=g)
    rec = FlightRecorder(model, opt, loss_fn=M.bradley_terry, out_dir=out_dir,
                         factory="llm_rl_models:make_reward_model") if record else None
    loss_fn = rec.attach().loss_fn if rec else M.bradley_terry
    try:
        for _ in range(epochs):
            for idx, c_ids, c_mask, r_ids, r_mask, margin in loader:
                order.append(idx)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    rewards = model(torch.cat([c_ids, r_ids]), torch.cat([c_mask, r_mask]))
                n = len(c_ids)
                loss = loss_fn(rewards[:n].float(), rewards[n:].float(), margin)
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
    finally:
        if rec:
            rec.detach()
    return model, order


def test_reward_model_pair_without_rating_names_its_rows_in_the_shuffled_batch(tmp_path):
    """A pair whose rating is missing (NaN margin, 8 values for the 16 rows of chosen then
    rejected answers): the event names no samples ("not per sample"), and the replay said it
    was a shared argument such as a class weight; one backward of the loss names the pair's two
    rows, where the loader's shuffle put record 13 (and ``--try auto`` proposes no drop: the
    margin would keep its row, and that re-run raised)."""
    with pytest.raises(NonFiniteError) as info:
        train_reward_model(tmp_path, 2, unrated=13)
    err = info.value
    step = err.event["step"]
    _, order = train_reward_model(tmp_path / "clean", 2, record=False)
    row = order[step].tolist().index(13)
    assert step == next(i for i, idx in enumerate(order) if 13 in idx.tolist())
    assert (err.event["phase"], err.event["tensor"]) == ("input", "loss_args[2]"), err.event
    rep = nanreplay_json(err.bundle_path, "--try", "auto")
    assert (rep["cause"], rep["origin"]["samples"]) == ("input", [row, row + 8]), rep
    # (no drop=ROW,ROW+8: the margin keeps its 8 values, and that re-run raised)
    assert rep["what_if"] == [], rep["what_if"]
    assert rep["hint"].startswith(
        "loss_args[2] (shape (8,)) has no row per sample of the model's 16-row batch, but its "
        f"NaN reaches the gradient of the model output in rows [{row}, {row + 8}] only"), rep


def test_healthy_bf16_reward_model_raises_nothing(tmp_path):
    recorded, _ = train_reward_model(tmp_path, 1, bf16=True)
    assert not list(tmp_path.glob("*.nan"))
    assert same_weights(recorded, train_reward_model(tmp_path, 1, record=False, bf16=True)[0])


def test_entropy_bonus_over_masked_vocabulary_logits_is_0_times_inf(tmp_path):
    """verl's ``entropy_from_logits`` (``sum(softmax * logits)``) over a policy's -inf logits of
    its padded vocabulary (allowed): 0 * -inf in every row; the product and the mask named."""
    err = raised(train_grpo, tmp_path, 1, factory="make_masked_vocab_policy", allow_inf=[""],
                 entropy_coeff=0.01)
    assert (err.event["step"], err.event["phase"]) == (0, "loss")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["op"], o["samples"]) == ("invalid", "aten.mul",
                                                     list(range(P * G // 2))), rep
    assert o["source"] == source_line(MODELS, "torch.sum(pd * logits, dim=-1)")
    assert "0 * inf" in rep["hint"] and "torch.finfo(dtype).min" in rep["hint"], rep["hint"]


def test_healthy_grpo_with_activation_checkpointing_raises_nothing(tmp_path):
    """Non-reentrant checkpointing re-runs each decoder layer in the backward, hooks and all:
    no event, no change to the training."""
    recorded = train_grpo(tmp_path, 2, factory="make_checkpointed_policy", bf16=True)
    assert not list(tmp_path.glob("*.nan"))
    assert same_weights(recorded, train_grpo(tmp_path, 2, factory="make_checkpointed_policy",
                                             bf16=True, record=False))

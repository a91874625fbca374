"""End to end: preference fine-tuning of a tiny GPT-2 as TRL-style code writes it by hand
(``zh_models``): DPO over one concatenated batch of chosen then rejected completions, whose
log-probabilities are averaged over each completion's valid tokens, and RLHF's PPO with a
value head. A rejected completion with no valid token (an answer filtered to nothing) makes
0/0 in the average; the DPO margin pairs that row with its chosen row, so dropping the named
row alone leaves the halves unequal: ``--try auto`` must drop the pair."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import zh_models as Z
from bundles import invoke_cli

from recorder import FlightRecorder, NonFiniteError

B = 4  # preference pairs a batch: rows 0-3 chosen, 4-7 rejected


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def train_dpo(out_dir, steps: int, empty_at: int | None = None, bf16: bool = False):
    policy = Z.make_policy()
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    opt = torch.optim.AdamW(policy.parameters(), lr=5e-4)
    g = torch.Generator().manual_seed(0)
    with FlightRecorder(policy, opt, loss_fn=Z.dpo_from_logits, out_dir=out_dir,
                        factory="zh_models:make_policy") as rec:
        for step in range(steps):
            b = Z.pairs(g, B, empty_rejected=2 if step == empty_at else None)
            ids, mask = b["input_ids"], b["completion_mask"]
            with torch.no_grad():
                ref_logits = ref(ids).logits
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = policy(ids).logits
            loss = rec.loss_fn(logits, ref_logits.float(), ids, mask)
            opt.zero_grad()
            loss.backward()
            opt.step()


def test_dpo_empty_completion_names_the_row_and_drops_its_pair(tmp_path):
    with pytest.raises(NonFiniteError) as info:
        train_dpo(tmp_path, 6, empty_at=3)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (3, "loss")
    r = invoke_cli(err.bundle_path, "--json", "--try", "auto")
    rep = json.loads(r.stdout)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["samples"]) == (
        True, "invalid", "aten.div", [B + 2]), json.dumps(rep, indent=1)
    assert o["source"].startswith("zh_models.py:") and "/ m.sum(-1)" in \
        rep["source_lines"][o["source"]]
    assert o["coupled"] == [2, B + 2]  # the chosen row of the same pair
    (tried,) = rep["what_if"]
    assert (tried["try"], tried["finite"]) == ("drop=2,6", True), tried  # (was drop=6: raised)
    text = invoke_cli(err.bundle_path).stdout
    assert "  coupled    [2]: the loss combines their rows" in text


def test_healthy_dpo_under_bf16_autocast_raises_nothing(tmp_path):
    train_dpo(tmp_path, 6, bf16=True)
    assert not list(tmp_path.glob("*.nan"))


def test_ppo_ratio_overflow_beyond_float64_is_not_sent_to_float64(tmp_path):
    """The rollout's old log-probabilities hold -1e9 on the padding (a "masked" value where
    TRL writes INVALID_LOGPROB = 1.0): exp(logp - old) is e^1e9, beyond float64 too, and the
    masked mean's inf * 0 makes NaN. ``--try auto`` proposed ``dtype=float64``, whose re-run
    was NaN again, beside a hint saying float64 overflows too."""
    policy = Z.make_policy()
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(policy, opt, loss_fn=Z.ppo_loss, out_dir=tmp_path,
                            factory="zh_models:make_policy") as rec:
            for update in range(3):
                b = Z.pairs(g, B)
                ids, mask = b["input_ids"], b["completion_mask"][:, 1:].float()
                with torch.no_grad():
                    old = Z.token_logps(policy(ids).logits, ids)
                    if update == 2:
                        old = old.masked_fill(mask == 0, -1e9)
                    score = torch.randn(len(ids), generator=g)
                    adv = ((score - score.mean()) / (score.std() + 1e-8))[:, None]
                for _ in range(2):  # PPO epochs over the rollout
                    loss = rec.loss_fn(policy(ids).logits, ids, old, adv.expand_as(old), mask)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (4, "loss")
    rep = json.loads(invoke_cli(err.bundle_path, "--json", "--try", "auto").stdout)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["made"]) == (
        True, "overflow", "aten.exp", "+inf"), json.dumps(rep, indent=1)
    assert "holds -1e+09 at the 46 entries that overflowed" in rep["hint"], rep["hint"]
    assert "for float64 as well" in rep["hint"], rep["hint"]
    assert rep["what_if"] == [], rep["what_if"]  # (was dtype=float64: nan again)


def test_healthy_rlhf_ppo_with_value_head_raises_nothing(tmp_path):
    """PPO as TRL's trainer runs it: KL penalty to a frozen reference in the per-token
    rewards, GAE, advantages whitened over the batch's valid tokens, clipped value loss."""
    model = Z.make_value_lm()
    ref = copy.deepcopy(model.lm).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    with FlightRecorder(model, opt, loss_fn=Z.rlhf_ppo_loss, out_dir=tmp_path,
                        factory="zh_models:make_value_lm") as rec:
        for _ in range(3):
            b = Z.pairs(g, B)
            ids, mask = b["input_ids"], b["completion_mask"][:, 1:].float()
            with torch.no_grad():
                logits, values = model(ids)
                old = Z.token_logps(logits, ids)
                ref_logps = Z.token_logps(ref(ids).logits, ids)
                score = torch.randn(len(ids), generator=g)
            for _ in range(2):
                loss = rec.loss_fn(model(ids), ids, old, values[:, :-1], score, ref_logps, mask)
                opt.zero_grad()
                loss.backward()
                opt.step()
    assert not list(tmp_path.glob("*.nan"))

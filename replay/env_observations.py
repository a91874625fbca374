"""An input event of a network recorded through stable-baselines3's callback
(``recorder.sb3``): the batch is the observations an env returned, either as the rollout's
forward took them (gradients off; one row per env of the ``VecEnv``) or as an update sampled
them from the replay buffer (one row per stored transition). A NaN or +-Inf there is the env's
own (a sensor's dropped reading, a simulator that diverged, a division in the env's observation
code), not a table's missing value to impute: the fix is in the env, and SB3's ``VecCheckNan``
finds the env step that made it.
"""

from __future__ import annotations

import torch

from .missing_entries import entries_where

ENV_OBSERVATION = (
    "the batch itself holds {kind}: it is the observations the env returned ({where}), "
    "{rows}; the env made that value (a sensor's dropped reading, a simulator that diverged, "
    "a division in its observation code): fix the env's step()/reset(), or wrap it as "
    "VecCheckNan(venv, raise_exception=True) to stop at the env step that returns it; "
    "VecNormalize does not repair it (its running mean and variance take the NaN in)")

ROLLOUT_ROWS = "in a rollout's forward (gradients off), one row per env of the VecEnv"
UPDATE_ROWS = "in an update, rows of the batch sampled from the replay buffer"


def observation_path(tensor: str) -> bool:
    """Whether the readable path ``tensor`` is the root call's first argument, where SB3's
    networks take the observation (``batch``, ``args[0]``, a dict observation's
    ``batch["image"]``), not a critic's actions (``args[1]``)."""
    return tensor in ("batch", "args[0]") or tensor.startswith(("batch[", "args[0]["))


def env_observation_hint(step, t: torch.Tensor | None, made: str | None,
                         tensor: str = "batch") -> str | None:
    """The hint of an input event whose batch tensor ``t`` (at ``tensor``) an SB3 env made;
    None when the bundle was not recorded through the SB3 callback, ``t`` is no observation or
    holds nothing non-finite."""
    if (step.meta.get("recorder") or {}).get("integration") != "sb3" or t is None \
            or not observation_path(tensor) \
            or not t.is_floating_point() or bool(torch.isfinite(t).all()):
        return None
    bad = ~torch.isfinite(t.detach())
    where = entries_where(bad.reshape(bad.shape[0], -1)) if t.dim() >= 2 \
        else "samples " + ", ".join(map(str, bad.nonzero().flatten().tolist()[:8]))
    rows = ROLLOUT_ROWS if step.event.get("evaluation") else UPDATE_ROWS
    kind = {"nan": "NaN", "inf": "+Inf", "+inf": "+Inf", "-inf": "-Inf"}.get(made or "", "NaN/Inf")
    return ENV_OBSERVATION.format(kind=kind, where=where, rows=rows)

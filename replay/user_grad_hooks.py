"""Gradient hooks the training code registered on the parameters (``recorder.user_hooks``'s
description in the bundle), which the factory's model lacks, named where they explain an event.

- A backward event whose recorded gradient is non-finite where the re-run's, finite, is 0 (a
  tensor hook's per-row normalisation ``g / g.norm(dim=1, keepdim=True)``: an embedding row no
  sample looked up, a dead unit's row): the hook's 0/0 (cause ``invalid``), named by its line,
  with the rows; the replay cannot run the hook, a bundle holds no code.
- A ``weights`` event of parameters that a post-accumulate-grad hook updates in backward (the
  'optimizer step in backward' tutorial: one optimizer per parameter, stepped as its gradient
  is accumulated): the update ran inside backward, before any check of the step; the
  optimizer's class and settings as the hook's closure holds them (Adam's ``eps=0``).
"""

from __future__ import annotations

from typing import Any

import torch

from .compat import grad_hooks
from .load import Step

ZERO_EPS = ("eps", "epsilon")
STEPPED = "inside backward, from a post-accumulate-grad hook it registered"
EPS0 = "with eps=0"


def script_hooks(step: Step, name: str | None, kind: str) -> list[dict]:
    """The bundle's descriptions of ``name``'s hooks of ``kind`` (``tensor``,
    ``post_accumulate``)."""
    hooks = (step.meta.get("user_grad_hooks") or {}).get(name or "", [])
    return [h for h in hooks if h.get("kind") == kind]


def where(hook: dict) -> str:
    """``NAME (FILE:LINE: `TEXT`)``, as much of it as the bundle holds."""
    name = hook.get("name", "a hook").replace(".<locals>", "")
    if "source" not in hook:
        return name
    return f"{name} ({hook['source']}" + (f": `{hook['line']}`)" if hook.get("line") else ")")


def set_source(report: dict[str, Any], hook: dict) -> None:
    """The hook's line as the origin's source (its text as the bundle holds it)."""
    if src := hook.get("source"):
        report["origin"]["source"] = src
        report["source_lines"] = {src: hook["line"]} if hook.get("line") else {}


def hooked_gradient(report: dict[str, Any], step: Step, runner, params: list[str]) -> bool:
    """Name a tensor hook of the script's on ``params[0]`` as what made its gradient
    non-finite, where the re-run (without the hook) makes it finite; True when it did."""
    name = params[0] if params and runner is not None else None
    hooks = [h for h in script_hooks(step, name, "tensor")
             if h.get("returns", True)]  # (one returning nothing only reads the gradient)
    recorded = step.tensors.get(f"grads/{name}")
    if not hooks or recorded is None or not recorded.is_floating_point():
        return False
    runner.run(instrument=False)
    p = dict(runner.model.named_parameters()).get(name)
    if p is None or len(grad_hooks(p)) >= len(hooks):
        return False  # (the factory registers them too: the re-run ran them)
    g = p.grad
    if g is None or g.shape != recorded.shape or not bool(torch.isfinite(g).all()):
        return False
    bad = ~torch.isfinite(recorded)
    zero = bool((g[bad] == 0).all())
    rows = bad.reshape(bad.shape[0], -1).any(1).nonzero().flatten().tolist() \
        if bad.dim() >= 2 else []
    shown = f" in row(s) {rows[:8]}{' ...' if len(rows) > 8 else ''} of {bad.shape[0]}" \
        if rows else ""
    said = ", ".join(where(h) for h in hooks)
    text = (f"{name}'s gradient went through a hook the training code registered on it, "
            f"{said}, which the factory's model does not register, so the re-run's backward "
            f"did not run it: the re-run's gradient is finite, and at the {int(bad.sum())} "
            f"entries{shown} where the recorded one is non-finite it is ")
    if zero:
        report["cause"] = "invalid"
        report["hint"] = text + (
            "exactly 0: the hook divided a gradient of 0 by its norm (or sum), 0 too (0/0: an "
            "embedding row no sample of the batch looked up, a unit dead for the whole "
            "batch); floor the hook's divisor (g.norm(dim=1, keepdim=True).clamp_min(eps)) "
            "or leave rows of norm 0 as they are, and register the hook where the factory "
            "builds the model so that nanreplay runs it")
    else:
        report["hint"] = text + (
            "nonzero at some: the hook's arithmetic made them (a division by a value of the "
            "gradient at 0, an overflow); register the hook where the factory builds the "
            "model so that nanreplay re-runs it and names the op")
    if rows:
        report["origin"]["rows"] = rows
    set_source(report, hooks[0])
    return True


def updated_in_backward(step: Step, params: list[str]) -> str:
    """The hint for weights already non-finite as the step began whose parameters a hook of
    the script's updates in backward (``post_accumulate``), ``""`` when none does."""
    hooks = [h for n in params for h in script_hooks(step, n, "post_accumulate")]
    if not hooks or len(hooks) < len(params):
        return ""
    opts = [h["optimizer"] for h in hooks if "optimizer" in h]
    text = (f"the weights were already non-finite when step {step.event.get('step')} began, "
            f"and the loop updates {', '.join(params[:4])}{' ...' if len(params) > 4 else ''} "
            f"{STEPPED}, "
            f"{where(hooks[0])} (the optimizer step in backward: one optimizer per parameter, "
            "its gradient freed after the step): that update ran as the step before's backward "
            "accumulated each gradient, before any check of that step, and its gradient is gone")
    eps0 = [o for o in opts if any(o["settings"].get(k) == 0 for k in ZERO_EPS)]
    if opts:
        o = (eps0 or opts)[0]
        settings = ", ".join(f"{k}={v}" for k, v in o["settings"].items())
        text += f"; the hook steps {o['class']}({settings})"
    text += (f" {EPS0}: an update divides by the root of its second moment, 0 for an entry "
             "whose gradient has been 0 so far (an embedding row no batch looked up, a dead "
             "unit), 0/0; keep eps > 0 (1e-8)" if eps0 else
             ": a gradient that was already non-finite (a NaN the backward made) or the "
             "update's own arithmetic (a learning rate, a state) made them")
    if not eps0 and (tensor := [h for n in params for h in script_hooks(step, n, "tensor")
                                if h.get("returns", True)]):
        text += (f"; before that update each gradient went through a tensor hook the script "
                 f"registered, {where(tensor[0])}: check it (a division by a norm that is 0)")
    return text + ("; the recorder sees such an update only at the next step: to stop before "
                   "it, check the gradient in the hook before stepping (skip the step unless "
                   "torch.isfinite(p.grad).all())")


def in_backward(hint: str | None) -> bool:
    """Whether a weights event's hint is :func:`updated_in_backward`'s with an optimizer
    setting that makes the update itself non-finite (``eps=0``): cause ``optimizer``. Without
    one, the gradient it took may have been non-finite already (the cause stays ``weights``)."""
    return bool(hint) and STEPPED in hint and f" {EPS0}: " in hint


def stepping_hook(step: Step, params: list[str]) -> dict | None:
    """The post-accumulate-grad hook of the script's that updates the first of ``params``
    that has one (the optimizer step in backward), None when none does."""
    return next((h for n in params for h in script_hooks(step, n, "post_accumulate")), None)

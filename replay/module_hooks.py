"""Forward hooks and pre-hooks the training code put on the model's modules
(``recorder.user_hooks``' description in the bundle), said where the re-run differs by them.

- Hooks the script registered after the factory built the model (feature noise on a layer's
  output, added mid-training; an activation capture): the factory's model lacks them, so the
  re-run computes without them. An event they made does not come back: the hint names them,
  their lines, and where to register them.
- A pre-hook on the root registered before the recorder attached (an input normalisation
  ``(x - mean) / std``): the recorder's own pre-hook ran after it, so the bundle's inputs are
  what that hook returned, not the loader's batch; an input event says so (the NaN may be the
  hook's), and a factory that registers it too applies it a second time in the re-run.
"""

from __future__ import annotations

from typing import Any

from recorder.user_hooks import user_module_hooks

from .load import Step
from .user_grad_hooks import where


def missing(step: Step, kinds=("forward_pre", "forward")) -> list[tuple[str, dict]]:
    """``(module, hook)`` of the recorded hooks of ``kinds`` the factory's model does not
    have (by name)."""
    recorded = step.meta.get("user_module_hooks") or {}
    if not recorded or step.model is None:
        return []
    modules = dict(step.model.named_modules())
    out = []
    for name, hooks in recorded.items():
        have = [h.get("name") for h in user_module_hooks(
            [(name, modules[name])]).get(name, [])] if name in modules else []
        for h in hooks:
            if h.get("kind") not in kinds:
                continue
            if h.get("name") in have:
                have.remove(h.get("name"))
            else:
                out.append((name, h))
    return out


def _said(gone: list[tuple[str, dict]]) -> str:
    return "; ".join(f"{m or '<root>'}'s {h['kind'].replace('_', ' ')} hook {where(h)}"
                     for m, h in gone[:3]) + (f" (+{len(gone) - 3} more)" if len(gone) > 3
                                              else "")


def backward_missing_text(step: Step, params: list[str]) -> str:
    """The sentence naming the module backward hooks the factory's model lacks (a
    ``register_full_backward_hook`` returning a grad_input it rewrote), which made gradients
    the re-run's backward, without them, makes finite; ``""`` when none."""
    gone = [(m, h) for m, h in missing(step, ("backward_pre", "backward"))
            if h.get("returns", True)]  # (one returning nothing only reads: a capture)
    if not gone:
        return ""
    which = f" ({', '.join(params[:4])}{' ...' if len(params) > 4 else ''})" if params else ""
    return (f"the gradients the update was about to use{which} went through module backward "
            f"hooks the training code registered, which the factory's model lacks: "
            f"{_said(gone)}; the re-run's backward ran without them and makes every gradient "
            f"finite, so a hook's arithmetic made the non-finite values ({_how(gone)}); check "
            "it, and register the hooks where the factory builds the model so that nanreplay "
            "re-runs them")


def _how(gone: list[tuple[str, dict]]) -> str:
    """What in the hooks made it: a non-finite number one read (a schedule's NaN lambda)
    where the bundle names one, else the usual division."""
    held = [v for _, h in gone for v in h.get("nonfinite", ())]
    if held:
        return (f"it held {', '.join(held)} when the event came: the number it scales the "
                "gradient by is non-finite, so look at what computes it (a schedule dividing "
                "by a total of 0)")
    return "a division by a gradient's norm that is 0"


def missing_text(step: Step, reading: bool = True) -> str:
    """The sentence naming the hooks the factory's model lacks, ``""`` when none; without
    ``reading``, only those that return a value (a hook returning nothing reads the output:
    a capture, a measurement, which matters only where the event did not come back)."""
    gone = [(m, h) for m, h in missing(step) if reading or h.get("returns", True)]
    if not gone:
        return ""
    said = _said(gone)
    return (f"the training code registered hooks that the factory's model lacks: {said}; the "
            "re-run computed without them, so what they do (noise or a transform of a layer's "
            "output, a normalisation of its input, a value captured for the loss) is not in "
            "it: register them where the factory builds the model so that nanreplay re-runs "
            "them")


def notes(step: Step, report: dict[str, Any]) -> list[str]:
    """The notes of a report on a bundle whose model carried such hooks."""
    out = []
    pre = [h for h in (step.meta.get("user_module_hooks") or {}).get("", [])
           if h.get("before_recorder")]
    if pre and (report.get("origin") or {}).get("phase") == "input":
        twice = any(h.get("name") == p.get("name") for p in pre for h in user_module_hooks(
            [("", step.model)]).get("", [])) if step.model is not None else False
        out.append(
            f"the model's inputs in the bundle are as its forward pre-hook {where(pre[0])} "
            "returned them, not as the loop passed them: it was registered before the recorder "
            "attached, so it ran first; the non-finite values may be that hook's (a "
            "normalisation dividing by a std of 0), not the data's"
            + ("; the factory's model registers it too, so a re-run applies it a second time "
               "to inputs it already transformed" if twice else ""))
    if (text := missing_text(step, reading=not report.get("reproduced"))) \
            and text not in (report.get("hint") or ""):
        out.append(text)
    return out

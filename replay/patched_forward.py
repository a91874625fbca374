"""The run's modules whose ``forward`` was patched on the instance (the bundle's ``forward``
of a module, :mod:`recorder.patched_forward`): a factory that builds the class's forward
re-runs another computation (TRL's fused LM head returns per-token log-probabilities where
the class returns logits, and the recorded gradients no longer fit its output), so the replay
stops with one line that names the patch and how to build it, instead of failing inside the
re-run or blaming a model that never ran."""

from __future__ import annotations

from typing import Any

from torch import nn

from recorder.patched_forward import patched_forward, patcher

from .errors import ReplayError


def check_patched_forwards(meta: dict[str, Any], model: nn.Module) -> None:
    """Raise :class:`ReplayError` where a recorded module ran a patched forward that the
    factory's module of that name does not run."""
    built = dict(model.named_modules())
    for info in meta.get("modules") or ():
        patch = info.get("forward") if isinstance(info, dict) else None
        m = built.get(info.get("name")) if isinstance(patch, str) else None
        if m is not None and patched_forward(m) != patch:
            raise ReplayError(unpatched(info.get("name") or "", patch))


def unpatched(name: str, patch: str) -> str:
    """The one line: which module, which patch, what to do."""
    who = f"module '{name}'" if name else "model"
    made = patcher(patch)
    how = (f"call {made}(model) in the factory before returning the model, as the run's "
           "code (its trainer) did" if made else
           f"set the model's forward to {patch} in the factory, as the run's code did")
    return (f"the run's {who} ran a forward patched onto the instance ({patch}) in place of "
            f"its class's, and the factory's model does not: a re-run would compute another "
            f"forward than training's; {how} (or pass --factory MOD:FN, a function that builds it so)")

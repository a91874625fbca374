"""A custom optimizer's settings kept outside its parameter groups (``self.clip = clip``), as
training had them: the factory that rebuilds the optimizer for the replay may build it with
others (its defaults), and the re-run then updates otherwise than training did (a block-wise
quantised Adam without its absmax clip makes NaN where training made none). Only plain
scalars the rebuilt optimizer holds too, of the same type, are set; nothing else is written
from a bundle."""

from __future__ import annotations

from typing import Any

_SCALARS = (bool, int, float, str)


def restore_attrs(opt, recorded: Any) -> list[str]:
    """Set on ``opt`` each recorded attribute whose value differs from the rebuilt one; the
    ``name: rebuilt -> training`` changes made."""
    if not isinstance(recorded, dict):
        return []
    changed = []
    own = getattr(opt, "__dict__", {})
    for k, v in recorded.items():
        if not isinstance(k, str) or not k.isidentifier() or k.startswith("_") or k not in own:
            continue
        now = own[k]
        if now == v or now != now and v != v or not (now is None or v is None or type(now) is type(v)) \
                or not (v is None or type(v) in _SCALARS):
            continue
        setattr(opt, k, v)
        changed.append(f"{k}: {now!r} -> {v!r}")
    return changed


def attrs_note(changed: list[str]) -> str:
    return ("the factory built the optimizer with other settings than training's, set back "
            f"from the bundle for the re-run ({', '.join(changed)})")

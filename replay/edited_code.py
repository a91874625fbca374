"""Code edited since the recorded run: the bundle's fingerprints of the model's classes and
the loss (``recorder.code_identity``) against the code the replay imported. A user who added
an eps after the NaN replays with the edited code: the event not coming back is then the
edit's doing (a what-if), not nondeterminism; a renamed or added module is the code's change,
not a factory called without the run's arguments. Only code the factory's import already
loaded is compared (nothing imported here); an unrelated edit (another function, a comment)
changes no fingerprint."""

from __future__ import annotations

import os
import sys
from typing import Any

from recorder.code_identity import fingerprint


def code_edits(meta: dict[str, Any]) -> list[str]:
    """What differs, one phrase each ('mymodel.Norm edited (mymodel.py)'); [] when the bundle
    holds no fingerprints (an older bundle) or nothing differs."""
    recorded = meta.get("code")
    if not isinstance(recorded, dict) or not recorded:
        return []
    out = []
    for key, rec in sorted(recorded.items()):
        if not isinstance(rec, dict):
            continue
        now = _resolve(key)
        where = f" ({_short(rec.get('file'))})" if rec.get("file") else ""
        if now is _UNKNOWN:
            continue
        if now is None:
            out.append(f"{key} is gone{where}")
        elif (digest := fingerprint(now)) is not None and digest != rec.get("hash"):
            out.append(f"{key} edited{where}")
    return out  # (a class new since the run is not said: the class using it was edited)


_UNKNOWN = object()


def _resolve(key: str) -> Any:
    """The class or function at ``key`` in a module already imported; None when that module
    no longer holds it; _UNKNOWN when the module is not imported (nothing to compare)."""
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        mod = sys.modules.get(".".join(parts[:i]))
        if mod is None:
            continue
        obj: Any = mod
        for name in parts[i:]:
            obj = getattr(obj, name, None)
            if obj is None:
                return None
        return obj
    return _UNKNOWN


def _short(path: Any) -> str:
    if not isinstance(path, str):
        return "?"
    try:
        rel = os.path.relpath(path)
    except ValueError:  # (another drive)
        return path
    return path if rel.startswith("..") else rel


def edits_text(step) -> str:
    """The one sentence: what differs and what to do about it."""
    edits = step.code_edits
    more = f" (+{len(edits) - 3} more)" if len(edits) > 3 else ""
    env = step.meta.get("env") or {}
    commit = str(env.get("git_commit") or "")[:12]
    fix = (f"check out its commit {commit} (git checkout {commit}) and replay there" if commit
           else f"replay with the code it ran (it ran in {env.get('cwd') or '?'})")
    return (f"the code differs from the recorded run's: {', '.join(edits[:3])}{more} since "
            f"the event, and the replay imports the edited code; to replay the run as it was, "
            f"{fix}")

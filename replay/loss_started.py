"""The loss's own plain attributes set as the event's step began: a loss that keeps a running
mean of past losses, a call count its schedule reads, in a plain attribute (on itself, a
submodule or a plain object it holds) has the bundle's description as the event left it,
after the step's own call had updated them; the recorder also keeps them as the step began
(``recorder.attributes``, the loss entry's ``started``), and those are set on the rebuilt
loss, which every re-run then begins from (``replay.module_state`` puts them back); a rewind
window's steps each begin from their own (the bundle's records, over the loss's at attach).

Only an attribute the rebuilt object has, of the same type, is set (as for the model's:
``replay.attributes``), where the code keeps it (its class: ``replay.class_kept``); or one it
lacks, which the loss first set at a later call than its first (``if not hasattr(self, ...)``)."""

from __future__ import annotations

from typing import Any

from recorder.attributes import LOSS, PLAIN, loss_objects

from .attributes import as_built, built_value, event_attributes, set_step_attributes
from .class_kept import set_where_kept


def set_loss_started(loss_meta: Any, loss_fn) -> list[str]:
    """Set the loss's recorded step-start attributes on ``loss_fn`` (rebuilt or the
    factory's); the dotted names set (``mean``, ``stats.mean``), as ``replay.loss_state``
    names them."""
    started = loss_meta.get("started") if isinstance(loss_meta, dict) else None
    return _set(started, loss_fn)


def set_loss_at_step(loss_meta: Any, loss_fn, attrs: dict | None) -> None:
    """The loss's attributes as one step of the rewind window began: ``attrs``, a record's
    differences from attach by object (None in an older bundle: left alone), over those the
    loss had at attach."""
    at_attach = loss_meta.get("attrs_at_attach") if isinstance(loss_meta, dict) else None
    if isinstance(attrs, dict) and isinstance(at_attach, dict):
        _set({n: {**a, **(attrs.get(n) or {})} for n, a in at_attach.items()
              if isinstance(a, dict)}, loss_fn)


def attributes_began(step, attrs: dict | None) -> None:
    """The model's (``replay.attributes``) and the loss's plain attributes as a step of the
    rewind window began (``attrs``: its record's), or with None as the event's step began."""
    if attrs is None:
        set_step_attributes(step.meta, step.model, event_attributes(step.meta))
        set_loss_started(step.meta.get("loss"), step.loss_fn)
    else:
        set_step_attributes(step.meta, step.model, attrs)
        set_loss_at_step(step.meta.get("loss"), step.loss_fn, attrs)


def _set(started: Any, loss_fn) -> list[str]:
    if not isinstance(started, dict) or loss_fn is None:
        return []
    objects = dict(loss_objects(loss_fn))
    done = []
    for name, attrs in started.items():
        obj = objects.get(name)
        if obj is None or not isinstance(attrs, dict):
            continue
        for k, v in attrs.items():
            if not hasattr(obj, k) and type(v) in PLAIN:  # (set by a later call: ``if not
                setattr(obj, k, v)  # hasattr(self, "mean")``, which this one then skips)
                done.append(dotted(name, k))
                continue
            built = built_value(obj, k)
            v = as_built(v, built)
            if type(v) in PLAIN and type(built) is type(v):
                if built != v or v != v:
                    set_where_kept(obj, k, v)
                done.append(dotted(name, k))
    return done


def dotted(name: str, k: str) -> str:
    """``k`` of the watched object ``name`` as ``replay.loss_state`` names the loss's
    attributes: ``<loss>`` -> ``k``, ``<loss>.stats`` -> ``stats.k``."""
    return k if name == LOSS else f"{name[len(LOSS) + 1:]}.{k}"

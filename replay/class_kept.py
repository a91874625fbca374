"""A plain attribute the code keeps on its class (``calls = 0`` in the class body, updated by
``type(self).calls += 1``): set where the code reads it, the class, and put back as found when
the replay ends, so a replay from Python (a notebook's ``replay.replay``) leaves the user's
classes as they were."""

from __future__ import annotations

_found: dict[tuple[type, str], object] = {}  # (class, name) -> its value before the replay


def set_where_kept(obj, k: str, v) -> None:
    """Set ``obj``'s attribute ``k`` where the code keeps it: on the instance where it has its
    own, else on the class of the user's that defines it (``type(self).calls += 1`` updates it
    there; ``self.calls += 1`` reads it there too and shadows it on the instance, as in the
    run)."""
    cls = None if k in vars(obj) else defining_class(obj, k)
    if cls is None:
        setattr(obj, k, v)
    else:
        _found.setdefault((cls, k), vars(cls)[k])
        setattr(cls, k, v)


def defining_class(obj, k: str) -> type | None:
    """The first class of ``obj``'s type, not torch's own, whose body defines ``k``."""
    return next((c for c in type(obj).__mro__ if k in vars(c)
                 and c.__module__.split(".")[0] not in ("torch", "builtins")), None)


def put_back_classes() -> None:
    """The classes' attributes the replay set, as it found them."""
    while _found:
        (cls, k), v = _found.popitem()
        setattr(cls, k, v)

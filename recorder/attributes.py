"""Modules' plain attributes (int, float, bool): the loop may set them during training (a
temperature annealed to 0, a scheduled dropout ``p``, a flag), and a factory builds them as
they started. The bundle keeps those the run changed after attach, as the event's step found
them, so the replay can set them again. One the factory builds otherwise from the start is the
factory's difference, which the replay's fidelity check reports (and ``--factory-kwargs``
fixes), so it is not overridden; one the forward changes in the step (the length of a rotary
cache it grew) is the step's to change again."""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
from torch import nn

PLAIN = (int, float, bool)
_call = getattr(operator, "call", lambda f, *a: f(*a))  # (operator.call: Python 3.11)


def plain_attributes(m: nn.Module) -> dict[str, int | float | bool]:
    """The module's own public int, float and bool attributes now (not ``training``: the
    modes are recorded and set on their own), with the class defaults of the user's own classes
    it has not set (``calls = 0`` in the class body, which ``self.calls += 1`` sets on the
    instance only at the first call: after attach)."""
    return {**class_defaults(m), **{k: v for k, v in vars(m).items() if _plain(k, v)}}


def class_defaults(m: nn.Module) -> dict[str, int | float | bool]:
    """Public int, float and bool attributes of the classes of ``m``'s type not torch's own
    (nn.Module's ``dump_patches``), the first in the method resolution order winning."""
    out: dict[str, int | float | bool] = {}
    for cls in type(m).__mro__:
        if cls.__module__.split(".")[0] not in ("torch", "builtins"):
            out.update({k: v for k, v in vars(cls).items() if k not in out and _plain(k, v)})
    return out


def trained_tensors(m: nn.Module) -> dict[str, torch.Tensor]:
    """The module's own public tensor attributes that are leaves requiring grad: tensors an
    optimizer trains that were never registered as parameters (quark0/darts's architecture
    ``self.alphas_normal = Variable(..., requires_grad=True)``, stepped by their own Adam). A
    forward's state (a membrane potential, a cache) is no leaf or requires no grad."""
    return {k: v for k, v in vars(m).items()
            if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter) and v.is_leaf
            and v.requires_grad and not k.startswith("_")}


def _plain(k: str, v: Any) -> bool:
    # (a non-finite float too: a coefficient the loop's schedule made NaN is the step's
    # cause; the bundle spells it 'nan', 'inf' or '-inf', and the replay reads it back)
    # (and a float's subclass: NumPy's float64 from a schedule's np.exp, as DANN's is)
    return (type(v) in PLAIN or isinstance(v, float)) and k != "training" \
        and not k.startswith("_")


class AttributeWatch:
    """The plain attributes at attach, and those of the same names at each step start: one C
    call per module that has any (an ``itemgetter`` over its ``__dict__``)."""

    def __init__(self, sites=()):
        self.at_attach: dict[str, dict[str, Any]] = {}
        self._names: list[str] = []
        self._dicts: list[dict] = []
        self._getters: list[operator.itemgetter] = []
        self._started: list | None = None
        for s in sites:
            attrs = self.at_attach[s.name] = plain_attributes(s.module)
            if attrs:
                self._names.append(s.name)
                if set(attrs) <= vars(s.module).keys():
                    self._dicts.append(vars(s.module))
                    self._getters.append(operator.itemgetter(*attrs))
                else:  # (a class default read through the instance: the one it sets later)
                    self._dicts.append(s.module)
                    self._getters.append(operator.attrgetter(*attrs))

    def step_started(self) -> None:
        try:
            self._started = list(map(_call, self._getters, self._dicts))
        except (KeyError, AttributeError):  # one deleted since attach: the event's then
            self._started = None

    @property
    def started(self) -> list | None:
        """The watched values as the open step began (one list per step: a reference keeps
        them; None when one was deleted since attach)."""
        return self._started

    def differences(self, started: list | None) -> dict[str, dict[str, Any]]:
        """Per watched module, the plain attributes in ``started`` (a step's :attr:`started`)
        that differ from attach: what the loop had set when that step began."""
        out: dict[str, dict[str, Any]] = {}
        for name, values in zip(self._names, started or ()):
            start = self.at_attach[name]
            found = zip(start, values if len(start) > 1 else (values,))
            if diff := {k: v for k, v in found if _plain(k, v) and (
                    type(start[k]) is not type(v) or not _same(start[k], v))}:
                out[name] = diff
        return out

    def changed(self, name: str, m: nn.Module) -> dict[str, int | float | bool]:
        """``m``'s plain attributes as the step found them (those added after attach: as
        it closed) where they differ from attach; none for a module added after it."""
        start = self.at_attach.get(name)
        if start is None:  # not a module at attach (or detached): no start to differ from
            return {}
        now = plain_attributes(m)
        if self._started is not None and name in self._names:
            values = self._started[self._names.index(name)]
            found = dict(zip(start, values if len(start) > 1 else (values,)))
            now.update({k: v for k, v in found.items() if _plain(k, v)})
        return {k: v for k, v in now.items()
                if k not in start or type(start[k]) is not type(v) or not _same(start[k], v)}


def _same(a, b) -> bool:
    return a == b or (type(a) is float and math.isnan(a) and math.isnan(b))

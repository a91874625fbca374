"""Modules' plain attributes (int, float, bool): the loop may set them during training (a
temperature annealed to 0, a scheduled dropout ``p``, a flag), and a factory builds them as
they started. The bundle keeps those the run changed after attach, as the event's step found
them, so the replay can set them again. One the factory builds otherwise from the start is the
factory's difference, which the replay's fidelity check reports (and ``--factory-kwargs``
fixes), so it is not overridden; one the forward changes in the step (the length of a rotary
cache it grew) is the step's to change again.

The loss's own plain attributes (its submodules' and the plain objects it holds: a running
mean of past losses, a call count its schedule reads) are read as each step begins too, by the
same one call per object: its call changes them, so the bundle keeps them as the event's step
began (``loss_started``) for the replay to begin its re-runs there (``replay.loss_started``);
one the loss first sets at a later call (``if not hasattr(self, "mean")``) is watched from the
next step on, when its object's ``__dict__`` has grown. Objects of torch's own classes are not
watched: their forwards change no attribute."""

from __future__ import annotations

import math
import operator
import types
from typing import Any

import torch
from torch import nn

from .compat import uncompiled

PLAIN = (int, float, bool)
LOSS = "<loss>"  # the loss's name among the watched objects (its submodules: ``<loss>.sub``)
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


def loss_holder(fn) -> Any:
    """The object whose attributes a loss keeps its state in: the loss module (compiled or
    not), the instance of a plain class called as the loss, or the one a bound method belongs
    to; else the function itself (attributes of its own, if any), or None."""
    if isinstance(fn, nn.Module):
        return uncompiled(fn)
    owner = getattr(fn, "__self__", None)
    if owner is not None and not isinstance(owner, (type, types.ModuleType)):
        return owner  # (not a builtin's module: torch._C._nn)
    return fn if isinstance(getattr(fn, "__dict__", None), dict) else None


def held_object(v) -> bool:
    """An instance of a class of the user's holding plain values: no module, tensor, function."""
    return isinstance(getattr(v, "__dict__", None), dict) and not isinstance(
        v, (nn.Module, torch.Tensor, type)) and type(v).__module__ != "builtins" \
        and not callable(v)


def loss_objects(fn) -> list[tuple[str, Any]]:
    """``(name, object)`` of the loss's holder (``<loss>``), its submodules (``<loss>.sub``)
    and the plain objects each holds as a public attribute (``<loss>.stats``)."""
    holder = loss_holder(fn)
    if holder is None:
        return []
    parts = [(f"{LOSS}.{n}" if n else LOSS, m) for n, m in holder.named_modules()] \
        if isinstance(holder, nn.Module) else [(LOSS, holder)]
    return [*parts, *((f"{name}.{k}", v) for name, obj in parts for k, v in vars(obj).items()
                      if not k.startswith("_") and held_object(v))]


def _plain(k: str, v: Any) -> bool:
    # (a non-finite float too: a coefficient the loop's schedule made NaN is the step's
    # cause; the bundle spells it 'nan', 'inf' or '-inf', and the replay reads it back)
    # (and a float's subclass: NumPy's float64 from a schedule's np.exp, as DANN's is)
    return (type(v) in PLAIN or isinstance(v, float)) and k != "training" \
        and not k.startswith("_")


class AttributeWatch:
    """The plain attributes at attach, and those of the same names at each step start: one C
    call per module that has any (an ``itemgetter`` over its ``__dict__``); and of the loss's
    objects of the user's classes (``loss``: the loss as the recorder was given it) that are
    not the model's modules."""

    def __init__(self, sites=(), loss=None):
        self.at_attach: dict[str, dict[str, Any]] = {}
        self._names: list[str] = []
        self._keys: list[tuple[str, ...]] = []  # the attributes each getter reads
        self._dicts: list[dict] = []
        self._getters: list[operator.itemgetter] = []
        self._started: list | None = None
        for s in sites:
            self._watch(s.name, s.module)
        self._model = {id(s.module) for s in sites}
        self._loss = loss
        self._sizes: list[tuple[dict, int]] = []  # the loss's objects' __dict__, their sizes
        self._watch_loss(later=False)
        if self._sizes:  # (no cost where the loss is torch's own: one len per object else)
            self.step_started = self._loss_step_started

    def _watch_loss(self, later: bool = True) -> None:
        """Watch the loss's objects of the user's classes with the plain attributes they have
        now: at attach, and again when one of them has grown one (``if not hasattr(self,
        "mean"): self.mean = ...`` at its first call, after attach)."""
        self._sizes = []
        for name, obj in loss_objects(self._loss) if self._loss is not None else ():
            if id(obj) not in self._model and type(obj).__module__.split(".")[0] != "torch":
                self._sizes.append((vars(obj), len(vars(obj))))
                self._watch(name, obj, later)

    def _watch(self, name: str, obj, later: bool = False) -> None:
        attrs = plain_attributes(obj)
        self.at_attach.setdefault(name, {} if later else attrs)  # (one held later: none then)
        if not attrs:
            return
        if name in self._names:  # (watched again: its attributes now)
            i = self._names.index(name)
        else:
            i = len(self._names)
            self._names.append(name)
            self._keys.append(())
            self._dicts.append({})
            self._getters.append(None)
        self._keys[i] = tuple(attrs)
        if set(attrs) <= vars(obj).keys():
            self._dicts[i] = vars(obj)
            self._getters[i] = operator.itemgetter(*attrs)
        else:  # (a class default read through the instance: the one it sets later)
            self._dicts[i] = obj
            self._getters[i] = operator.attrgetter(*attrs)

    def step_started(self) -> None:
        try:
            self._started = list(map(_call, self._getters, self._dicts))
        except (KeyError, AttributeError):  # one deleted since attach: the event's then
            self._started = None

    def _loss_step_started(self) -> None:
        """:meth:`step_started` where the loss has objects of the user's classes: one that
        grew an attribute since the last step is watched again first."""
        if any(len(d) != n for d, n in self._sizes):
            self._watch_loss()
        AttributeWatch.step_started(self)

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
            if diff := {k: v for k, v in self._read(name, values).items() if k not in start
                        or type(start[k]) is not type(v) or not _same(start[k], v)}:
                out[name] = diff
        return out

    def _read(self, name: str, values) -> dict[str, Any]:
        """A watched object's getter result (one value, or a tuple of several) by attribute,
        its plain values only."""
        keys = self._keys[self._names.index(name)]
        found = zip(keys, values if len(keys) > 1 else (values,))
        return {k: v for k, v in found if _plain(k, v)}

    def loss_at_attach(self) -> dict[str, dict[str, Any]]:
        """The loss's watched attributes at attach, by object (a rewind record's differences
        are from these)."""
        return {n: self.at_attach[n] for n in self._names if n == LOSS or n.startswith(LOSS + ".")}

    def loss_started(self) -> dict[str, dict[str, Any]]:
        """The loss's watched attributes as the open step began, by object (``<loss>``,
        ``<loss>.stats``): all of them, the bundle's record that they were watched."""
        out: dict[str, dict[str, Any]] = {}
        for name, values in zip(self._names, self._started or ()):
            if name == LOSS or name.startswith(LOSS + "."):
                out[name] = self._read(name, values)
        return out

    def changed(self, name: str, m: nn.Module) -> dict[str, int | float | bool]:
        """``m``'s plain attributes as the step found them (those added after attach: as
        it closed) where they differ from attach; none for a module added after it."""
        start = self.at_attach.get(name)
        if start is None:  # not a module at attach (or detached): no start to differ from
            return {}
        now = plain_attributes(m)
        if self._started is not None and name in self._names:
            now.update(self._read(name, self._started[self._names.index(name)]))
        return {k: v for k, v in now.items()
                if k not in start or type(start[k]) is not type(v) or not _same(start[k], v)}


def _same(a, b) -> bool:
    return a == b or (type(a) is float and math.isnan(a) and math.isnan(b))

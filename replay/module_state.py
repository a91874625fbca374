"""What the model keeps on its modules as plain attributes, put back before every re-run.

A stateful module keeps its state as an attribute rather than a buffer: a spiking neuron's
membrane potential (snntorch's ``self.mem``, which the loop resets before each batch), a
streaming layer's cache, a counter of its own calls. Its forward replaces that state at each
call, so a re-run that starts where the previous one left it runs on another state: the re-runs
drift apart, and the step read as nondeterministic. Every re-run starts from them as the replay
found them (the factory's, with the bundle's weights and recorded attributes): public ``int``,
``float``, ``bool`` and ``None`` attributes are set again, and a tensor of the same shape is put
back (copied back where it was written in place), and so are tuples and lists of tensors (an
LSTM tutorial's ``self.hidden = (h, c)``, pytorch-ntm's ``previous_state``, which the loop's
``init_sequence`` sets and each forward replaces). A tensor the forward replaced with another
shape is left, like a grown non-persistent buffer (:func:`replay.rerun.restorable`): a cache
grown for a longer batch, which the forward grows again from its reset length. Attributes the
forward added are left, as are private ones (torch's own: a hook's registration sets some).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from recorder.attributes import loss_objects, plain_attributes

from .class_kept import set_where_kept
from .compat import version


def _tensor(v) -> bool:
    return isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter)


class LossState:
    """The loss's own objects (``recorder.attributes.loss_objects``: it, its submodules, the
    plain objects it holds), their state and the RNG as each of a run's loss calls began, put
    back after the run as the call a loss re-run alone after it (the op finder's) stands for
    began: with gradient accumulation, the first micro-batch's whose loss was non-finite (a
    running count three calls on computes another loss), else the last one's."""

    def __init__(self, loss_fn):
        self.objects = [o for _, o in loss_objects(loss_fn)]
        self._began: dict[int, tuple] = {}  # micro-batch -> (state, RNG)
        self._held = False

    def began(self, i: int, rng: dict | None) -> None:
        """Micro-batch ``i``'s loss call begins (``rng``: the generators' states then)."""
        self._began[i] = (ModuleState(self.objects) if self.objects else None, rng)

    def put_back(self, micro_batches: list[int], finite: list[bool]) -> dict | None:
        """Put the state back as the loss call began of the first of ``micro_batches`` (a run's,
        in order) whose loss was not ``finite``, else the last call's; its RNG state, to
        restore (also while :meth:`as_left` holds the state as left)."""
        if not self._began:
            return None
        i = next((m for m, ok in zip(micro_batches, finite) if not ok), None)
        state, rng = self._began.get(i) or self._began[max(self._began)]
        self._began = {}
        if state is not None and not self._held:
            state.restore()
        return rng

    @contextlib.contextmanager
    def as_left(self):
        """Runs inside leave the loss as their last call left it (to read what it changed)."""
        self._held = True
        try:
            yield
        finally:
            self._held = False


class ModuleState:
    """The plain, ``None`` and tensor attributes of some modules, as a run starts from them."""

    def __init__(self, modules: list[nn.Module]):
        # per module: its plain and None attributes, and name -> (tensor, copy, version then)
        self._saved = [(m, {**plain_attributes(m), **{
            k: None for k, v in vars(m).items() if v is None and not k.startswith("_")}},
                        {k: (v, v.detach().clone(), version(v))
                         for k, v in vars(m).items() if _tensor(v)},
                        {k: _saved(v) for k, v in vars(m).items()
                         if _states(v) and not k.startswith("_")})
                       for m in modules]
        # the class defaults a module reads through its class (not set on it yet)
        self._on_class = [{k for k in plain if k not in vars(m)} for m, plain, _, _ in self._saved]

    def restore(self) -> None:
        for (m, plain, tensors, states), on_class in zip(self._saved, self._on_class):
            d = vars(m)
            for k, v in plain.items():
                if k in on_class:  # (kept on its class: ``type(self).calls += 1``)
                    d.pop(k, None)  # (``self.calls += 1`` shadows it: read it there again)
                    if getattr(m, k) is not v:
                        set_where_kept(m, k, v)
                    continue
                now = d.get(k, d)
                if now is not v and (type(now) is not type(v) or now != v):
                    d[k] = v
            if tensors:
                with torch.no_grad():
                    _put_back(d, tensors)
            for k, saved in states.items():
                d[k] = _rebuilt(saved)


def _states(v) -> bool:
    """``v`` is a plain tuple or list holding tensors only (nested so too), at least one."""
    if type(v) not in (tuple, list) or not v:
        return False
    return all(_tensor(x) or _states(x) for x in v)


def _saved(v):
    """``v``'s structure, each tensor kept with a copy and its version then."""
    if _tensor(v):
        return v, v.detach().clone(), version(v)
    return type(v), [_saved(x) for x in v]


def _rebuilt(saved):
    """A new container of the saved structure (the forward may have appended to a list), its
    tensors the saved ones, copied back where written in place since."""
    if isinstance(saved[0], torch.Tensor):
        t, copy, ver = saved
        if version(t) != ver:
            try:
                with torch.no_grad():
                    t.copy_(copy)
            except RuntimeError:  # (an inference tensor: no in-place write)
                return copy.clone()
        return t
    kind, items = saved
    return kind(_rebuilt(x) for x in items)


def _put_back(d: dict, tensors: dict) -> None:
    for k, (t, copy, ver) in tensors.items():
        now = d.get(k)
        if now is not t and (not _tensor(now) or now.shape != t.shape):
            continue  # (replaced with another shape: a grown cache)
        if version(t) != ver:  # written in place (the usual state is replaced)
            try:
                t.copy_(copy)
            except RuntimeError:  # (an inference tensor: no in-place write)
                t = copy.clone()
            tensors[k] = (t, copy, version(t))
        if now is not t:
            d[k] = t

"""Tensors the model keeps on its modules as plain attributes, put back before every re-run.

A stateful module keeps its state as an attribute rather than a buffer: a spiking neuron's
membrane potential (snntorch's ``self.mem``, which the loop resets before each batch), a
streaming layer's cache, a memory module's last values. Its forward replaces that state at each
call, so a re-run that starts where the previous one left it runs on another state: the re-runs
drift apart, and the step read as nondeterministic. Every re-run starts from them as the replay
found them (the factory's, with the bundle's weights): a tensor written in place is copied back,
``None`` is set again, and a tensor attribute the forward added since is removed.
"""

from __future__ import annotations

import torch
from torch import nn

from .compat import version


def _tensor(v) -> bool:
    return isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter)


class ModuleState:
    """The tensor and ``None`` attributes of some modules, as a run starts from them."""

    def __init__(self, modules: list[nn.Module]):
        # per module: name -> (the tensor, a copy, its version then), or None for None
        self._saved = [(m, {k: (v, v.detach().clone(), version(v)) if v is not None else None
                            for k, v in vars(m).items() if v is None or _tensor(v)})
                       for m in modules]

    def restore(self) -> None:
        with torch.no_grad():
            for m, saved in self._saved:
                d = vars(m)
                for k in [k for k, v in d.items() if k not in saved and _tensor(v)]:
                    del d[k]  # (added by a run's forward: the next one adds it again)
                for k, kept in saved.items():
                    if kept is None:
                        if d.get(k, 0) is not None:
                            d[k] = None
                        continue
                    t, copy, ver = kept
                    if version(t) != ver:  # written in place (the usual state is replaced)
                        try:
                            t.copy_(copy)
                        except RuntimeError:  # (an inference tensor: no in-place write)
                            t = copy.clone()
                        saved[k] = (t, copy, version(t))
                    if d.get(k) is not t:
                        d[k] = t

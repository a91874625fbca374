"""The recorded optimizer's class, imported by its recorded path when the bundle allows it.

A ``torch.optim`` built-in is looked up in ``torch.optim``. A class of an installed optimizer
library (``pytorch_optimizer``'s Lion, AdaBelief, Prodigy, SophiaH, Ranger) is installed
training code like a library's loss, so it is imported too, under the trust rule
(``replay.trust``): its top-level module and the module that defines the class both live in an
installed package, and the class is a ``torch.optim.Optimizer``. A class under the current
directory (the user's own optimizer) still comes from the factory, which says how it is built.
The bundle records ``module.qualname`` joined by dots; the module is the longest prefix that
imports.
"""

from __future__ import annotations

import torch

from recorder.validate import import_object

from .trust import defined_in, installed_roots, module_origin, trusted_path


def installed_optimizer(path: str):
    """The ``torch.optim.Optimizer`` subclass ``path`` names in an installed package, or None
    (not installed, not importable, defined elsewhere, or not an optimizer class)."""
    roots = installed_roots()
    if not path or "<" in path or not trusted_path(module_origin(path), roots):
        return None
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = import_object(".".join(parts[:cut]), ".".join(parts[cut:]))
        except Exception:  # (a prefix that is not a module, or a name it lacks)
            continue
        ok = isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer)
        return obj if ok and trusted_path(defined_in(obj), roots) else None
    return None

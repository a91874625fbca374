"""The loss module's trained parameters in the replay.

The recorder records the parameters of ``loss_fn`` that the optimizer trains (a learnable
temperature, a multi-task loss's log-variances) among the model's, named ``<loss>.NAME``
(:func:`recorder.target.loss_params`). The replay gives the rebuilt loss their bundled values
and lists them after the model's own in the rebuilt model's ``named_parameters()``, so that
the optimizer, the rewind window, the what-ifs and the float64 re-run treat them as the run's
update did. The loss stays no submodule of the model: no forward hook sees its call as a
module's. The recorded names of a ``torch.compile``'d loss module hold the wrapper
(``<loss>._orig_mod.temperature``); the loss is rebuilt eagerly, so each is looked up without
it and listed under the name the bundle gives it.
"""

from __future__ import annotations

from torch import nn

from recorder.compiled import eager_name
from recorder.target import LOSS_PREFIX

from .errors import ReplayError
from .weights import assign

_FACTORY_WAY = "return {'model': ..., 'loss_fn': ...} from the factory"


def attach_loss_params(step) -> None:
    """Give ``step.loss_fn`` the bundle's values of its trained parameters and list them with
    ``step.model``'s (nothing to do for a bundle that has none)."""
    names = [n for n in step.meta.get("params", []) if n.startswith(LOSS_PREFIX)]
    if not names or step.model is None:
        return
    loss = step.loss_fn
    if not isinstance(loss, nn.Module):
        raise ReplayError(f"the optimizer trained {len(names)} parameter(s) of the loss module "
                          f"({names[0]}), and the loss was not rebuilt as a module; "
                          + _FACTORY_WAY)
    for name in names:
        _load(step, loss, name)
    model_params = type(step.model).named_parameters.__get__(step.model)

    def named_parameters(prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        yield from model_params(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)
        if recurse and not prefix:  # (the model's whole listing only, not a submodule's)
            for n, p in loss.named_parameters(prefix=LOSS_PREFIX[:-1]):
                yield from ((name, p) for name in names if _in_loss(name) == n)

    # (an instance attribute: Module.parameters() and zero_grad() go through it too)
    object.__setattr__(step.model, "named_parameters", named_parameters)


def trained_loss_params(step) -> list[nn.Parameter]:
    """The loss's parameters the recorded optimizer trains (none in most bundles)."""
    loss = step.loss_fn
    if not isinstance(loss, nn.Module):
        return []
    return [loss.get_parameter(_in_loss(n)[len(LOSS_PREFIX):])
            for n in step.meta.get("params", []) if n.startswith(LOSS_PREFIX)]


def _in_loss(name: str) -> str:
    """A recorded ``<loss>.NAME`` as the eagerly rebuilt loss names it (no compile wrapper)."""
    return eager_name(name)


def _load(step, loss: nn.Module, name: str) -> None:
    attr = _in_loss(name)[len(LOSS_PREFIX):]
    try:
        p = loss.get_parameter(attr)
    except AttributeError:
        raise ReplayError(f"the rebuilt loss {type(loss).__name__} has no parameter {attr!r}, "
                          f"which the bundle holds as {name}; " + _FACTORY_WAY
                          + " building the loss as it was trained") from None
    w = step.tensors.get(f"weights/{name}")
    if w is None or tuple(w.shape) != tuple(p.shape):
        got = "none" if w is None else f"shape {list(w.shape)}"
        raise ReplayError(f"the bundle holds {got} for {name}, and the rebuilt loss's "
                          f"{attr} has shape {list(p.shape)}; " + _FACTORY_WAY
                          + " building the loss as it was trained")
    assign(loss, attr, nn.Parameter(w.to(step.device), requires_grad=p.requires_grad),
           param=True)

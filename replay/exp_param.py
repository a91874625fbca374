"""A value exp made of a model parameter, followed through the loss re-run, where the model's
outputs come detached: a Gaussian policy's state-independent ``log_std`` (SB3's
``log_std.expand(B, A)``) handed to a loss that divides by ``2 * log_std.exp() ** 2``; or
taken as is where the parameter itself is exp's input (a VAE's KL to a learned prior,
``/ self.prior_logvar.exp()`` in the forward). A 0 it holds underflowed because the parameter
drifted down; the fix is to that parameter, not the log-space rewrites of a softmax. The backward finder walks its own graph for the same case
(:func:`replay.positive.exp_of_parameter`)."""

from __future__ import annotations

from .memo import TensorMarks
from .positive import node_op

# ops that pass a parameter's values on unchanged (and their autograd nodes)
_VIEWS = {"view", "_unsafe_view", "reshape", "expand", "clone", "_to_copy", "contiguous",
          "unsqueeze", "squeeze", "select", "slice", "permute", "transpose", "t", "alias"}
_VIEW_NODES = {"View", "UnsafeView", "ReshapeAlias", "Expand", "Clone", "ToCopy", "Unsqueeze",
               "Squeeze", "Select", "Slice", "Permute", "Transpose", "T", "Alias"}
# and those that keep an exp's result positive and 0 where it is 0 (a power, a positive factor)
_KEEPS = _VIEWS | {"pow", "mul"}

ADVICE = ("that value is the exp of the parameter {name} (as low as {lo:.4g}), which drifted "
          "down until its exp underflowed: bound it where it is used ({name}.clamp(min=-20), "
          "as SAC and SB3's squashed policies bound log_std; a learned prior's log-variance "
          "likewise) and check what drives it down (a target without noise in one dim, an "
          "entropy bonus of the wrong sign, a KL that rewards a narrower prior, its learning "
          "rate)")


def _parameter(fn, depth: int = 6):
    """The leaf (a parameter) whose values autograd node ``fn`` made through views, or None."""
    for _ in range(depth):
        if fn is None:
            return None
        if fn.name().endswith("AccumulateGrad"):
            return getattr(fn, "variable", None)
        if node_op(fn) not in _VIEW_NODES:
            return None
        fn = next((f for f, _ in fn.next_functions if f is not None), None)
    return None


class ExpOfParam:
    """Detached model outputs that are a parameter's values, and exp's results of them."""

    def __init__(self):
        self._param = TensorMarks()  # -> (name, lowest value)
        self._exp = TensorMarks()

    def mark(self, fn, t, names) -> None:
        """``t`` stands for what autograd node ``fn`` made; ``names``: the finder's
        :class:`~replay.param_names.ParamNames`."""
        try:
            leaf = _parameter(fn)
        except Exception:  # not an autograd node, or one that cannot say
            return
        if leaf is not None and leaf.is_floating_point() and leaf.numel():
            name = names.among([leaf]) or "of the model"
            self._param.put(t, (name, float(leaf.detach().min())))

    def track(self, name: str, ins: list, outs: list, leaves: list, names=None) -> None:
        """One op; ``names``: the finder's parameter names, for an exp taking a parameter as
        is (in the forward, or a loss holding the model)."""
        if not ins or not outs:
            return
        numbers = [v for v in leaves if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if name in _VIEWS and (p := self._param.get(ins[0])) is not None:
            self._param.put(outs[0], p)
        elif name == "exp" and (p := self._param.get(ins[0]) or _own(ins[0], names)) is not None:
            self._exp.put(outs[0], p)
        elif name in _KEEPS and len(ins) == 1 and (p := self._exp.get(ins[0])) is not None \
                and (name != "mul" or all(v > 0 for v in numbers)):
            self._exp.put(outs[0], p)

    def of(self, t) -> tuple[str, float] | None:
        return self._exp.get(t)


def _own(t, names) -> tuple[str, float] | None:
    """(name, lowest value) of the model's parameter ``t`` is (as is, a view or an unchanged
    copy of one), or None."""
    if names is None or not t.is_floating_point() or not t.numel():
        return None
    name = names.among([t])
    return (name, float(t.detach().min())) if name else None


def exp_param_advice(ev, i: int) -> str | None:
    """:data:`ADVICE` for input ``i`` of the op ``ev`` is the evidence of, or None."""
    p = ev.exp_param[i] if i < len(ev.exp_param) else None
    return ADVICE.format(name=p[0], lo=p[1]) if p is not None else None

"""A loss's NaN that a mask's 0 was then meant to drop: ``(kl * target_weight).sum()``.

Pose losses normalise each keypoint's target heatmap by its sum and weight the result by the
keypoint's visibility; an invisible keypoint's target is all zeros (HRNet's
``generate_target``), so the normalisation is 0/0 there, and its weight of 0 keeps the NaN
(``NaN * 0`` is NaN). The op on the targets alone reads as a degenerate record ("drop or
repair such records; an eps would train toward a made-up target"), but the entry is one the
loss masks out by design: nothing is to drop, and an eps trains toward nothing there, as its
weight is 0. The loss is re-run under a small dispatch mode that goes on past the first NaN
(the op finder stops there): when a product then multiplied every NaN it met by 0
(``replay.masked_product``), the hint names that product and says so.
"""

from __future__ import annotations

from typing import Any

import torch

from .cause_text import DO, MASKED_AFTER_NAN
from .compat import TorchDispatchMode, running_node, tree_leaves
from .dispatch import run_op
from .drop import undroppable
from .empty_records import zero_rows
from .label_branches import complement_of
from .load import Step, autocast_as_recorded
from .loss_args import loss_args
from .masked_product import nan_times_zero
from .rerun import Runner
from .source import user_source
from .zero_coefficient import ZERO_COEFFICIENT, zero_coefficient

# the degenerate-record advice of an op on data alone, replaced here as written (not once
# replay.edge_probability has made it a propensity's)
_OF_DATA = DO["of_data"]
_ZERO_BY_ZERO = "of 0 by 0 (0/0)"  # (a division's, replay.cause_text)


class FirstThenMasked(TorchDispatchMode):
    """The first op that made a ``bad`` value (``bad(leaves)``: a NaN, a non-finite value) of
    inputs that held none, then the first product that ``masks(name, args)`` says multiplied
    what it met by a mask's 0, each as (op, source). A product whose factor is one of the
    first op's own all-zero inputs is not a mask: a 0/0 by a batch statistic that is 0
    (``width * tanh((x - m) / width)``, every value equal) multiplied back by that same 0;
    nor is one whose every tensor operand was computed from the first op's inputs: the
    formula's own 0 there (Rodrigues' ``sin(angle) * K`` at the angle 0 that ``axis / angle``
    divided by), not a weight the loss was given; nor is a product autograd's engine ran for a
    node's derivative (``AbsBackward0``'s ``grad * sgn(x)`` at 0, in a contractive penalty's
    ``jacobian(encoder, x, create_graph=True)``): the chain rule's 0, not the loss's code."""

    def __init__(self, bad, masks):
        super().__init__()
        self.bad, self.masks = bad, masks
        self.first: tuple[str, str | None] | None = None
        self.masked: tuple[str, str | None] | None = None
        self.zeros: list[torch.Tensor] = []  # the first op's all-zero inputs
        self.factors: tuple = ()  # the masking product's operands
        self.derived: dict[int, torch.Tensor] = {}  # made of the first op's inputs, by id
        self.complemented: list[torch.Tensor] = []  # y of every 1 - y (replay.label_branches)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = run_op(func, args, kwargs)
        name = func.overloadpacket.__name__
        if (c := complement_of(name, args)) is not None:
            self.complemented.append(c)
        if self.masked is None:
            if self.first is None and self.bad(tree_leaves(out)) and not self.bad(
                    tree_leaves((args, kwargs))):
                self.first = (f"aten.{name}", user_source())
                self.zeros = [t for t in tree_leaves((args, kwargs))
                              if isinstance(t, torch.Tensor) and not bool(t.any())]
                self._derive((args, kwargs, out), every=True)
            elif self.first is not None and self.masks(name, args) and running_node() is None \
                    and not any(_same(a, z) for a in args[:2] for z in self.zeros) \
                    and not all(id(a) in self.derived for a in args[:2]):
                self.masked = (f"aten.{name}", user_source())
                self.factors = tuple(a for a in args[:2] if isinstance(a, torch.Tensor))
            elif self.first is not None:
                self._derive(out, every=any(id(t) in self.derived
                                            for t in tree_leaves((args, kwargs))))
        return out

    def _derive(self, tree, every: bool) -> None:
        """Mark the floating tensors of ``tree`` as made of the first op's inputs (a
        comparison's bool, ``valid = gt > 0``, stays a mask)."""
        for t in tree_leaves(tree) if every else ():
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.derived[id(t)] = t  # (held, so that no id is reused)


def _same(a, b: torch.Tensor) -> bool:
    """Whether ``a`` is tensor ``b`` (or a view of the same memory and shape)."""
    return a is b or (isinstance(a, torch.Tensor) and a.device == b.device
                      and a.data_ptr() == b.data_ptr() and a.shape == b.shape)


def has_nan(leaves) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_floating_point()
               and bool(torch.isnan(t).any()) for t in leaves)


def masked_in_loss(step: Step, mb: int, bad, masks) -> FirstThenMasked | None:
    """Micro-batch ``mb``'s loss re-run on the re-computed outputs, watched by
    :class:`FirstThenMasked`; None when it could not run (the caller's advice stands)."""
    watch = FirstThenMasked(bad, masks)
    try:
        run = Runner(step).run(backward=False, instrument=False)
        args, kwargs = loss_args(step, run, mb)
        with torch.no_grad(), autocast_as_recorded(step.micro_batches[mb], step.device,
                                                   loss=True), watch:
            step.loss_fn(*args, **kwargs)
    except Exception:
        return None
    return watch


def masked_after_hint(report: dict[str, Any], step: Step) -> None:
    """Replace the degenerate-record advice of an ``invalid`` NaN made in the loss (or add to
    a 0/0's) when a product of the loss then multiplied that NaN by a mask's 0 (see the
    module's docstring)."""
    o, hint = report["origin"], report.get("hint") or ""
    if report.get("cause") != "invalid" or o.get("phase") != "loss" or o.get("made") != "nan" \
            or o.get("module") != "<loss>" or step.model is None or step.loss_fn is None \
            or (_OF_DATA not in hint and _ZERO_BY_ZERO not in hint):
        return  # (other advice, an eps lost to the type, stands)
    watch = masked_in_loss(step, o.get("micro_batch") or 0, has_nan, nan_times_zero)
    # (the origin's own NaN: a mask that met another op's NaN says nothing of it)
    if watch is None or watch.masked is None or watch.first != (o.get("op"), o.get("source")):
        return
    # (a 0/0 of the model's values, a cosine of off-surface points whose target normal is 0:
    # its eps advice stands, the mask's is added)
    what = hint[:hint.index(_OF_DATA)].rstrip().rstrip(":") if _OF_DATA in hint \
        else hint.rstrip(".")
    op, source = watch.masked
    at = f" ({source})" if source else ""
    if zero_coefficient(watch.factors, step.loss_fn):  # (a multiplier at 0: no mask)
        report["hint"] = hint.rstrip(".") + ZERO_COEFFICIENT.format(op=op, at=at)
        return
    rows, size = o.get("samples") or [], o.get("batch_size") or 0
    if any(_empty_rows(t, rows, size) for t in watch.factors):
        which = ",".join(str(r) for r in rows)
        how = (f" (--try drop={which} re-runs the step without them)"
               if undroppable(step, o.get("micro_batch") or 0) is None else "")
        report["hint"] = what + _EMPTY_SAMPLES.format(op=op, at=at, how=how)
        return
    report["hint"] = what + MASKED_AFTER_NAN.format(op=op, at=at)


# the mask's 0 fills whole samples: a per-sample statistic over their valid entries (MiDaS's
# least-squares scale of a frame with no LiDAR point) had none, no entry left out by design
_EMPTY_SAMPLES = (
    "; then {op}{at} multiplied that NaN by a mask's 0, and NaN * 0 is NaN: the mask is 0 in "
    "every entry of those samples and not in any other sample's (a frame with no ground "
    "truth, a record with no valid entry), so what was computed per sample over its valid "
    "entries (a count, a least-squares fit, a normalisation) had nothing to use there. Skip "
    "such samples where the denominator is 0 (x[ok] = a[ok] / d[ok] with ok = d != 0) or "
    "filter them where the data is made{how}")


def _empty_rows(t: torch.Tensor, rows: list[int], size: int) -> bool:
    """``t`` (a mask, dim 0 the batch's) is 0 in every entry of ``rows``, in no other row."""
    if not rows or not size or len(rows) >= size or t.dim() < 2 or t.shape[0] != size \
            or max(rows) >= size:
        return False
    return zero_rows(t, 0, rows)

"""Missing targets (NaN) that a loss masks by multiplying: ``(nll * observed).sum()``. An input
event on such a loss argument is data the run meant to hold; the loss is re-run under the op
finder, and the product that kept the NaN (``replay.masked_product``) is named; not a product
in an installed package's code (zuko's spline, ``mask * (x - x0)`` over its in-bounds mask):
that mask was never the user's to drop missing values with, the NaN is bad data."""

from __future__ import annotations

import torch

from .compat import tree_leaves
from .load import Step, autocast_as_recorded
from .loss_args import loss_args
from .masked_product import masked_hint
from .ops import OpFinder
from .rerun import Runner
from .source import in_package


def masked_in_loss(step: Step, origin: dict) -> tuple[str, str | None, bool] | None:
    """(op, source, by_mask) of the product in the loss that multiplied the NaN of a loss
    argument by 0 (missing targets masked by ``nll * observed``; ``by_mask``: that 0 a 0/1
    mask's, not a weight's own, an alpha's), re-running the model and the loss under the op
    finder; None when it met none, or the event is another one."""
    if not (origin.get("tensor") or "").startswith("loss_") or origin.get("made") != "nan" \
            or step.model is None or step.loss_fn is None:
        return None
    finder = watched_loss_rerun(step, origin.get("micro_batch") or 0, accept=_holds_nan)
    hit = finder and finder.masked_nan
    # (a library's own mask over records, zuko's spline bins, is no mask of missing targets;
    # a product of a tensor with no sample rows, class weights a library's loss multiplies,
    # still names where the NaN was taken: replay.masked_product)
    if hit is None or in_package(hit.source) and origin.get("samples"):
        return None
    return hit.op, hit.source, finder.masked_by_mask


def _holds_nan(args, kwargs) -> bool:
    """(else the re-run's arguments are not the recorded ones)"""
    return any(isinstance(t, torch.Tensor) and t.is_floating_point()
               and bool(torch.isnan(t).any()) for t in tree_leaves((args, kwargs)))


def watched_loss_rerun(step: Step, mb: int, accept=None) -> OpFinder | None:
    """The op finder after re-running the model's forward, then micro-batch ``mb``'s loss under
    it; None when either raised, or ``accept(args, kwargs)`` refuses the loss's arguments.
    (An origin's hint adds what it saw; without it the origin stands.)"""
    finder = OpFinder()
    try:
        run = Runner(step).run(backward=False, instrument=False)
        args, kwargs = loss_args(step, run, mb)
        if accept is not None and not accept(args, kwargs):
            return None
        with torch.no_grad(), autocast_as_recorded(step.micro_batches[mb], step.device,
                                                   loss=True), finder:
            step.loss_fn(*args, **kwargs)
    except Exception:
        return None
    return finder


def masked_loss_hint(step: Step, origin: dict) -> str | None:
    """:func:`masked_hint` of a loss argument's NaN (missing targets), None without one."""
    hit = masked_in_loss(step, origin)
    return masked_hint(origin, hit[:2], hit[2]) if hit is not None else None

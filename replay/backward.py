"""Naming the first backward node to return a non-finite gradient, and where it came from.

Two independent checks run, because anomaly mode alone sees NaN only:

- hooks on every autograd node of the graph, firing after the node: the first node whose
  incoming gradients were finite and whose returned gradients are not (NaN or Inf);
- ``torch.autograd.detect_anomaly(check_nan=True)``: the node it raises on, if any.

The forward runs under anomaly mode too, so each node carries the traceback of the forward
call that created it (the user's source line), and module hooks label each node with the
innermost module whose forward created it.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from recorder.finite import finite, kind_of
from recorder.samples import Samples

from .below_one import BelowOneNodes
from .centred_root import centred_root
from .compat import frame_tracebacks, saved_value
from .copied_rows import CopiedRow, copied_row
from .exact_edge import edge_input
from .exp_factor import huge_exp_factor
from .exp_forms import exp_form
from .factors import at_tie
from .flat_derivative import Feeders
from .folded_grads import FoldedGrads
from .fractional_power import fractional_power_at_zero
from .grad_hooks import HOOK, MODULE_HOOK, MODULE_HOOK_NODE, HookHit, HookWatch, module_hook_hit
from .grad_rows import batch_rows, batch_rows_in, node_rows
from .hooked_module import at_nodes
from .lost_eps import GuardNodes
from .masked_grad import zero_where_nan
from .node_labels import NodeLabels, loss_labeller
from .off_graph_positive import OffGraphPositive
from .ops import OpFinder
from .other_rows import lead_rows
from .pole_hints import zero_divisor
from .positive import exp_of_parameter, made_positive, node_op, segment_sum_of_positive
from .power_grad import steep_power
from .rerun import Runner
from .scalar_pole import scalar_at_pole
from .source import node_caller, node_source, node_tracebacks
from .summed_grads import SummedGrads
from .twice_differentiated import derived, forward_node
from .unflattened import packed_rows, unflattened_rows
from .unit_complement import unit_at_root
from .vanished_divisor import vanished_divisor


@dataclass
class BackwardOrigin:
    node: str | None = None
    module: str | None = None
    source: str | None = None
    called_from: str | None = None  # the user's line that called into source's package
    made: str | None = None
    dtype: torch.dtype | None = None  # of that non-finite gradient (float32 under autocast
    # for the ops autocast runs in float32, such as a layer norm)
    anomaly_node: str | None = None  # what detect_anomaly raised on (NaN only)
    params: list[str] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)  # batch rows of its non-finite gradient
    # (dim 0's size, its non-finite indices) when no sample was named (replay.other_rows)
    lead_rows: tuple[int, list[int]] | None = None
    micro_batch: int | None = None
    call: int | None = None  # which call of its module, when it ran more than once
    in_loss: bool = False  # it ran inside the loss (an autograd.grad of the model output)
    # the kind of the first non-finite tensor the node saved in the forward ("+inf": a value
    # the forward carried without an event, such as the batch's infinity that a tanh then
    # saturated), None when it saved only finite ones
    saved: str | None = None
    # it saved an exact 0 ("0": an input at its derivative's pole), else a value below its
    # type's smallest normal number ("subnormal": so near the pole that 1/x overflows)
    saved_zero: str | None = None
    # an input came from exp, softmax or sigmoid (positive in exact arithmetic), so a 0 there
    # underflowed (see :func:`from_positive`)
    positive_input: bool = False
    exp_of: torch.Tensor | None = None  # the parameter whose exp that input is (log_std)
    exp_form: str | None = None  # sqrt(exp(x)) as exp(0.5 * x) (replay.exp_forms)
    exp_factor: float | None = None  # a product's huge saved factor from exp (exp_factor)
    fractional_power: tuple[float, int, bool] | None = None  # |w| ** 0.5 at w = 0
    unit_complement: int = 0  # sqrt(1 - x²) at x = ±1 (replay.unit_complement)
    centred_root: bool = False  # sqrt of squared deviations from a mean (a std)
    steep_power: float | None = None  # x ** 40's exponent (replay.power_grad)
    # a custom autograd.Function's node: the aten op of its own backward code that made the
    # value, and that code's line (the forward line above is where the node was made)
    inner_op: str | None = None
    inner_source: str | None = None
    # a gradient hook the forward registered made the value, before any node (the node
    # fields above are then its: node is grad_hooks.HOOK, source the line of its op)
    hook: HookHit | None = None
    hook_kind: str | None = None  # a module hook's registration (replay.hooked_module)
    # the eps of a guard whose output the node took (``sqrt(x + 1e-12)``) that the output's
    # type rounded to 0 (float16), see :class:`replay.lost_eps.GuardNodes`
    lost_eps: float | None = None
    # why a quotient's divisor is 0 there (replay.pole_hints.zero_divisor): "data" (it needs
    # no gradient), "constant" (a scalar 0: x / cap, cap = 0), "clamped" (a learned one a ReLU cut),
    # "xlogy" (xlogy(x, y)'s x / y at x = y = 0), "xlogy_of_x" (the same, y 0 where x is),
    # "xlogy_of_itself" (xlogy(p, p): an entropy)
    zero_divisor: str | None = None
    vanished: float | None = None  # and for "vanished", its smallest |d| (vanished_divisor)
    complement: bool = False  # it took 1 - y of a y below 1 (replay.below_one)
    edge_input: torch.Tensor | None = None  # its saved input at "1" (replay.exact_edge)
    scalar_pole: bool = False  # it saved only 0-d values, one exactly 0 (replay.scalar_pole)
    copied: CopiedRow | None = None  # a sqrt's 0 distance to a parameter row copied from it
    # the forward differentiated itself (create_graph=True); the forward node whose derivative
    # made the node, when one did (replay.twice_differentiated)
    twice: bool = False
    derivative_of: Any = None  # (the node itself until the run ends)
    node_object: Any = None  # (the node, until the run ends: was it differentiated twice?)
    # no node made it: the engine summed this many finite gradients of the node's value's
    # uses into an infinity before the node ran (see replay.summed_grads)
    summed: int = 0
    masked: bool = False  # NaN only where its incoming gradient is 0 (replay.masked_grad)
    flat_by: str | None = None  # and that 0 an op's derivative's, no mask's (flat_derivative)
    zeroed_by: str | None = None  # or a squared error's node's, its residual 0 (flat_derivative)


@contextlib.contextmanager
def _anomaly():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Anomaly Detection has been enabled..."
        with torch.autograd.detect_anomaly(check_nan=True), frame_tracebacks():
            yield


def saved_tensors(node) -> list[torch.Tensor] | None:
    """The floating tensors ``node`` saved for its backward (its ``_saved_*`` attributes; a
    custom Function's ``saved_tensors``); None when they cannot be read (freed, or packed by
    ``torch.utils.checkpoint``, whose values unpack once, for the node itself). Read from the
    node's post-hook, before the engine frees them."""
    try:
        names = [n for n in dir(node) if n.startswith("_saved_")]
        values = [getattr(node, n) for n in names]
        if hasattr(node, "saved_tensors"):
            values += list(node.saved_tensors)
    except Exception:  # freed already, or unreadable: unknown
        return None
    return [t for v in values for t in (v if isinstance(v, (tuple, list)) else (v,))
            if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
            and t.numel()]


# nodes whose derivative is infinite where the input is +-1 (the edge of acos's domain;
# erfinv's, which a normal's icdf takes of 2p - 1)
_UNIT_POLE_NODES = {"Acos", "Asin", "Atanh", "Acosh", "Erfinv"}


# nodes whose saved result is positive (exp's): 0 times it is NaN only where it is +inf
_POSITIVE_RESULT = {"Exp", "Exp2"}


def _inferred_saved(node, grad_inputs, grad_outputs) -> str | None:
    """For a node whose saved tensors cannot be read: ``"+inf"`` when it is exp's and its
    returned gradient is NaN only where the incoming one is 0 (0 times its saved result: an
    exp that overflowed, masked after it), else None (unknown)."""
    if node_op(node) not in _POSITIVE_RESULT or len(grad_inputs) != 1 or len(grad_outputs) != 1:
        return None
    g, o = grad_inputs[0], grad_outputs[0]
    if not (isinstance(g, torch.Tensor) and isinstance(o, torch.Tensor)) or g.shape != o.shape:
        return None
    nan = torch.isnan(g)
    return "+inf" if bool(nan.any()) and bool((o[nan] == 0).all()) else None


def saved_facts(node, grad_inputs=(), grad_outputs=()) -> tuple[str | None, str | None]:
    """Of the tensors ``node`` saved for its backward: the kind of the first non-finite one
    (None when all are finite or none can be read, unless the gradients show it: see
    :func:`_inferred_saved`), and ``"0"`` when one holds an exact 0
    (sqrt's result, log's input: the pole of its derivative), ``"1"`` when acos, asin, atanh
    or acosh saved an input of exactly +-1 (theirs), else ``"subnormal"`` when one holds a
    value below its type's smallest normal number (whose reciprocal overflows)."""
    saved = saved_tensors(node)
    if saved is None:
        return _inferred_saved(node, grad_inputs, grad_outputs), None
    kind = next((kind_of(t) for t in saved if not finite(t)), None)
    if (tie := at_tie(node)) is not None:  # a decomposition: its pole is a tie, not a 0
        return kind, "tie" if tie else None
    if node_op(node) in _UNIT_POLE_NODES and any(bool((t.abs() == 1).any()) for t in saved):
        return kind, "1"  # (first: a 0 elsewhere in their input is no pole of theirs)
    # (a quotient's pole is its divisor's 0: a numerator's 0, exp's underflow to 0 beside a
    # subnormal divisor, is none)
    poles = [d] if node_op(node) == "Div" and isinstance(d := saved_value(node, "other"),
                                                             torch.Tensor) else saved
    if any(bool((t == 0).any()) for t in poles):
        return kind, "0"
    tiny = any(t.is_floating_point() and bool((t.abs() < torch.finfo(t.dtype).tiny).any())
               for t in poles)
    return kind, "subnormal" if tiny else None


def from_positive(node, depth: int = 8) -> bool:
    """Whether one of ``node``'s inputs came from exp, softmax or sigmoid of a finite argument
    (directly, or viewed, gathered, sliced, divided): a 0 there is a positive value that
    underflowed, so a derivative pole reached at it (``sqrt(exp(-120))``) is an underflow,
    where ``sqrt(1 - sigmoid(20))`` is cancellation. ``depth`` bounds the walk."""
    try:
        nexts = [fn for fn, _ in node.next_functions]  # (None: an input without a gradient)
    except Exception:  # not an autograd node, or one that cannot say
        return False
    # (the input at the pole: a quotient's y = 0, a power's base, xlogy's y)
    op = node_op(node)
    at_pole = nexts[1:2] if op in ("Div", "Xlogy") else nexts[:1] if op == "Pow" else nexts
    return any(made_positive(fn, depth) for fn in at_pole)


def _exp_of(node):
    """The parameter whose exp one of ``node``'s inputs is (see ``exp_of_parameter``)."""
    try:
        nexts = [fn for fn, _ in node.next_functions]
    except Exception:
        return None
    for fn in (nexts[1:2] if node_op(node) == "Div" else nexts):
        if (leaf := exp_of_parameter(fn)) is not None:
            return leaf
    return None


def find_backward_origin(runner: Runner, where: Samples | None = None,
                         probe=None) -> BackwardOrigin:
    """The first node to make a non-finite gradient from finite ones; ``where`` the batch's
    samples, to name those of its gradient; ``probe(model)``: hooks of the caller's that run
    backward passes of their own during the forward (after the nodes are labelled)."""
    found = BackwardOrigin()
    # (sums: finite gradients whose sum the engine made non-finite; folded: rows of a batch the
    # forward folded, x.reshape(N * M, ...); off: the exp of a tensor no gradient reaches)
    handles, sums, off, feeders, custom = [], SummedGrads(), OffGraphPositive(), Feeders(), []
    guards, below, folded = GuardNodes(), BelowOneNodes([off.seen]), FoldedGrads(where or Samples())
    watch = HookWatch(where or Samples(), lambda: found.node is not None,
                      lambda: (runner.micro_batch, runner.in_loss))

    def on_node(node, name):
        def hook(grad_inputs, grad_outputs):
            if found.node is not None and watch.hit is None:
                _after_origin(found, node, name, grad_inputs, grad_outputs, where or Samples())
            if found.node is not None or watch.hit is not None:
                return
            incoming = [g for g in grad_outputs if isinstance(g, torch.Tensor)]
            returned = [g for g in grad_inputs if isinstance(g, torch.Tensor)]
            if all(finite(g) for g in incoming) and not all(finite(g) for g in returned):
                _record(found, node, name, grad_inputs, grad_outputs, where or Samples(), folded)
                found.flat_by, found.zeroed_by = feeders.zeroed_above(node) if found.masked \
                    else (None, None)
                found.micro_batch, found.in_loss = runner.micro_batch, runner.in_loss
                found.positive_input = found.positive_input or off.divisor(node)
                found.lost_eps, found.complement = guards.of(node), below.complement_at(node)
                found.copied = copied_row(node) if found.saved_zero == "0" else None
                custom.append(isinstance(node, torch.autograd.function.BackwardCFunction))
            sums.sent(node, grad_inputs)

        def pre(grad_outputs):
            if found.node is None and watch.hit is None \
                    and (uses := sums.overflowed(node, grad_outputs)):
                _record_sum(found, node, name, uses, grad_outputs, where or Samples())
                found.micro_batch, found.in_loss = runner.micro_batch, runner.in_loss
        handles.extend([node.register_hook(hook), node.register_prehook(pre), feeders.hook(node)])

    labels = NodeLabels(on_node)  # (the loss's nodes, made after the root's hook: at backward)
    run = runner.run(instrument=False, forward_ctx=lambda: _watched(watch, guards, below, folded),
                     hooks=lambda m: labels.hooks(m) + (probe(m) if probe else [])
                     + watch.parameters(m),
                     backward_ctx=loss_labeller(runner, labels))
    for h in handles:
        h.remove()
    found.params, node = run.bad_grads, found.node_object
    at_nodes(found, labels.names, runner.model)  # (a derivative's or a module hook's node)
    found.call = labels.repeated_call(node, found.module)
    if watch.hit is not None:
        _from_hook(found, watch.hit, labels.names)
    if custom and custom[0]:
        _inside_custom(runner, found, where or Samples())
    try:  # a second opinion, from anomaly mode (NaN only)
        runner.run(instrument=False, forward_ctx=_anomaly, backward_ctx=_anomaly)
    except RuntimeError as e:
        m = re.search(r"Function '(\w+)' returned nan", str(e))
        found.anomaly_node = m.group(1) if m else None
    return found


def _record(found: BackwardOrigin, node, name: str, grad_inputs, grad_outputs,
            where: Samples, folded: FoldedGrads) -> None:
    """Node ``node`` (labelled ``name``) made the first non-finite gradient from finite ones."""
    returned = [g for g in grad_inputs if isinstance(g, torch.Tensor)]
    found.node, found.module, found.source = node.name(), name, node_source(node)
    found.called_from, found.node_object = node_caller(node), node
    if derived(node):  # (kept until the labels are known; then its forward node's name)
        found.derivative_of, found.source = node, node_source(forward_node(node)) or found.source
        found.called_from = node_caller(forward_node(node)) or found.called_from
    bad = next(g for g in returned if not finite(g))
    found.made, found.dtype = kind_of(bad), bad.dtype
    found.samples = batch_rows(node, list(grad_inputs), where) \
        or folded.rows(node, list(grad_inputs))
    found.lead_rows = None if found.samples else lead_rows(bad)
    found.saved, found.saved_zero = saved_facts(node, grad_inputs, grad_outputs)
    found.scalar_pole = scalar_at_pole(node, saved_tensors(node))
    found.edge_input = edge_input(saved_tensors(node)) if found.saved_zero == "1" else None
    found.positive_input = from_positive(node) or (
        found.saved_zero == "subnormal" and segment_sum_of_positive(node))
    found.exp_of = _exp_of(node)
    found.exp_form = exp_form(node)
    found.exp_factor = huge_exp_factor(node)
    found.fractional_power = fractional_power_at_zero(node)
    found.unit_complement = unit_at_root(node)
    found.centred_root = centred_root(node)
    found.steep_power = steep_power(node)
    found.zero_divisor = zero_divisor(node)
    if found.zero_divisor == "vanished":
        found.vanished = vanished_divisor(node)
    found.masked = zero_where_nan(grad_inputs, grad_outputs)


def _after_origin(found: BackwardOrigin, node, name: str, grad_inputs, grad_outputs,
                  where: Samples) -> None:
    """A node run after the origin's: the samples it names when the origin named none, or
    those it adds as the origin's sibling."""
    if not found.samples:
        found.samples = _later_samples(found, node, name, grad_inputs, grad_outputs, where)
    elif not found.summed:
        _with_sibling(found, node, grad_inputs, grad_outputs, where)


def _with_sibling(found: BackwardOrigin, node, grad_inputs, grad_outputs,
                  where: Samples) -> None:
    """Another node of the origin's kind on its source line that made a non-finite gradient
    of finite ones too (the other branch of ``where(m2 >= 0, sqrt(m2), -sqrt(-m2))``, NaN in
    the rows the first one kept, none of the origin's): its samples join the origin's."""
    if node.name() != found.node or node_source(node) != found.source or not found.samples \
            or not all(finite(g) for g in grad_outputs if isinstance(g, torch.Tensor)) \
            or all(finite(g) for g in grad_inputs if isinstance(g, torch.Tensor)):
        return
    rows = set(batch_rows(node, list(grad_inputs), where))
    if not rows & set(found.samples):  # (each row took one branch: a node over the origin's
        # rows again is the line run once more, a later call's, not the other branch)
        found.samples = sorted(set(found.samples) | rows)


def _record_sum(found: BackwardOrigin, node, name: str, uses: int, grad_outputs,
                where: Samples) -> None:
    """The engine summed ``uses`` finite gradients into node ``node``'s non-finite input."""
    bad = next(g for g in grad_outputs if isinstance(g, torch.Tensor) and not finite(g))
    found.node, found.module, found.source = node.name(), name, node_source(node)
    found.called_from = node_caller(node)
    found.made, found.dtype, found.summed = kind_of(bad), bad.dtype, uses
    found.samples = batch_rows_in(grad_outputs, where)


def _later_samples(found: BackwardOrigin, node, name: str, grad_inputs, grad_outputs,
                   where: Samples) -> list[int]:
    """The samples of a gradient after the origin's, which held none."""
    if rows := packed_rows(node, grad_inputs, grad_outputs, where):
        return rows  # (rows (B / k, k * D) of packed samples made back into (B, D))
    if found.module == "<loss>":
        # (a metric loss's mined pairs, (P,)): those of the gradient it sent into the model's
        # output
        return batch_rows_in(grad_outputs, where) if name != "<loss>" else []
    if name_of_pick(node):  # (the backward of x[to_apply]: the picked rows put back)
        return batch_rows(node, list(grad_inputs), where)
    if rows := unflattened_rows(node, grad_inputs, grad_outputs, where):
        return rows  # (rows (B * C, ...) made back into (B, C, ...))
    # (per edge of a graph batch, a pair distance's): the graphs of the first per-node
    # gradient it reached (an atom's position's)
    return node_rows(node, list(grad_inputs), where) if where.segments is not None else []


# nodes that put rows picked out of a value back where they came from (kornia's
# out[to_apply] = transform(x[to_apply]), x[order], index_select, masked_select): an origin
# inside the transform has the picked rows, no sample's; the batch's rows are put back here
_PICKS = {"IndexBackward0", "IndexSelectBackward0", "MaskedSelectBackward0"}


def name_of_pick(node) -> bool:
    return node.name() in _PICKS


@contextlib.contextmanager
def _watched(watch: HookWatch, guards: GuardNodes, below: BelowOneNodes, folded: FoldedGrads):
    # (no NaN check: an autograd.grad in the forward or the loss, forces -dE/dpos, must run
    # on past its first NaN, as training did, for the nodes after the origin to name samples)
    with node_tracebacks(), watch.registering(), guards, below, folded:
        yield


def _from_hook(found: BackwardOrigin, hit: HookHit, names: dict) -> None:
    """The origin is the gradient hook ``hit``: its op's line, the module that made the
    hooked tensor (the hook's registration line is ``hit.registered``)."""
    found.node, found.hook = HOOK, hit
    found.module = hit.param.rpartition(".")[0] if hit.param else next(
        (name for node, name in names.items() if id(node) == hit.node), None)
    found.source = hit.op.source if hit.op is not None else hit.registered
    found.called_from = None
    found.made, found.dtype, found.samples = hit.made, hit.dtype, hit.samples
    found.micro_batch, found.in_loss = hit.when


def _inside_custom(runner: Runner, found: BackwardOrigin, where: Samples) -> None:
    """Re-run with an op finder active while nodes named ``found.node`` (a custom
    autograd.Function's) run their Python backward: the user's backward code made the value,
    so name its op and line, not only the forward line that made the node; and the samples
    of that op's output where the node's gradients held none (a parameter's, which the
    backward summed over the batch itself)."""
    finder = OpFinder(where)
    handles: list = []

    def enter(grad_outputs):
        if finder.first is None and finder.first_nan is None:
            finder.__enter__()
            active.append(True)

    def leave(grad_inputs, grad_outputs):
        if active:
            active.clear()
            finder.__exit__(None, None, None)

    def on_node(node, name):
        if node.name() == found.node:
            handles.extend([node.register_prehook(enter), node.register_hook(leave)])

    active: list[bool] = []
    labels = NodeLabels(on_node)
    try:
        runner.run(instrument=False, hooks=labels.hooks,
                   backward_ctx=loss_labeller(runner, labels))
    finally:
        for h in handles:
            h.remove()
        if active:
            finder.__exit__(None, None, None)
    hit = finder.origin()
    if hit is not None and found.node == MODULE_HOOK_NODE:  # the module's hook, not torch's
        found.hook, found.node = module_hook_hit(found, hit), MODULE_HOOK
        found.source, found.called_from = hit.source or found.source, None
    elif hit is not None and hit.source:
        found.inner_op, found.inner_source = hit.op, hit.source
        if not found.samples and hit.rows:
            found.samples, found.lead_rows = hit.rows, None

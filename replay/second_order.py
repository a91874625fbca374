"""A backward event of a step whose later forward ran with weights adapted from an earlier
micro-batch's gradient (MAML: ``g = autograd.grad(loss, params, create_graph=True)``, then
``functional_call(model, {n: p - lr * g})``): the outer backward went through that gradient,
a second-order backward of the earlier micro-batch's graph. That later forward cannot be re-run
(the bundle holds the model's own weights), but the earlier micro-batch can: its loss is
differentiated again with ``create_graph=True`` and the gradient back-propagated (with a
cotangent of ones), looking for the first node of that second-order backward to make a
non-finite value from finite ones. A derivative can be defined where the next is not: the
norm's is masked to 0 at a zero vector, but its own derivative is 0/0 there.

It is looked for only when the earlier micro-batch's recorded output gradient shows a second
backward reached it (it differs from its loss's own first-order gradient): first-order MAML
(``create_graph=False``) never runs a second-order backward."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recorder.finite import finite, kind_of

from .backward import batch_rows, saved_facts
from .findings import finish, origin_fields
from .load import Step, output_grads
from .node_labels import NodeLabels, grad_fns
from .recorded import samples
from .rerun import Runner, scalar_loss
from .source import node_source, node_tracebacks
from .unseen_weights import other_weights_report


@dataclass
class SecondOrder:
    micro_batch: int
    node: str  # the node of the second-order backward that made the value
    forward_node: str  # the forward node whose derivative made that node
    module: str | None
    source: str | None
    made: str
    at_pole: bool  # the forward node saved an exact 0 (its derivative's pole)
    params: list[str]
    samples: list[int]  # of the micro-batch, in the node's non-finite gradient


def report_second_order(report, step: Step, runner: Runner, fid) -> dict | None:
    """The report of a backward event made in a second-order backward through an earlier
    micro-batch's gradient, else None (see the module docstring)."""
    if step.event.get("phase") != "backward" or not fid.get("within_step") \
            or step.loss_fn is None:
        return None
    try:
        found = find_second_order(runner, int(fid["micro_batch"]))
    except Exception:  # (an op with no double backward, cdist's: the report stays as it was)
        return None
    if found is None:
        return None
    origin = origin_fields(
        phase="backward", module=found.module, op=found.node, source=found.source,
        params=found.params, param=(found.params or [None])[0], made=found.made,
        micro_batch=found.micro_batch, samples=found.samples,
        chain=[{"op": found.node, "made": found.made, "source": found.source}])
    origin["second_order"] = found.forward_node
    report["problems"].append(
        f"micro-batch {fid['micro_batch']} ran with weights the bundle does not hold, adapted "
        f"from micro-batch {found.micro_batch}'s gradient (a MAML inner loop): the replay "
        f"differentiated micro-batch {found.micro_batch}'s loss with create_graph=True and "
        "back-propagated through that gradient, as the outer backward did")
    what = (f"{found.node}, a node of the second-order backward through {found.forward_node}'s "
            f"derivative (made at {found.source or 'an unknown line'}), made {found.made} from "
            "finite values")
    if found.at_pole:
        hint = (f"{what}: {found.forward_node} saved an exact 0, where its derivative is defined "
                "(masked) but its second derivative is not (the norm's x/|x| at a zero vector: "
                "a distance of a point to itself, a 1-shot prototype to its own support "
                "sample); use a squared distance, an eps inside the sqrt (sqrt(d2 + eps)), or "
                "first-order MAML (create_graph=False)")
        return finish(report, origin, "invalid", reproduced=True, hint=hint)
    return finish(report, origin, None, reproduced=True,
                  hint=f"{what}; the outer backward's cotangent is not in the bundle, so the "
                       "replay used ones: check that op's second derivative at these values")


def find_second_order(runner: Runner, before: int) -> SecondOrder | None:
    """The first earlier micro-batch (before ``before``) whose second-order backward makes a
    non-finite value from finite ones, and that node."""
    labels = NodeLabels(lambda node, name: None)
    # (anomaly mode: forward nodes keep their traceback, second-order ones their parent)
    run = runner.run(backward=False, instrument=False, hooks=labels.hooks,
                     forward_ctx=node_tracebacks)
    named = [(n, p) for n, p in runner.model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    for i, loss in zip(run.loss_micro_batches, run.losses):
        loss = scalar_loss(loss)
        if i >= before or loss is None or not finite(loss):
            continue
        labels.label(grad_fns([loss]), "<loss>")
        if not _reached_again(runner.step, i, run.outputs[i], loss):
            continue
        with node_tracebacks():
            gs = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
        pairs = [(g, p) for g, p in zip(gs, params) if g is not None and g.requires_grad]
        if not pairs or not all(finite(g) for g, _ in pairs):
            continue  # (a first-order NaN is not this module's to name)
        hit = _first_bad_node([g for g, _ in pairs], samples(runner.step, i))
        for p in params:
            p.grad = None
        with node_tracebacks():
            torch.autograd.backward([g for g, _ in pairs], [torch.ones_like(g) for g, _ in pairs],
                                    inputs=params, retain_graph=True)  # (saved_facts reads)
        bad = [n for n, p in named if p.grad is not None and not finite(p.grad)]
        if hit["node"] is None or not bad:
            continue
        node, fwd = hit["node"], _forward_node(hit["node"])
        return SecondOrder(i, node.name(), fwd.name(), labels.names.get(fwd), node_source(fwd),
                           hit["made"], saved_facts(fwd)[1] == "0", bad, hit["rows"])
    return None


def _reached_again(step: Step, i: int, outs: list[torch.Tensor], loss: torch.Tensor) -> bool:
    """Whether a second backward reached micro-batch ``i``'s outputs: the gradient the recorder
    kept there is not its loss's own."""
    recorded = output_grads(step, i)
    pairs = [(outs[j], g) for j, g in recorded.items()
             if j < len(outs) and outs[j].requires_grad and outs[j].shape == g.shape]
    if not pairs:
        return False
    own = torch.autograd.grad(loss, [o for o, _ in pairs], retain_graph=True, allow_unused=True)
    for mine, (o, g) in zip(own, pairs):
        mine = torch.zeros_like(o) if mine is None else mine
        if not finite(g) or not torch.allclose(mine, g.to(mine.dtype), rtol=1e-3, atol=1e-7):
            return True
    return False


def _first_bad_node(roots: list[torch.Tensor], where) -> dict:
    """Hooks every node behind ``roots`` (dropped with the graph); the dict gets the first
    node to return a non-finite gradient from finite ones, and the samples (``where``) of
    that gradient."""
    hit: dict = {"node": None, "made": None, "rows": [], "where": where}
    seen, todo = set(), [t.grad_fn for t in roots]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        node.register_hook(lambda gi, go, node=node: _check(hit, node, gi, go))
        todo.extend(n for n, _ in node.next_functions)
    return hit


def _check(hit: dict, node, grad_inputs, grad_outputs) -> None:
    if hit["node"] is not None:
        return
    incoming = [g for g in grad_outputs if isinstance(g, torch.Tensor)]
    returned = [g for g in grad_inputs if isinstance(g, torch.Tensor)]
    if all(finite(g) for g in incoming) and not all(finite(g) for g in returned):
        hit["node"] = node
        hit["made"] = kind_of(next(g for g in returned if not finite(g)))
        hit["rows"] = batch_rows(node, list(grad_inputs), hit["where"])


def _forward_node(node):
    """The forward node whose derivative made ``node`` (anomaly mode's ``parent_``, followed
    up to a node made in the forward); ``node`` itself when it was made there."""
    while (parent := (getattr(node, "metadata", None) or {}).get("parent_")) is not None:
        node = parent
    return node


def adapted_from_gradient(report, step: Step) -> dict:
    """``report`` of a backward origin the re-run found for a forward event: when that origin
    is in an earlier micro-batch than the event's forward, whose module took finite inputs,
    the forward ran with weights made from that non-finite gradient (MAML's inner loop:
    ``p - lr * g`` through ``functional_call``), which the bundle does not hold: the event is
    explained, and the report says how."""
    ev, o = step.event, report["origin"]
    m, k = ev.get("micro_batch"), o.get("micro_batch")
    if ev.get("phase") != "forward" or not ev.get("inputs_finite") or o.get("phase") != \
            "backward" or not isinstance(m, int) or not isinstance(k, int) or k >= m:
        return report
    report["reproduced"] = True
    report["problems"].append(
        f"the recorder saw the {ev.get('kind')} first in micro-batch {m}'s forward "
        f"('{ev.get('module') or '<root>'}', inputs finite), which ran with weights the bundle "
        f"does not hold: made from micro-batch {k}'s gradient (a MAML inner loop's p - lr * "
        f"g through functional_call, SAM's ascent w + rho * g / |g|); re-run, micro-batch {k}'s backward makes that gradient "
        f"{o.get('made')}, named above")
    if report["cause"] == "invalid" and report["hint"] and any(
            w in (o.get("op") or "").lower() for w in ("sqrt", "norm", "pow")):
        # (a norm's gradient masked to 0 at 0 does not help a loop that differentiates again)
        report["hint"] += ("; an inner loop that differentiates the gradient again "
                           "(create_graph=True) needs a second derivative there too, which a "
                           "norm at 0 lacks (its masked first derivative is 0/0 to "
                           "differentiate): use a squared distance or sqrt(x + eps)")
    return report


def report_made_weights(report, step: Step, run) -> dict | None:
    """A forward event of a later micro-batch whose module took finite inputs and made the
    NaN in training, where the re-run's same call, on the bundle's weights, is finite, after
    the loop differentiated an earlier micro-batch itself (``autograd.grad``, MAML's inner
    step): that forward ran with weights the inner update made, non-finite ones; the earlier
    gradients re-run finite, so the update's own factors made them (a learned inner learning
    rate's exp, Meta-SGD's). It was told to compute its 'derivative term' inside loss_fn.
    None when that is not the case."""
    ev = step.event
    m, name, k = ev.get("micro_batch"), ev.get("module"), ev.get("call")
    if ev.get("phase") != "forward" or not ev.get("inputs_finite") or not isinstance(m, int) \
            or not any(mb.get("differentiated") for mb in step.micro_batches[:m]):
        return None
    again = next((c for c in run.calls if (c.module, c.micro_batch, c.call) == (name, m, k)),
                 None)
    if again is None or not again.outputs_finite or run.bad_grads:
        return None
    label = name or "<root>"
    return other_weights_report(report, ev, (
        f"'{label}' took finite inputs in micro-batch {m} and made {ev.get('kind')} in "
        "training, but re-run on the bundle's weights it is finite: that forward ran with "
        "other weights, made within the step from an earlier micro-batch's gradient (a MAML "
        "inner loop's p - lr * g through functional_call), and non-finite; that gradient "
        "re-runs finite"), (
        f"the loop's inner update made the weights '{label}' ran with non-finite from finite "
        "gradients: check its factors at this step (an inner learning rate too large, a "
        "learned per-parameter one, Meta-SGD's, whose exp overflows: bound it, or learn it "
        "without exp) and the number of inner steps; the replay cannot re-run that update"))

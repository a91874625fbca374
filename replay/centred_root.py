"""A backward origin at the sqrt of a sum of squared deviations from the values' own mean: a
standard deviation written out (attentive statistics pooling's ``sqrt(sum(w * (x - mu)²))``,
a hand-written layer norm's), 0 where every value equals the mean — a sequence with a single
valid frame, a constant input — where the derivative of sqrt is infinite. The generic advice
for a sqrt of a sum of squares speaks of a distance between two points and offers
``torch.linalg.vector_norm``, which a spread is not; ``torch.std`` has the same pole. Told
from a distance by the graph: the subtrahend is made of the minuend (its mean), not another
output of the node that made the minuend (a chunk of the same batch: a triplet's anchor and
positive rows, which coincide where the data pairs a sentence with itself); or the
variance is written with the moments, E[x²] − E[x]² clamped at 0 against rounding (a graph
readout's std per graph, by ``index_add_`` over the batch vector), 0 exactly where a graph's
nodes are alike (an elemental crystal's equivalent atoms); or a segment mean over the batch
vector gathered back to each node (``global_mean_pool((x - mean[batch]) ** 2, batch)``, a
PNA-style std readout), 0 for a graph of one node."""

from __future__ import annotations

from .positive import node_op

# ops between the sqrt and the square: the reduction, its weights, a count
_REDUCE = {"Sum", "Mean", "Mul", "Div", "Clone", "View", "Reshape", "Squeeze", "Unsqueeze"}
# ops between the minuend's mean and the subtraction
_MEAN = {"Sum", "Mean", "Mul", "Div", "Unsqueeze", "Expand", "View", "Reshape", "Squeeze",
         "Clone", "IndexAdd", "ScatterAdd"}
# a segment mean read back at each member (``mean[batch]``): only above a sum (else a row
# paired with other rows of the same values, ``x - x[perm]``, is a distance)
_GATHER = {"Index", "IndexSelect", "Gather"}
_SUMS = {"Sum", "Mean", "IndexAdd", "ScatterAdd"}
# a sum per segment (a graph's nodes: index_add_ over the batch vector); clamps of a variance
_SEGMENT = {"IndexAdd", "ScatterAdd"}
_CLAMPS = {"ClampMin", "Clamp", "Relu"}

CENTRED = ("; the root's input is a sum of squared deviations from the values' own mean (a "
           "standard "
           "deviation written out, as attentive statistics pooling's sqrt(sum(w · (x − mu)²)) "
           "takes it, or as E[x²] − E[x]² clamped at 0: a graph readout's std over each "
           "graph's nodes): 0 where every value equals the mean, a sequence of one valid frame "
           "or position, a constant input, a graph whose nodes are all alike (an elemental "
           "crystal's equivalent atoms) or a graph of one node (torch.std has the same pole); clamp the variance "
           "before the root, sqrt(var.clamp(min=eps)) as SpeechBrain's pooling does, add "
           "the eps under it, sqrt(var + eps), or take the deviations' norm with "
           "torch.linalg.vector_norm(x - mu), whose gradient at 0 is 0 (a spread of group "
           "rates as a parity penalty)")


def _nexts(fn) -> list:
    try:
        return [f for f, _ in fn.next_functions if f is not None]
    except Exception:  # (a node that cannot say)
        return []


def _square_of_difference(fn, depth: int):
    """The ``Sub`` node whose square (``Pow`` 2, or ``x * x``) ``fn`` reduces, or None."""
    if fn is None or depth < 0:
        return None
    op = node_op(fn)
    if op == "Pow":
        sub = next(iter(_nexts(fn)), None)
        return sub if sub is not None and node_op(sub) == "Sub" else None
    if op not in _REDUCE | _SEGMENT:  # (a sum per graph over the batch vector too)
        return None
    for nxt in _nexts(fn):
        if (found := _square_of_difference(nxt, depth - 1)) is not None:
            return found
    return None


def _reaches(fn, target, depth: int, gathered: bool = False) -> bool:
    """Whether ``target`` is reached from ``fn`` through mean-making ops in ``depth`` steps
    (through a gather only where a sum follows it)."""
    if fn is None or depth < 0:
        return False
    if fn is target:
        return not gathered
    op = node_op(fn)
    if op not in _MEAN and op not in _GATHER:
        return False
    gathered = (gathered or op in _GATHER) and op not in _SUMS
    return any(_reaches(n, target, depth - 1, gathered) for n in _nexts(fn))


def _clamped(fn, depth: int = 3):
    """``fn``, or the node below the clamps at 0 (``clamp_min(0)``, ``relu``) above it."""
    while fn is not None and depth > 0 and node_op(fn) in _CLAMPS:
        fn, depth = next(iter(_nexts(fn)), None), depth - 1
    return fn


def _squared(fn, depth: int):
    """The node whose square (``Pow`` 2, ``x * x``) ``fn`` is or reduces (a sum, a segment
    sum over a graph's nodes, a division by a count), or None."""
    if fn is None or depth < 0:
        return None
    op, nexts = node_op(fn), [f for f, _ in getattr(fn, "next_functions", ())]
    if op == "Pow" and getattr(fn, "_saved_exponent", None) == 2 and nexts[:1] != [None]:
        return nexts[0]
    if op == "Mul" and len(nexts) == 2 and nexts[0] is not None and nexts[0] is nexts[1]:
        return nexts[0]
    if op not in _REDUCE | _SEGMENT:
        return None
    return next((x for n in _nexts(fn) if (x := _squared(n, depth - 1)) is not None), None)


def uncentred_root(node) -> bool:
    """Whether backward ``node`` is a sqrt of E[x²] − E[x]² (clamped at 0): a variance of
    the same values written with the moments, a graph readout's std over each graph's nodes
    (``index_add_`` of ``h * h`` and of ``h``, divided by the counts)."""
    if node is None or node_op(node) != "Sqrt":
        return False
    sub = _clamped(next(iter(_nexts(node)), None))
    if sub is None or node_op(sub) != "Sub":
        return False
    try:
        (first, _), (second, _) = sub.next_functions[:2]
    except (ValueError, AttributeError):
        return False
    x, mean = _squared(first, 6), _squared(second, 0)
    return x is not None and mean is not None and _reaches(mean, x, 6)


def centred_root(node) -> bool:
    """Whether backward ``node`` is a sqrt of a sum of squared deviations from a mean of the
    same values, or of E[x²] − E[x]² (see the module)."""
    if node is None or node_op(node) != "Sqrt":
        return False
    if uncentred_root(node):
        return True
    sub = _square_of_difference(next(iter(_nexts(node)), None), 4)
    if sub is None:
        return False
    try:
        (first, _), (second, _) = sub.next_functions[:2]
    except (ValueError, AttributeError):
        return False
    # one node's two outputs (``a, p = z.chunk(3)``: a triplet's anchor and positive rows of
    # one batch) are paired values, not values and their mean: a distance, named as one
    return (first is not None and second is not None and second is not first
            and _reaches(second, first, 5))


def centred_hint(b, hint: str, sqrt_pole: str, cause: str = "invalid") -> str:
    """``hint`` of backward origin ``b``, its distance clause ``sqrt_pole`` replaced by
    :data:`CENTRED` where ``b`` is such a root; a ``precision`` hint, which has no such
    clause (rounding made the values equal: a float16 or bfloat16 convolution's output of a
    near-constant image), gets it added."""
    if not b.centred_root:
        return hint
    if sqrt_pole in hint:
        return hint.replace(sqrt_pole, CENTRED)
    return hint + CENTRED if cause == "precision" and CENTRED not in hint else hint


def zero_deviations(b) -> bool:
    """Whether a 0 gradient entering backward origin ``b`` is its own values' doing, no mask:
    a std written out and divided into the deviations it measures (``(x - mu) / (std +
    eps)``, a hand-written instance or layer norm) gets from them a gradient of 0 exactly
    where they are all 0, where its root is at 0."""
    return bool(b.centred_root)

"""The first op at which two re-runs of one step part ways, when they disagree.

"Two re-runs disagree" alone sends the user hunting. Two more re-runs under a dispatch mode
that fingerprints every op's tensor inputs, Python arguments and outputs (exact bits: a sum and
a position-weighted sum of the values read as integers) find the first op whose result
differs, and say why, which the fingerprints tell apart:

- ``op``: same inputs, same arguments, another result: the op itself is not deterministic
  (a CUDA kernel accumulating with atomics in thread order; a decomposition whose answer is not
  unique for the input, an SVD's basis of a repeated or zero singular value);
- ``arguments``: same tensors, other Python values (``x / t`` with ``t`` from a global the
  step updates, a draw from ``numpy.random.default_rng()``, which the bundle does not hold);
- ``outside``: a tensor input that differs and that no op of the step made (``torch.from_numpy``
  of such a draw, a tensor kept between calls outside the model);
- ``inputs``: a tensor input that differs, made by an op of the step but written since where
  no op was seen (NumPy writing through ``t.numpy()`` or a ``torch.from_numpy`` array);
- ``generator``: same inputs, another draw from the ``torch.Generator`` the op was given (one
  the bundle does not hold or could not set back);
- ``path``: the second re-run ran another op there (the code branched on such a value).

Fingerprints are kept per tensor and version; a write no version counts (NumPy through
``t.numpy()``, ``t.data``) leaves a stale one, so an op that seems to give another result from
the same inputs is checked again by two re-runs that fingerprint every input afresh.

Each earlier op gave both re-runs the same outputs, so the first difference is where the
nondeterminism enters, not where it shows.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .bits import as_integers
from .call_stack import call_stack_hooks
from .compat import TorchDispatchMode, running_node, tree_leaves, version
from .source import user_source

# decompositions whose result is one of many valid ones when the input is degenerate
_NOT_UNIQUE = frozenset({"svd", "linalg_svd", "_linalg_svd", "linalg_eigh", "_linalg_eigh",
                         "linalg_eig", "geqrf", "linalg_qr", "linalg_lstsq", "_linalg_eigvals",
                         "linalg_eigvals", "orgqr", "ormqr"})
_CHUNK = 1 << 22  # elements fingerprinted at once (two int64 copies: 64 MB)


def fingerprint(t: torch.Tensor) -> tuple:
    """Shape, dtype and two exact sums of ``t``'s bits (one weighted by position: a permutation
    of the same values differs); shape and dtype alone for a tensor without plain storage."""
    head = (tuple(t.shape), str(t.dtype))
    if (x := as_integers(t)) is None:
        return head
    sums = torch.zeros(2, dtype=torch.int64, device=x.device)
    for i in range(0, x.numel(), _CHUNK):  # (int64 copies of a chunk at a time, not of all)
        part = x[i:i + _CHUNK].to(torch.int64)
        at = torch.arange(i + 1, i + part.numel() + 1, device=x.device, dtype=torch.int64)
        sums += torch.stack([part.sum(), (part * at).sum()])
    return head + tuple(sums.tolist())


class _Trace(TorchDispatchMode):
    """Fingerprints each op of a re-run; given ``first`` (another re-run's trace), stops at
    the first op that differs from it and keeps where it ran."""

    def __init__(self, first: list | None = None, cached: bool = True,
                 upto: int | None = None) -> None:
        super().__init__()
        self.ops: list[tuple] = []  # (op, input fingerprints, arguments, output fingerprints)
        self.reused: list[bool] = []  # per op: an input's fingerprint came from the cache
        self.first, self.cached, self.upto = first, cached, upto
        self.found: dict[str, Any] | None = None
        self.at: int | None = None  # the index of the op found
        self.hits = 0  # fingerprints taken from the cache
        self.made = WeakIdKeyDictionary()  # tensors an op of this run returned
        self.fingerprints = WeakIdKeyDictionary()  # tensor -> (its version, its fingerprint)
        self.modules: list[str] = []  # the module calls running now, innermost last
        self.phase = "forward"
        self.micro_batch = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.found is not None or (self.upto is not None and len(self.ops) >= self.upto):
            return func(*args, **kwargs)
        leaves = tree_leaves((args, kwargs))
        tensors = [a for a in leaves if isinstance(a, torch.Tensor)]
        hits = self.hits
        ins = tuple(self._fingerprint(a) for a in tensors)
        self.reused.append(self.hits > hits)
        given = tuple(repr(a) for a in leaves if isinstance(a, (bool, int, float, complex)))
        # (before the op: lift_fresh returns the very tensor torch.from_numpy made)
        made = [t in self.made for t in tensors] if self.first is not None else []
        out = func(*args, **kwargs)
        outs = tree_leaves(out)
        for t in outs:
            if isinstance(t, torch.Tensor):
                self.made[t] = True
        here = (str(func.overloadpacket), ins, given,
                tuple(self._fingerprint(t) if isinstance(t, torch.Tensor) else repr(t)
                      for t in outs))
        if self.first is not None:
            self._compare(here, tensors, made, any(isinstance(a, torch.Generator) for a in leaves))
        self.ops.append(here)
        return out

    def _fingerprint(self, t: torch.Tensor) -> tuple:
        """:func:`fingerprint`, once per tensor and version: a weight that op after op reads,
        an output the next op takes."""
        if not self.cached:
            return fingerprint(t)
        try:
            now = version(t)
        except RuntimeError:  # (an inference tensor keeps no version)
            return fingerprint(t)
        kept = self.fingerprints.get(t)
        if kept is None or kept[0] != now:
            kept = self.fingerprints[t] = (now, fingerprint(t))
        else:
            self.hits += 1
        return kept[1]

    def _compare(self, here: tuple, tensors: list[torch.Tensor], made: list[bool],
                 drew: bool) -> None:
        i = len(self.ops)
        if i < len(self.first) and self.first[i] == here:
            return
        there = self.first[i] if i < len(self.first) else None
        if there is None or there[0] != here[0] or len(there[1]) != len(here[1]):
            why, detail = "path", {"first_ran": there[0] if there else None}
        elif there[1] != here[1]:
            k = next(j for j, (a, b) in enumerate(zip(there[1], here[1])) if a != b)
            why, detail = ("inputs" if made[k] else "outside"), {"input": k}
        elif there[2] != here[2]:
            why, detail = "arguments", {"arguments": [[a, b] for a, b in zip(there[2], here[2])
                                                      if a != b]}
        else:  # (an op given a generator drew from it: the generator is why, not the op)
            why, detail = ("generator" if drew else "op"), {}
        node, self.at = running_node(), i
        self.found = {
            "op": here[0], "why": why, "phase": "backward" if node is not None else self.phase,
            "module": self.modules[-1] if self.modules else None,
            "node": type(node).__name__ if node is not None else None,
            "micro_batch": self.micro_batch, "source": user_source(),
            "device": next((t.device.type for t in tensors), None), **detail}


def first_divergence(runner) -> dict[str, Any] | None:
    """Where two more re-runs of ``runner``'s step first part ways (see the module's
    docstring), or None when they agree throughout (nondeterminism that comes and goes)."""
    first = _traced(runner, None)
    if not first.ops or (second := _traced(runner, first.ops)).found is None:
        return None
    found, at = second.found, second.at
    if found["why"] == "op" and (first.reused[at:at + 1] == [True] or second.reused[at]):
        # (a cached input may be stale: written where no version counts it) checked afresh
        again = _traced(runner, None, cached=False, upto=at + 1)
        if (fresh := _traced(runner, again.ops, cached=False, upto=at + 1)).found is not None:
            found = fresh.found
    return {**found, "micro_batches": len(runner.step.micro_batches)}


def rounding_only(report: dict[str, Any], run1, run2, runner) -> bool:
    """Two re-runs that differ in rounding only (``Run.same_but_rounding``), where an op
    itself is not deterministic (a CUDA kernel's atomic adds, a custom op summing in thread
    order): they agree on every non-finite value and its rows, so what either shows of the
    event holds for both. Said in ``report`` (``diverged``, a note) when so."""
    if not run1.same_but_rounding(run2):  # (the calls, rows, min and max: no sums taken)
        return False
    runner.digest_sums = True  # (two more, with the finite sums that tell rounding apart)
    try:
        again = runner.run(), runner.run()
    finally:
        runner.digest_sums = False
    if not again[0].same_but_rounding(again[1]):
        return False
    found = first_divergence(runner)
    if found is None or found["why"] != "op":
        return False
    report["diverged"] = found
    report["problems"].append(_rounding_note(found))
    return True


def _rounding_note(d: dict[str, Any]) -> str:
    return ("the two re-runs differ in rounding only: "
            + divergence_sentence(d).removeprefix("the first op whose result differed between "
                                                  "two re-runs is ")
            + "; they agree on every non-finite value and its rows, so the origin below holds "
            "for both (a deterministic kernel, torch.use_deterministic_algorithms(True), "
            "makes the step reproducible bit for bit)")


def _traced(runner, first: list | None, cached: bool = True, upto: int | None = None) -> _Trace:
    trace = _Trace(first, cached, upto)

    @contextlib.contextmanager
    def phase(name: str):
        trace.phase, trace.micro_batch = name, runner.micro_batch
        with trace:
            yield

    try:
        runner.run(instrument=False, hooks=lambda model: call_stack_hooks(model, trace.modules), forward_ctx=lambda: phase("forward"),
                   backward_ctx=lambda: phase("backward"))
    except Exception:  # (a re-run the traced ops made fail: the report stands without it)
        trace.found = None
    return trace


def divergence_place(d: dict[str, Any]) -> str:
    """Where ``d`` (:func:`first_divergence`) parted: the op, its line, module or backward
    node, and micro-batch."""
    where = d["op"] + (f" at {d['source']}" if d.get("source") else "")
    if d["phase"] == "backward":
        where += " in the backward" + (f" ({d['node']})" if d.get("node") else "")
    elif d.get("module") is not None:
        where += f" in {d['module'] or '<root>'}"
    else:
        where += " in the loss"
    if d.get("micro_batches", 1) > 1:
        where += f", micro-batch {d['micro_batch']}"
    return where


def divergence_sentence(d: dict[str, Any]) -> str:
    """``d`` (:func:`first_divergence`) as the report's note."""
    where, why = divergence_place(d), d["why"]
    if why == "path":
        return (f"the two re-runs took different paths: at the op where the first re-run ran "
                f"{d.get('first_ran')}, the second ran {where}; every op before agreed")
    if why == "arguments":
        vals = "; ".join(f"{a} then {b}" for a, b in d["arguments"][:3])
        return (f"the first op whose result differed between two re-runs is {where}: its "
                f"tensors were the same, its Python arguments were not ({vals})")
    if why == "outside":
        return (f"the first op whose result differed between two re-runs is {where}: its "
                f"input {d['input']} differed, a tensor no torch op of the step made")
    if why == "inputs":
        return (f"the first op whose result differed between two re-runs is {where}: its "
                f"input {d['input']} differed, a tensor an op of the step made and something "
                "wrote since where no torch op was seen (NumPy through .numpy() or a "
                "torch.from_numpy array, a write through .data or untyped_storage())")
    if why == "generator":
        return (f"the first op whose result differed between two re-runs is {where}: the same "
                f"inputs drew other values from the torch.Generator it was given")
    return (f"the first op whose result differed between two re-runs is {where}: the same "
            f"inputs gave another result")


def divergence_hint(d: dict[str, Any]) -> str:
    """What to do about ``d``: where the nondeterminism enters, and how to remove it."""
    op, why = d["op"].removeprefix("aten."), d["why"]
    if why == "inputs":
        return ("the step writes a tensor behind torch's back (through t.numpy(), a "
                "torch.from_numpy array or t.data) with values from state that changes at "
                "each call (numpy.random.default_rng() made at each call, the clock), so no "
                "re-run computes what the run did: draw those values with torch ops from "
                "torch's generator, or from a generator the model keeps, which the bundle holds")
    if why == "generator":
        return (f"{d['op']} draws from a torch.Generator the bundle does not hold (made at each "
                "call, or kept elsewhere than on the model, the loss or the Python module "
                "defining their classes), so each re-run draws anew: keep the generator as an "
                "attribute of a module, or draw from torch's global generator, which the "
                "bundle holds")
    if why in ("arguments", "outside", "path"):
        return ("the step computes with a value made outside torch from state that changes "
                "at each call (a global or closure the step updates; a random generator the "
                "bundle does not hold: numpy.random.default_rng() or random.Random() made at "
                "each call, or kept elsewhere than on the model, the loss or the Python module "
                "defining their classes; the clock), so no re-run computes what the run did: "
                "keep such state in a module attribute or buffer, and draw from torch's "
                "generator or one the model keeps, which the bundle holds")
    if op in _NOT_UNIQUE:
        return (f"{d['op']} has no unique answer for this input (repeated or zero singular "
                "values or eigenvalues: any basis of their subspace is valid), and which one "
                "LAPACK returns depends on the path its kernel takes: use only what is unique "
                "(the values, a projector U U^T, the solution of a well-posed system) or keep "
                "the input well-conditioned (full rank, distinct values)")
    if not d["op"].startswith(("aten.", "prims.")):
        return (f"{d['op']}, a custom op, computes with something its inputs do not hold (a "
                "random generator of its own, uninitialised memory, the order its threads "
                "run): give it its randomness as an input (a torch.Generator, a seed tensor) "
                "so that the same inputs give the same result")
    if d.get("device") == "cuda":
        return (f"{d['op']} runs a CUDA kernel that accumulates in the order its threads run; "
                "torch.use_deterministic_algorithms(True) makes torch use a deterministic "
                "kernel, or raise where it has none")
    return (f"{d['op']} is not deterministic on {d.get('device') or 'this device'}; "
            "torch.use_deterministic_algorithms(True) makes torch use a deterministic "
            "kernel, or raise where it has none")

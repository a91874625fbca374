"""How a step's parts become bundle entries (JSON plus tensors by key): a micro-batch, the
hyper-parameters of a parameter group, JSON-able values. One encoding for the event step
(:mod:`recorder.snapshot`) and the rewind window's steps (:mod:`recorder.rewind`), so the
replay reads both the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .capture import flatten_tree, tensor_leaves
from .chunks import sliced_rows
from .compat import grad_hooks
from .lossdesc import defined_at
from .rng import rng_drawn, rng_to_bundle
from .target import LOSS_PREFIX

Named = Callable[[], dict[int, str]]  # objects of the model by id, named


def named_params(params: list[tuple[str, torch.Tensor]]) -> Named:
    """The recorded ``(name, parameter)`` list by id, named, when asked (a loss given one
    itself is bundled so); the loss module's left out, which the replay rebuilds with it."""
    return lambda: {id(p): n for n, p in params if not n.startswith(LOSS_PREFIX)}


def json_scalar(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def jsonish(v: Any) -> bool:
    if json_scalar(v):
        return True
    return isinstance(v, (list, tuple)) and all(jsonish(x) for x in v)


def hyper_entry(h: dict[str, Any], prefix: str, tensors: dict[str, torch.Tensor],
                entry: dict[str, Any] | None = None) -> dict[str, Any]:
    """A parameter group's hyper-parameters (``params`` left out) as JSON; a tensor value (a
    learning rate a scheduler keeps as a tensor) goes into ``tensors`` as ``<prefix>/<key>``."""
    out: dict[str, Any] = entry if entry is not None else {}
    for k, v in h.items():
        if k == "params":
            continue
        if isinstance(v, torch.Tensor):
            tensors[f"{prefix}/{k}"] = v.detach()
            out[k] = {"$t": f"{prefix}/{k}"}
        elif jsonish(v):
            out[k] = list(v) if isinstance(v, tuple) else v
        else:
            out[k] = {"$repr": repr(v)[:200]}
    return out


# the micro-batch's marks, written as ``true`` when set (see docs/bundle-format.md)
_FLAGS = ("grads_dropped", "inputs_written", "inputs_changed", "targets_changed", "weights_moved",
          "differentiated", "taken_again")


def micro_batch_entry(prefix: str, i: int, mb, tensors: dict[str, torch.Tensor],
                      earlier: list | tuple = (), modules: Named | None = None,
                      params: Named | None = None) -> dict[str, Any]:
    """Micro-batch ``i`` of a tape as the bundle's ``micro_batches[i]`` entry, its tensors
    under ``<prefix>batch/<i>``, ``<prefix>loss_in/<i>`` and ``<prefix>outgrad/<i>`` (``prefix``
    is ``""`` for the event step); ``earlier``: the micro-batches before it, whose outputs its
    loss may take too (two views of a batch through one encoder, one contrastive loss);
    ``modules()``, ``params()``: the recorded model's modules, parameters by id, named (a loss
    given the model itself, or a parameter: asked only when a loss argument is one)."""
    tree, ts, paths = flatten_tree([list(mb.args), mb.kwargs], f"{prefix}batch/{i}")
    tensors.update(ts)
    out: dict[str, Any] = {"inputs": tree, "paths": paths, "grad_enabled": mb.grad_enabled,
                           "training": mb.training, "autocast": mb.autocast}
    # inputs the loop made require grad (a PINN's collocation points, differentiated by the
    # loss with autograd.grad): the replay's copies must too
    if grad_inputs := [k for k, t in ts.items() if t.requires_grad]:
        out["grad_inputs"] = grad_inputs
        # (of those, another network's output, not a leaf the loop trains: G's images to D)
        if graph_inputs := [k for k in grad_inputs if ts[k].grad_fn is not None]:
            out["graph_inputs"] = graph_inputs
    for flag in _FLAGS:  # (each present as true only)
        if getattr(mb, flag):
            out[flag] = True
    if rows := sliced_rows(ts):  # (a chunk of the loader's batch: GradCache, x.split(k))
        out["rows_of"] = rows
    if mb.rng is not None:
        before = next((m.rng for m in reversed(earlier) if m.rng is not None), None)
        out["rng"] = _rng_entry(rng_drawn(mb.rng, before), f"{prefix}rng/mb/{i}/", tensors)
    outs = list(tensor_leaves(mb.outputs))
    if mb.loss_args is not None:
        ltree, lts, lpaths = flatten_tree([list(mb.loss_args), mb.loss_kwargs or {}],
                                          f"{prefix}loss_in/{i}", leaf=partial_leaf(
                                              outs, [list(tensor_leaves(m.outputs))
                                                     for m in earlier], ts, params),
                                          whole=_whole_output(mb, earlier, modules))
        tensors.update(lts)
        out["loss_inputs"], out["loss_paths"] = ltree, lpaths
        # arguments with an autograd graph that are not the model's output (a KL the loop
        # computed from the weights, model.kl()): the replay holds their values only (the
        # event's bundle keeps those made from the weights: recorder.snapshot)
        if grad_args := [k for k, t in lts.items() if t.requires_grad]:
            out["loss_grad_args"] = grad_args
        if mb.loss_autocast is not None:
            out["loss_autocast"] = mb.loss_autocast
    grads = {}
    for j, g in mb.out_grads.items():
        key = f"{prefix}outgrad/{i}/{j}"
        tensors[key] = g.detach()
        grads[str(j)] = key
    out["output_grads"] = grads
    out["n_outputs"] = len(outs)
    if sites := _output_hooks(outs):
        out["output_hooks"] = sites
    return out


def _output_hooks(outs: list[torch.Tensor]) -> list[str]:
    """Where the gradient hooks the loop put on the root output are defined
    (``out.register_hook(fn)``: an edit of the gradient the loss gave, which the recorded
    output gradient went through and the replay cannot re-run); the recorder's own skipped."""
    fns = [h for t in outs if isinstance(t, torch.Tensor) for h in grad_hooks(t)
           if not getattr(getattr(h, "func", h), "__module__", "").startswith("recorder.")]
    return [defined_at(getattr(h, "func", h)) or type(h).__name__ for h in fns]


def _rng_entry(state: dict[str, Any], prefix: str, tensors: dict[str, torch.Tensor]
               ) -> dict[str, Any]:
    """RNG states as ``{"meta", "keys"}``: their JSON and, by their name in the step's own
    ``rng/`` (``torch_cpu``, ``cuda/0``), the keys of their tensors under ``prefix``. Only
    the generators that drew since the micro-batch before are given (``rng_drawn``)."""
    meta, ts = rng_to_bundle(state)
    keys = {}
    for k, v in ts.items():
        name = k.removeprefix("rng/")
        tensors[prefix + name] = v
        keys[name] = prefix + name
    return {"meta": meta, "keys": keys}


def partial_leaf(outs: list[torch.Tensor], earlier: list[list[torch.Tensor]] = (),
                 inputs: dict[str, torch.Tensor] | None = None,
                 params: Named | None = None):
    """Stand-in for loss inputs that are the model output, a view of it or a cast of it to
    another dtype, so the replay feeds the loss its own re-computed output instead of a
    recorded copy: ``{"$out": j}``, with ``"mb": k`` for an output of the step's earlier
    micro-batch ``k`` (``earlier``); ``{"$in": key}`` for the micro-batch's own input tensor
    under ``key`` of ``inputs`` (a loss differentiating the output with respect to it needs
    the very tensor the re-run's forward took); ``{"$param": name}`` for a parameter of the
    model (``params()``) given to the loss itself (an image the optimizer trains as the model's
    parameter, whose total-variation prior the loss takes: a copy would cut that path)."""
    sources = [(None, outs), *((k, o) for k, o in reversed(list(enumerate(earlier))))]
    own = {id(t): key for key, t in (inputs or {}).items()}

    def leaf(t: torch.Tensor):
        for k, group in sources:
            for i, o in enumerate(group):
                if t is o:
                    return _out_ref(i, k)
        if (key := own.get(id(t))) is not None and inputs[key] is t:
            return {"$in": key}
        if params is not None and isinstance(t, torch.nn.Parameter) \
                and (name := params().get(id(t))) is not None:
            return {"$param": name}
        for k, group in sources:
            for i, o in enumerate(group):
                if (t.device == o.device and t.dtype == o.dtype
                        and t.untyped_storage().data_ptr() == o.untyped_storage().data_ptr()):
                    # "of": the output's shape, so the replay tells a reshape of the whole
                    # output from a slice of it (emb[0] of a (3, B, D) output)
                    return {**_out_ref(i, k), "view": [list(t.shape), list(t.stride()),
                                                       t.storage_offset() - o.storage_offset()],
                            "of": list(o.shape)}
        fn = t.grad_fn
        for k, group in sources:
            for i, o in enumerate(group):
                # a cast of the output (model(x).float() in a half-precision loop): a recorded
                # copy would feed a re-run with another dtype, lr or batch the recorded values
                if (fn is not None and o.grad_fn is not None and t.shape == o.shape
                        and type(fn).__name__ == "ToCopyBackward0" and t.device == o.device
                        and fn.next_functions and fn.next_functions[0][0] is o.grad_fn):
                    return {**_out_ref(i, k), "dtype": str(t.dtype).removeprefix("torch.")}
        return None

    return leaf


def _whole_output(mb, earlier, modules: Callable[[], dict[int, str]] | None = None):
    """Stand-in for a loss argument that is a model output as a whole, or an item of its
    tuple, list or dict, when that is an object the bundle cannot hold (a
    ``torch.distributions`` object, whose loss is its ``log_prob``; a VAE's ``(px, qz)``
    pair): ``{"$output": true}``, with ``"mb": k`` for micro-batch ``k``'s and ``"path"``:
    the keys from the output to the item. A loss argument that is the recorded model or one
    of its modules (FedProx's or EWC's ``loss_fn(out, y, model)``, comparing its parameters
    with a copy) is ``{"$module": name}`` (``""``: the root), which the replay's model stands
    in for."""
    def whole(o):
        if modules is not None and isinstance(o, torch.nn.Module) \
                and (name := modules().get(id(o))) is not None:
            return {"$module": name}
        for k, m in [(None, mb), *enumerate(earlier)]:
            if (path := _path_to(o, m.outputs)) is not None:
                return {"$output": True, **({} if k is None else {"mb": k}),
                        **({"path": path} if path else {})}
        return None
    return whole


def _path_to(o: Any, tree: Any, depth: int = 0) -> list | None:
    """The keys (indices, string keys) from ``tree`` to the very object ``o``, or None."""
    if o is tree:
        return []
    if depth >= 4:
        return None
    items = enumerate(tree) if isinstance(tree, (list, tuple)) else \
        tree.items() if isinstance(tree, dict) else ()
    for key, v in items:
        if isinstance(key, (int, str)) and (path := _path_to(o, v, depth + 1)) is not None:
            return [key, *path]
    return None


def _out_ref(i: int, mb: int | None) -> dict[str, int]:
    return {"$out": i} if mb is None else {"$out": i, "mb": mb}

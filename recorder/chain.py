"""Where a forward event's chain started, from a step's decoded module calls: the first call
that made a non-finite value from finite inputs, the own code of a call enclosing it, or the
batch (see :func:`chain_origin`). Slow path only, as :mod:`recorder.events`."""

from __future__ import annotations


def chain_origin(by_order: list[dict], allowed: set[int], names: list[str],
                  masked: set[int] = frozenset(), rewritten: set[int] = frozenset()):
    """The call that started a forward event by the default policy (``strict_inf=False``),
    from decoded calls in completion order, and whether the chain started in the batch (the
    call is then the root call whose inputs held the infinity); (None, False): no forward
    event.

    The event itself is the first NaN made from NaN-free inputs (else the first NaN), or else a
    +-Inf in the root output. Its chain starts at the first call, inside it (completed before
    it), that made a non-finite value from finite inputs; when the event's own inputs held
    +-Inf, at the first call of its micro-batch before it that made +-Inf from finite inputs
    (an fp16 overflow that a later layer turns into NaN; a mask's or an allowed buffer's
    intended -inf among them counts as finite), else, when no call made them, at the
    innermost call enclosing the event whose inputs were finite (its own code made them:
    ``log(0)`` in the root's forward before a submodule), else at the batch's own infinities,
    unless all of them are additive masks (micro-batches in ``masked``): intended, as a
    literal -inf fill is, so the event is the call that made the NaN from them.
    ``allow_inf`` modules never start a chain: their infinities are intended. A call of a
    module in ``rewritten`` (a forward pre-hook of the user's returns its inputs) whose inputs
    held a value no call made, the first of the event's micro-batch, is where it was made:
    its pre-hook's own code, which runs before any recorder hook sees the call."""
    nan = [d for d in by_order if d["nan"]]
    made = [d for d in nan if d["inputs_nan_free"]]
    trigger = made[0] if made else (nan[0] if nan else None)
    if trigger is None:
        trigger = next((d for d in by_order if d["module"] == 0 and not d["outputs_finite"]
                        and 0 not in allowed), None)
    if trigger is None:
        return None, False
    mb, pos = trigger["micro_batch"], by_order.index(trigger)
    # (inputs finite but for the intended infinities of masks and allowed buffers: an
    # attention given its causal mask whose projection overflowed made the first +-Inf)
    before = [d for d in by_order[:pos] if d["micro_batch"] == mb
              and not d["outputs_finite"] and d["inputs_finite"]
              and d["module"] not in allowed]
    if trigger["inputs_all_finite"]:
        # inside it: calls of its submodules since its previous call completed
        prev = max((i for i, d in enumerate(by_order[:pos]) if d["module"] == trigger["module"]
                    and d["micro_batch"] == mb), default=-1)
        own = names[trigger["module"]]
        inside = [d for d in before if by_order.index(d) > prev
                  and (own == "" or names[d["module"]].startswith(own + "."))]
        return (inside[0] if inside else trigger), False
    infs = [d for d in before if not d["nan"]]
    if infs:
        return infs[0], False
    if not trigger["inputs_finite"]:
        # no call made that infinity: a pre-hook rewriting a call's inputs did, or the own
        # code of a call enclosing the event, between its children's calls (the root's too)
        maker = next((d for d in by_order[:pos + 1] if d["micro_batch"] == mb
                      and d["module"] in rewritten and not d["inputs_finite"]), None) \
            or enclosing_maker(by_order, pos, names)
        if maker is not None:
            return maker, False
    root = next((d for d in by_order if d["module"] == 0 and d["micro_batch"] == mb
                 and not d["inputs_all_finite"]), None)
    if mb in masked:  # a -inf mask passed in: softmax of an all -inf row made the NaN
        return trigger, False
    return (root, True) if root is not None else (trigger, False)


def enclosing_maker(by_order: list[dict], pos: int, names: list[str]) -> dict | None:
    """The innermost call enclosing call ``by_order[pos]`` whose inputs were finite (a mask's
    intended -inf aside: a transformer layer's own residual sum): the
    calls of its micro-batch completed after it whose module contains it by name (the root
    contains every module), innermost first."""
    d = by_order[pos]
    mb, inner = d["micro_batch"], names[d["module"]]
    for e in by_order[pos + 1:]:
        own = names[e["module"]]
        if e["micro_batch"] != mb or not (own == "" or inner.startswith(own + ".")):
            continue
        if e["inputs_finite"] if e["module"] else e["inputs_all_finite"]:  # (root: masks)
            return e
        inner = own  # (its own inputs held the infinity: further out)
    return None


def returned_infinity(evaluation: bool, has_loss: bool, calls: list[dict]) -> bool:
    """By the default policy, the forward of an evaluation between steps (no loss, no update
    follows) made +-Inf and no NaN: the scores a filtered ranking evaluation sets to -inf
    (LibKGE's known triples), handed back to the caller, which ranks them; no event. In
    training the loss takes the root output, so its infinity matters; here nothing does."""
    return evaluation and not has_loss and not any(d["nan"] for d in calls)

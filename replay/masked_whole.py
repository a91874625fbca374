"""A softmax made NaN on rows that a mask argument of its module call masked whole.

An attention given a padding mask (``nn.MultiheadAttention``'s ``key_padding_mask``, True
where a key is ignored) whose every entry is True for some samples has no key left for
them, and its softmax is NaN there. The generic advice (keep a key per row, or fill with a
finite number) does not say which argument did it, nor the usual reason in set prediction
and NLP: a mask of the other convention (1 = keep: Hugging Face's ``attention_mask`` and
``pixel_mask``) passed as a padding mask, which masks every sample without padding whole.
:func:`masked_whole_hint` names the argument (read on one forward of the origin's call); or
the padding mask and the attention mask that leave some query positions no key together
(a causal mask over left-padded sequences: the padded positions before a sample's first item);
or, in a module called once per decoding step, a mask that left those samples positions open
at the module's first call and grew to cover them (a pointer network's positions already
chosen, beside the padding of a sample shorter than the batch's longest, decoded past its
length): not a convention, no empty sample.
"""

from __future__ import annotations

import inspect

import torch

from .errors import StopRun
from .recorded import batch_size
from .rerun import Runner

__all__ = ["masked_whole_hint"]


def masked_whole_hint(runner: Runner, origin, hint: str | None, rows) -> str | None:
    """``hint`` with the mask argument of the origin's module call that is True (or 1) at
    every position of the samples ``rows``, where the hint says a fully masked row made the
    NaN; else None."""
    if hint is None or "(a fully masked row)" not in hint or not rows or runner.model is None:
        return None
    try:
        module = runner.model.get_submodule(origin.module or "")
    except AttributeError:
        return None
    named, first = _call_arguments(runner, origin, module)
    for name, t in named.items():
        if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.is_floating_point() \
                or max(rows) >= t.shape[0] or bool(((t != 0) & (t != 1)).any()):
            continue
        whole = t[rows].flatten(1).all(1)
        if bool(whole.all()) and not bool(t.flatten(1).all(1).all()):
            if grown := _grown(hint, name, t, first.get(name), rows, origin.call):
                return grown
            return (f"{hint}; {name} is True (masked) at every position of samples {rows}, "
                    "and not of the others: if those samples hold no padding, the mask has "
                    "the other convention (1 = keep: Hugging Face's attention_mask and "
                    "pixel_mask) and must be inverted (~mask.bool()); if they are padding "
                    "only (an empty image or sequence), leave them out of the batch")
    every = rows == list(range(batch_size(runner.step, origin.micro_batch or 0)))
    return _masked_together(hint, named, rows) or (
        _masked_queries(hint, named, rows) if every else None)


def _grown(hint: str, name: str, t: torch.Tensor, first, rows, call: int) -> str | None:
    """``hint`` with the mask ``name`` of a later call of the module (``call``) that covers
    every position of ``rows`` where its value at the module's first call (``first``) left
    each of them some positions open and masked nothing it no longer masks: a decoding loop's
    mask of the positions already chosen, grown past a shorter sample's length; else None."""
    if not call or not isinstance(first, torch.Tensor) or first.shape != t.shape:
        return None
    was, now = first.bool()[rows].flatten(1), t.bool()[rows].flatten(1)
    if bool(was.all(1).any()) or bool((was & ~now).any()):
        return None
    open_ = sorted({int(n) for n in (~was).sum(1)})
    return (f"{hint}; {name} grew over the calls of this module in one forward: at its first "
            f"call it left samples {rows} {' or '.join(map(str, open_))} position(s) open, by "
            f"call {call} none (a decoding loop masking the positions already chosen, beside "
            "the padding of samples shorter than the batch's longest: decoded past their "
            "length, not a mask of the other convention nor an empty sample): stop decoding "
            "each sample at its own length (leave a position open, or an end-of-sequence "
            "position, at its later steps, whose outputs the loss ignores), or mask with "
            "torch.finfo(dtype).min instead of -inf")


def _masked_together(hint: str, named: dict, rows) -> str | None:
    """``hint`` with the padding mask ``(B, L)`` and the attention mask ``(L, L)`` of the call
    that leave no key to some query positions of the samples ``rows`` together, neither
    alone: SASRec's causal mask over left-padded sequences with the padding as
    ``key_padding_mask`` (a padded position sees only the padding before it)."""
    two = {n: t for n, t in named.items() if isinstance(t, torch.Tensor) and t.dim() == 2}
    for pn, pad in two.items():
        for an, att in two.items():
            if an == pn or pad.is_floating_point() or max(rows) >= pad.shape[0] \
                    or att.shape != (pad.shape[1],) * 2:
                continue
            blocked = torch.isneginf(att) if att.is_floating_point() else att.bool()
            dead = (blocked | pad.bool()[:, None, :]).all(-1)  # (B, queries): no key left
            if bool(blocked.all(-1).any()) or not bool(dead[rows].any(1).all()) \
                    or bool(pad.bool()[rows].all(1).any()):
                continue
            own = "; each such query position is padding itself" \
                if bool(pad.bool()[dead].all()) else ""
            return (f"{hint}; {pn} and {an} together mask every key of {int(dead.sum())} "
                    f"query positions of samples {rows}, neither alone{own} (under a causal "
                    "mask a left-padded position sees only the padding before it). The model "
                    "means to drop those positions' outputs, but 0 * NaN is NaN: leave the "
                    "padding to the causal mask and zero the padded outputs after the "
                    "attention (SASRec's timeline mask), give the masks as one float mask "
                    "of a large finite negative number (RecBole's -10000) instead of "
                    "True or -inf, or pad on the right")
    return None


def _masked_queries(hint: str, named: dict, rows) -> str | None:
    """``hint`` with the attention mask ``(L, S)`` of the call, shared by every sample, that
    alone masks every key of some query positions (True, or -inf in a float mask), so every
    sample's softmax is NaN there, whatever the data (the caller checked that ``rows`` is the
    whole batch): a causal mask built to mask the diagonal too (``triu(ones, diagonal=0)``),
    whose first query sees no key. Not a padding mask ``(B, S)``, whose masked rows would be
    the NaN samples themselves."""
    head = hint[:hint.index("(a fully masked row)") + len("(a fully masked row)")]
    for name, t in named.items():
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.numel() == 0 \
                or not (t.dtype is torch.bool or t.is_floating_point()):
            continue  # (a mask is bool or additive: ids, a ColBERT's d_ids, are none)
        blocked = torch.isneginf(t) if t.is_floating_point() else t.bool()
        if t.is_floating_point() and not bool((torch.isfinite(t) | blocked).all()):
            continue
        dead = [int(i) for i in blocked.all(-1).nonzero().flatten()]
        if not dead or len(dead) == t.shape[0] or set(dead) == set(rows):
            continue
        square = t.shape[0] == t.shape[1]
        upper = torch.ones_like(blocked).triu()
        if square and bool((blocked == upper).all()):
            return (f"{head}: {name} masks every key of query position 0 in every sample, "
                    "whatever the data: it is a causal mask that masks the diagonal too "
                    "(triu(ones, diagonal=0)), each position hidden from itself, which leaves "
                    "the first query no key. Build it with diagonal=1 (True above the "
                    "diagonal only) or nn.Transformer.generate_square_subsequent_mask(T); a "
                    "finite fill instead of -inf would hide it, that query then attending "
                    "evenly to keys it must not see")
        if t.shape[0] == len(rows):  # (one row per sample: a padding mask, not queries)
            continue
        return (f"{head}: {name}, one mask shared by every sample, masks every key of query "
                f"positions {dead}, so every sample has no key there whatever the data: the "
                "mask is built wrong, not the batch; leave each query position at least one "
                "key (its own)")
    return None


def _call_arguments(runner: Runner, origin, module) -> tuple[dict, dict]:
    """The origin call's arguments by parameter name, and the module's first call's (in the
    origin's micro-batch; tensors copied: the loop may write a mask in place), from one
    forward, stopped at the origin's call."""
    state: dict = {"calls": 0, "named": {}, "first": {}}

    def pre(m, args, kwargs):
        if runner.micro_batch != origin.micro_batch:
            return
        try:
            named = dict(inspect.signature(m.forward).bind(*args, **kwargs).arguments)
        except TypeError:
            named = dict(kwargs)
        if state["calls"] == 0:
            state["first"] = {n: v.detach().clone() if isinstance(v, torch.Tensor) else v
                              for n, v in named.items()}
        if state["calls"] == origin.call:
            state["named"] = named
            raise StopRun
        state["calls"] += 1

    try:
        runner.run(backward=False, instrument=False, hooks=lambda model: [
            module.register_forward_pre_hook(pre, with_kwargs=True)])
    except Exception:  # (the arguments help the hint; the hint stands without them)
        return {}, {}
    return state["named"], state["first"]

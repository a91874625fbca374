"""The other names of a tied parameter the report blames. The bundle holds a tensor the model
reaches under two names (``lm_head.weight = tok_emb.weight``) once, under the name
``named_parameters()`` gives it first (``recorder.tied``), so the report named it by that name
alone: a NaN the loop wrote into ``lm_head.weight``, read by ``lm_head``, was "parameter
tok_emb.weight", a name the user never wrote and the reading module does not use. The origin
now lists the aliases (``aliases``) and, where the module that read it holds it under an alias,
that name (``read_as``)."""

from __future__ import annotations

from typing import Any

from recorder.tied import aliases_of, tied_words

from .load import Step


def aliases(step: Step, name: str) -> list[str]:
    """The other names of parameter ``name`` (its first name or an alias) in the run."""
    tied = step.meta.get("tied_params")
    if not isinstance(tied, dict) or not isinstance(name, str):
        return []
    return aliases_of(tied, name)


def read_as(name: str, others: list[str], module: Any) -> str | None:
    """The alias that ``module`` (the reader's name, ``""`` for the root) holds the tensor
    as, when it is not ``name`` itself: the name its code reads."""
    if not isinstance(module, str) or not module:
        return None

    def owned(n: str) -> bool:
        return n.rpartition(".")[0] == module

    return None if owned(name) else next((a for a in others if owned(a)), None)


def annotate(step: Step, report: dict[str, Any]) -> None:
    """Add ``aliases`` (and ``read_as``) to the origin when its parameter is tied."""
    o = report.get("origin") or {}
    name = o.get("param") or next(iter(o.get("params") or ()), None)
    others = aliases(step, name)
    if not others:
        return
    o["aliases"] = others
    if o.get("phase") == "weights" and (alias := read_as(name, others, o.get("module"))):
        o["read_as"] = alias


def tied_text(o: dict[str, Any]) -> str:
    """The words after the first parameter's name: `` (one tensor with lm_head.weight)``."""
    return tied_words(o.get("aliases") or [])

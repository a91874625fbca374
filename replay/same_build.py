"""A call whose values differ from the recording although the factory builds every recorded
module, of its recorded class, with the attributes the run had: it likely ran with weights
other than the module's own (``torch.func.functional_call`` of a MAML inner loop's adapted
weights), said instead of "the factory builds a different model" (:mod:`replay.fidelity`)."""

from __future__ import annotations

from .load import Step

SAME_BUILD = (
    "the factory builds the recorded modules (each of its recorded class, with the attributes "
    "the run had), yet this call's values differ: it likely ran with weights other than the "
    "module's own, passed in by torch.func.functional_call (a MAML inner loop's p - lr * g, "
    "its own forwards under torch.func.grad, which are not recorded: the bundle holds the "
    "weights before adaptation), which the replay cannot re-run; else the factory's code "
    "computes otherwise (run-time configuration: pass it with factory_kwargs)")


def same_build(step: Step) -> bool:
    """Whether the factory's model has every recorded module under its name, of its recorded
    class, with the plain attributes the run had (no ``built_otherwise``): the factory then
    builds the recorded modules, and a call whose values differ may have run with weights
    other than its own (``torch.func.functional_call``)."""
    model, recorded = step.model, step.meta.get("modules") or []
    if model is None or not recorded or step.built_otherwise:
        return False
    built = {n: f"{type(m).__module__}.{type(m).__qualname__}" for n, m in model.named_modules()}
    return all(built.get(m.get("name")) == m.get("type") for m in recorded)

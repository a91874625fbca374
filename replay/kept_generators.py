"""The recorded states of the generators the model and loss keep (``recorder.rng``), set back
only into a rebuilt generator of the same kind: code edited since the run (``self.rng`` now a
NumPy generator where it was a ``torch.Generator``, a ``Philox`` where it was ``PCG64``) keeps
the factory's state, said in one note, instead of a state of another kind raising."""

from __future__ import annotations

import random
from typing import Any

import torch

from recorder.attributes import loss_objects
from recorder.rng import GENERATOR, generator_state, module_generators, restore_rng


def state_kind(state: Any) -> str | None:
    """What made a recorded generator state: ``torch.Generator``, ``random.Random``, ``NumPy
    PCG64`` (its bit generator); None for a state no generator of the recorder's writes."""
    if isinstance(state, torch.Tensor):
        return "torch.Generator"
    if isinstance(state, dict) and isinstance(state.get("random"), (list, tuple)):
        return "random.Random"
    np_state = state.get("numpy") if isinstance(state, dict) else None
    if isinstance(np_state, dict) and isinstance(np_state.get("bit_generator"), str):
        return f"NumPy {np_state['bit_generator']}"
    return None


def generator_kind(g: Any) -> str:
    """The kind :func:`state_kind` names for the states of generator ``g``."""
    if isinstance(g, torch.Generator):
        return "torch.Generator"
    if isinstance(g, random.Random):
        return "random.Random"
    return state_kind(generator_state(g)) or type(g).__name__


def same_kind(state: dict[str, Any], generators: dict[str, Any]) -> dict[str, Any]:
    """``generators`` (by name) less those whose recorded state in ``state`` is of another
    kind: they stay as the factory made them."""
    kept = {}
    for name, g in generators.items():
        recorded = state.get(GENERATOR + name)
        if recorded is None or state_kind(recorded) == generator_kind(g):
            kept[name] = g
    return kept


def own_generators(model: torch.nn.Module, loss) -> dict[str, Any]:
    """The rebuilt model's and loss module's own generators, by the recorder's names
    (``recorder.rng.module_generators`` over the model's modules and ``loss_objects``)."""
    return dict(module_generators([*model.named_modules(),
                                   *(loss_objects(loss) if loss is not None else [])]))


def restore_generators(state: dict[str, Any], generators: dict[str, Any]) -> None:
    """``restore_rng`` of ``state``, each of the model's generators only from a state of its
    own kind."""
    restore_rng(state, same_kind(state, generators))


def other_kinds(state: dict[str, Any] | None, generators: dict[str, Any]) -> list[str]:
    """The generators whose recorded state is of another kind than the rebuilt one's, each as
    ``name (recorded KIND, now KIND)``. (One the rebuilt model lacks is left out: the re-run's
    divergence, if it draws from it, is named where it happens.)"""
    if not state:
        return []
    return [f"{name} (recorded {state_kind(state.get(GENERATOR + name)) or 'unreadable'}, now "
            f"{generator_kind(g)})" for name, g in generators.items()
            if GENERATOR + name in state and name not in same_kind(state, {name: g})]


def other_kinds_note(odd: list[str]) -> str | None:
    """One note naming :func:`other_kinds`' generators, else None."""
    if not odd:
        return None
    return (f"the bundle's state of generator(s) {', '.join(odd[:3])} is not one the rebuilt "
            "model's generator takes: the re-run draws from it as the factory made it, so it "
            "may not draw what the run drew; replay with the code the bundle was recorded with")


def unrestored_hint(odd: list[str], where: str) -> str:
    """The hint of re-runs that part ways at ``where`` while :func:`other_kinds`' generators
    kept the factory's state: those generators, not the op, are why."""
    return (f"generator(s) {', '.join(odd[:3])} could not be set back from the bundle, as "
            f"the kinds differ: each re-run draws from it anew, so the re-runs part ways at "
            f"{where}, not because that op is nondeterministic; replay with a factory that "
            "builds the generator of the recorded kind (the code the bundle was recorded with)")


def model_generators(model, loss) -> dict[str, Any]:
    """The generators of the rebuilt model and loss module, by the recorder's names."""
    return dict(module_generators([*model.named_modules(), *(
        [("<loss>", loss)] if isinstance(loss, torch.nn.Module) else [])]))


def restored_loss_attributes(state: dict[str, Any] | None, loss) -> set[str]:
    """The loss module's generator attributes whose state the re-run sets from the bundle (so
    what the loss's construction made of them is not what the re-run draws)."""
    if not state or not isinstance(loss, torch.nn.Module):
        return set()
    own = dict(module_generators(loss_objects(loss)))
    return {n.removeprefix("<loss>.") for n in same_kind(state, own) if GENERATOR + n in state}

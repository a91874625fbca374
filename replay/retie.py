"""The run's tied parameters against the factory's model (``recorder.tied``): a factory that
builds the layers apart where the run had tied them (the script tied them after building the
model, or a flag the factory did not get), or ties what the run held apart. Loading the
bundle as is would compute something else than the run did, or stop on a weight the bundle
holds under the other name; the replay makes the model share what the run shared, and says
so."""

from __future__ import annotations

from torch import nn

_APART = "the factory's model ties "


def tie_as_recorded(step, model: nn.Module) -> None:
    """Give each alias the run tied (``meta["tied_params"]``) its first name's parameter, where
    the factory's model holds them apart (both names must be its parameters, alike in
    shape)."""
    tied = step.meta.get("tied_params")
    if not isinstance(tied, dict):
        return
    done = []
    for alias, src in tied.items():
        try:
            a, s = model.get_parameter(alias), model.get_parameter(src)
        except (AttributeError, TypeError):
            continue  # (not the model's: the load's own checks say what is missing)
        if a is s or a.shape != s.shape:
            continue
        owner, _, leaf = alias.rpartition(".")
        model.get_submodule(owner).register_parameter(leaf, s)
        done.append(f"{alias} to {src}")
    if done:
        more = f" and {len(done) - 1} more" if len(done) > 1 else ""
        step.problems.append(
            f"the run tied {done[0]}{more} (one tensor) but the factory's model holds them "
            "apart: the replay ties them as the run did; build the model tied in the factory "
            "(its tie_weights flag, or the assignment the script makes after building it)")


def held_apart(step, name: str) -> bool:
    """Whether the bundle holds ``name``'s own weights although the factory's model ties it to
    another name: the run trained them apart (said once)."""
    if f"weights/{name}" not in step.tensors:
        return False
    if not any(p.startswith(_APART) for p in step.problems):
        step.problems.append(
            f"{_APART}{name} to another parameter, which the run held apart (the bundle holds "
            "both): the replay unties them as the run had them; build the model untied in the "
            "factory as the run did")
    return True

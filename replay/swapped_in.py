"""The hint for weights already non-finite when their step began that the training loop had
put in itself: parameters it replaced since attach (``meta["replaced_params"]``: Gaussian
splatting's densification, pruning, MCMC relocation or opacity reset swap new
``nn.Parameter``s into the module and the optimizer), holding the value before any update
read them. The code that computed the new values is the place to fix, not an update's
settings. When the loop replaced every parameter of the model at once, that is a whole
state_dict loaded as new tensors (``model.load_state_dict(ckpt, assign=True)``, a rollback or
resume mid-run): the checkpoint is what held the value, and where the recorded optimizer
still holds the tensors they replaced (its groups' names recorded as None), its ``step()``
trains those no longer: the optimizer is to be built again over the new parameters. When the
bundle holds no optimizer though the step stayed open through several forwards, the loop did
build a new one and dropped the recorded one: its updates ran unseen, and which parameters the
load brought in non-finite is not known."""

from __future__ import annotations


def _held_by_optimizer(step, bad: list[str]) -> bool | None:
    """Whether the recorded optimizer holds the model's tensors under ``bad``'s names (None:
    no optimizer recorded)."""
    groups = (step.meta.get("optimizer") or {}).get("param_groups")
    if not groups:
        return None
    held = {n for g in groups for n in g.get("params") or () if n is not None}
    return all(n in held for n in bad)


def _dropped_optimizer(step, names: str, kind: str, held: bool | None) -> str | None:
    """With the recorded optimizer gone from the bundle or holding none of the bad tensors,
    and the step open through several forwards: the loop built a new optimizer over the
    loaded parameters and steps that one, whose updates since ran unseen."""
    n = len(step.meta.get("micro_batches") or ())
    if n < 2 or (step.meta.get("optimizer") and held is not False):
        return None
    return (f"the training loop replaced every parameter of the model at once with new "
            f"tensors (a state_dict loaded with load_state_dict(..., assign=True): a rollback "
            f"or resume mid-run), and the optimizer the recorder was given "
            f"{'holds none of them' if step.meta.get('optimizer') else 'is gone from the bundle'}"
            f" and never stepped again: the loop built a new one over them, whose updates ran "
            f"unseen; the step stayed open through {n} forwards, and {names} "
            f"held {kind} at its end. Which of them the checkpoint brought in non-finite and "
            "which the new optimizer's updates made so is not known: check the checkpoint "
            "first (torch.isfinite(t).all() for each tensor before loading it), and give the "
            "recorder the optimizer the loop steps (rec.detach(), then a new "
            "FlightRecorder(model, optimizer) after building it)")


def _whole_model_hint(step, names: str, kind: str, bad: list[str]) -> str:
    held = _held_by_optimizer(step, bad)
    if (dropped := _dropped_optimizer(step, names, kind, held)) is not None:
        return dropped
    stale = "" if held is not False else (
        "; the recorded optimizer still holds the tensors they replaced, so its step() no "
        "longer updates the model: after load_state_dict(..., assign=True) build the "
        "optimizer over model.parameters() again (then optimizer.load_state_dict), or load "
        "without assign=True, which copies into the parameters the optimizer holds")
    return (f"the training loop replaced every parameter of the model at once with new "
            f"tensors (a state_dict loaded with load_state_dict(..., assign=True): a rollback "
            f"or resume mid-run) and {names} already held {kind} before any update: the "
            "checkpoint it loaded holds them (a NaN written by a crashed or interrupted save, "
            "a corrupted file, an average of non-finite weights); check each tensor before "
            "loading it (torch.isfinite(t).all()) and load an earlier checkpoint" + stale)


def swapped_in_hint(step, bad: list[str]) -> str | None:
    """None unless every parameter in ``bad`` is one the loop replaced."""
    replaced = set(step.meta.get("replaced_params") or ())
    if not bad or not all(n in replaced for n in bad):
        return None
    names = ", ".join(bad[:2]) + (f" (+{len(bad) - 2} more)" if len(bad) > 2 else "")
    kind = step.event.get("kind") or "non-finite values"
    params = step.meta.get("params") or ()
    if len(params) > 1 and all(n in replaced for n in params):
        return _whole_model_hint(step, names, kind, bad)
    return (f"the training loop replaced {names} with a new parameter (swapped into the module "
            f"and the optimizer: densification, pruning, a relocation or a reset, a layer "
            f"widened) that already held {kind}, before any update: fix the code that computes "
            "its new values (a logit of a probability that reached 1.0, a log of 0: clamp into "
            "the op's domain first, as gsplat clamps opacities to [eps, 1 - eps] before its "
            "logit; a division by a count of 0: Net2Net's replication counts must count the "
            "unit itself)")


def passed_in_note(step, bad: list[str]) -> str | None:
    """For weights the event found inside ``torch.func.functional_call``
    (``meta["functional_call_params"]``): the tensors that call passed in under the model's
    names, not parameters the loop replaced; the bundle holds them as the weights."""
    passed = set(step.meta.get("functional_call_params") or ())
    if not bad or not all(n in passed for n in bad):
        return None
    return (f"{bad[0]} here is the tensor torch.func.functional_call passed in under that name "
            "for the forward that found it (a mean teacher's EMA copy, MAML's adapted "
            "p - lr * g), not the model's own parameter: the bundle holds the passed-in "
            "tensors as the weights; the code that made them is where it was written")

"""The hint for weights already non-finite when their step began that the training loop had
put in itself: parameters it replaced since attach (``meta["replaced_params"]``: Gaussian
splatting's densification, pruning, MCMC relocation or opacity reset swap new
``nn.Parameter``s into the module and the optimizer), holding the value before any update
read them. The code that computed the new values is the place to fix, not an update's
settings nor a checkpoint."""

from __future__ import annotations


def swapped_in_hint(step, bad: list[str]) -> str | None:
    """None unless every parameter in ``bad`` is one the loop replaced."""
    replaced = set(step.meta.get("replaced_params") or ())
    if not bad or not all(n in replaced for n in bad):
        return None
    names = ", ".join(bad[:2]) + (f" (+{len(bad) - 2} more)" if len(bad) > 2 else "")
    kind = step.event.get("kind") or "non-finite values"
    return (f"the training loop replaced {names} with a new parameter (swapped into the module "
            f"and the optimizer: densification, pruning, a relocation or a reset, a layer "
            f"widened) that already held {kind}, before any update: fix the code that computes "
            "its new values (a logit of a probability that reached 1.0, a log of 0: clamp into "
            "the op's domain first, as gsplat clamps opacities to [eps, 1 - eps] before its "
            "logit; a division by a count of 0: Net2Net's replication counts must count the "
            "unit itself)")

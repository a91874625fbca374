"""A step whose micro-batches took their output gradients from a loss computed before them.

GradCache (luyug/GradCache, sentence-transformers' cached losses) embeds the batch chunk by
chunk under ``torch.no_grad()``, runs the loss on the detached representations and keeps its
gradient, then re-runs each chunk with grad and ``reps.backward(gradient=cached)``. To the
recorder the no-grad chunks are evaluation forwards and the loss their evaluation's (checked,
finite, not kept); the step holds the re-run chunks, each given the cached gradient. A
non-finite value there came from that loss's backward, on finite values (its value was
checked), which the replay cannot re-run: it says so rather than that the loss never ran.
"""

from __future__ import annotations

from recorder.chunks import chunk_of

from .load import Step


def gradient_cached(step: Step) -> bool:
    """No micro-batch called the loss module (or none was given), each received its output's
    gradient from outside the model, and they are chunks of one batch: GradCache's re-runs."""
    info = step.meta.get("loss") or {}
    mbs = step.micro_batches
    return info.get("kind") in (None, "module") and bool(mbs) and all(
        isinstance(mb, dict) and not mb.get("loss_inputs") and mb.get("output_grads")
        and mb.get("grad_enabled", True) for mb in mbs) and any(
        chunk_of(mb) is not None for mb in mbs)


def cached_note(step: Step) -> str:
    name = (step.meta.get("loss") or {}).get("class")
    return (f"the loss_fn given to the recorder ({name}) was not called in this step: its "
            "micro-batches are chunks of the loop's batch, each given a gradient from outside "
            "the model, as GradCache re-runs them with the gradient its loss cached on "
            "representations of a no-grad pass; the recorder checked that loss (finite) as an "
            "evaluation's and kept no argument of it, so the replay had no loss to re-run")


def cached_hint(step: Step, micro_batch, otherwise: str) -> str:
    """The hint: ``otherwise`` (make the loss replayable) when no loss_fn was given, as the
    chunks may be a loop's accumulation with its loss inline, with GradCache's case added."""
    at = f" of micro-batch {micro_batch}" if isinstance(micro_batch, int) else ""
    pole = ("a pole of that backward (sqrt or norm at 0, a division by a clamped value, the "
            "x / x.norm() of a zero vector), as no forward shows it; run the cache step's "
            "loss.backward() on this batch under torch.autograd.detect_anomaly() to name the "
            "op")
    if (step.meta.get("loss") or {}).get("kind") == "module":  # (checked: finite)
        return (f"the non-finite values came in with the cached gradient{at}, which the "
                f"loss's backward made from finite representations (its value was finite): "
                f"{pole}")
    return (f"{otherwise}. If the loop caches a loss's gradient on the outputs of a no-grad "
            f"pass (GradCache), the values came in with that cached gradient{at}: loss_fn "
            f"then checks its value but is not re-run (it runs before the step's first "
            f"forward); look for {pole}")

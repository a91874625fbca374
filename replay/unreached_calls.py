"""A forward of the step that ran with gradients on whose output no gradient reached, while
another forward's output took one: the loss used that call some other way than through its
output's value. A Jacobian-vector term takes the tangent of a dual output
(``torch.autograd.forward_ad``'s ``unpack_dual(out).tangent``), whose backward reaches the
weights without passing the output, so the recorder's output gradients miss it and the
replay's backward from them finds every gradient finite. Named for a backward event whose
gradients no re-run made, so that the hint points at that term, not at per-sample
gradients or a hand-written clip the loop does not have."""

from __future__ import annotations

from .load import Step


def unreached_calls(step: Step) -> list[int]:
    """Micro-batches with gradients on whose outputs took no gradient, when at least one other
    micro-batch's did; [] otherwise."""
    enabled = [(i, mb) for i, mb in enumerate(step.micro_batches)
               if mb.get("grad_enabled", True)]
    if not any(mb.get("output_grads") for _, mb in enabled):
        return []
    return [i for i, mb in enabled if not mb.get("output_grads")]


def unreached_calls_text(step: Step) -> str:
    """The sentence naming those forwards (see the module's docstring), put before the hint's
    other ways the loop writes gradients; "" when none."""
    calls = unreached_calls(step)
    if not calls:
        return ""
    which = ", ".join(str(i) for i in calls)
    return (f"micro-batch{'es' if len(calls) > 1 else ''} {which} of this step ran the model "
            "with gradients on but no gradient reached its output: if the loss used that call "
            "through a Jacobian-vector product (torch.autograd.forward_ad's "
            "unpack_dual(out).tangent, torch.func.jvp's tangent) or a gradient of it "
            "(create_graph=True), that term's backward reached the weights around the output, "
            "where the recorder does not see it; compute it in loss_fn, given the model and "
            "its inputs (loss_fn(out, y, model, x, v)), so that the replay re-runs it and names "
            "its op and samples. Otherwise ")

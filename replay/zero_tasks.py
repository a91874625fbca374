"""Outputs of the model that sent back a gradient of exactly 0 (every element, every sample)
while another output's was not: a multi-task model's head whose task loss had no gradient at
this step (a depth loss over a batch with no valid pixel, a task already solved). Gradient
surgery divides by each task gradient's norm (PCGrad's ``||g_j||^2``, MGDA's
``||g_1 - g_2||^2``, GradNorm's ratios), which is 0/0 for that task. Read from the output
gradients the recorder kept, for a backward event whose NaN gradients the loop wrote by hand.

A task head can also be dead: its output exactly 0 in every element (a regression head ending
in a ReLU whose inputs are all below 0), so the gradient its loss sends back stops there and
the task's gradient at the shared layers is 0 although its loss and output gradient are not.
Read from the re-run's outputs (:func:`dead_outputs_text`)."""

from __future__ import annotations

from recorder.capture import flatten_tree

from .load import Step, output_grads


def zero_outputs(step: Step) -> dict[int, list[int]]:
    """Micro-batch -> the indices of its outputs whose recorded gradient is all exactly 0,
    only where some other output's gradient is not (one output alone is no task)."""
    found: dict[int, list[int]] = {}
    for i in range(len(step.micro_batches)):
        grads = output_grads(step, i)
        zero = [j for j, g in sorted(grads.items()) if g.numel() and not bool(g.any())]
        if zero and len(zero) < len(grads):
            found[i] = zero
    return found


def zero_outputs_text(step: Step, runner=None) -> str:
    """The hint's sentence on them (named by their path in the model's output, which a
    re-run by ``runner`` returns), '' when there are none."""
    found = zero_outputs(step)
    if not found:
        return dead_outputs_text(step, runner)
    mb, zero = next(iter(found.items()))
    names = _names(runner, mb)
    said = ", ".join(f"output{names[j]}" if j < len(names) else f"output {j}" for j in zero)
    return (f"; the gradient that reached the model's {said} was exactly 0 in every element "
            "(a task whose loss had no gradient at this step: a batch with no valid target "
            "for it, a task already solved), so that task's gradient is 0 and gradient "
            "surgery that divides by its norm (PCGrad's g_i·g_j / ‖g_j‖², MGDA's "
            "‖g_1 - g_2‖², GradNorm's ratios) makes 0/0: add an eps to the norm "
            "(‖g_j‖² + 1e-12) or leave a task whose gradient is 0 out of the surgery")


def _names(runner, mb: int) -> list[str]:
    """The paths of micro-batch ``mb``'s output tensors (`` out["depth"]``), in the order the
    recorder keeps their gradients; [] without a re-run to read them from."""
    return [name for name, _ in _outputs(runner, mb)]


def dead_outputs_text(step: Step, runner) -> str:
    """The hint's sentence on the floating outputs a re-run by ``runner`` returns exactly 0 in
    every element while another output is not (a dead head), '' when there are none."""
    for mb in range(len(step.micro_batches)):
        outs = _outputs(runner, mb)
        floats = [(name, t) for name, t in outs if t.is_floating_point() and t.numel()]
        dead = [name for name, t in floats if not bool(t.any())]
        if dead and len(dead) < len(floats):
            said = ", ".join(f"output{name}" for name in dead)
            return (f"; the model's {said} was exactly 0 in every element (a dead head: a ReLU "
                    "or clamp at its end whose inputs are all below 0), so no gradient passes "
                    "back through it, that task's gradient at the shared layers is exactly 0 "
                    "and gradient surgery that divides by its norm (PCGrad's g_i·g_j / ‖g_j‖², "
                    "MGDA's ‖g_1 - g_2‖², GradNorm's ratios) makes 0/0: add an eps to the norm "
                    "(‖g_j‖² + 1e-12), leave a task whose gradient is 0 out of the surgery, and "
                    "end a head that must stay alive without a ReLU (softplus, or none)")
    return ""


def _outputs(runner, mb: int) -> list[tuple[str, object]]:
    """Micro-batch ``mb``'s output tensors of a re-run, with their paths; [] without one."""
    if runner is None:
        return []
    try:
        objects = runner.run(backward=False, instrument=False).objects
    except Exception:  # (the sentence is a courtesy: the report stands without it)
        return []
    if mb >= len(objects):
        return []
    _, tensors, paths = flatten_tree(objects[mb], "o")
    return [(f" out{paths[k]}" if paths[k] else "", t.detach()) for k, t in tensors.items()]

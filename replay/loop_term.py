"""A non-finite gradient entering the output of a micro-batch the loop differentiated itself.

StyleGAN2's path-length regularizer takes ``autograd.grad((img * noise).sum(), ws,
create_graph=True)`` of the generator's two outputs and backpropagates
``sqrt((g ** 2).sum(2).mean(1))``: where that derivative is exactly 0 (an output that no longer
depends on the latents: a clamp that saturates, a layer of zeros), sqrt's derivative is
infinite and ``0 * inf`` sends NaN into both outputs, and, through the graph the loop's
derivative built (``create_graph=True``), straight into parameters the output gradient never
reaches. The replay cannot re-run the loop's term, but it can take the same derivative in the
re-run: one output with respect to another output (or an input that requires grad, R1's
``reals``) with a random cotangent, and name the samples where it is exactly 0.
"""

from __future__ import annotations

import torch

from recorder.capture import tensor_leaves

from .load import Step, differentiates_model
from .rerun import Runner
from .transforms import outside_transforms


def loop_differentiated(step: Step, mb: int | None) -> bool:
    """Whether the loop ran a backward with create_graph=True through micro-batch ``mb``'s
    output itself (a path-length or gradient penalty), not through a loss it gave the
    recorder."""
    mbs = step.micro_batches
    return isinstance(mb, int) and 0 <= mb < len(mbs) and bool(mbs[mb].get("differentiated")) \
        and not differentiates_model(step, mb)


def zero_derivative(runner: Runner, mb: int) -> tuple[str, list[int], int] | None:
    """(what was differentiated, the samples where that derivative is exactly 0, the batch's
    size) in the re-run of micro-batch ``mb``, for the first pair of an output and another
    output or input requiring grad that has such samples; None when there is none."""
    found: list = []
    cot = torch.Generator().manual_seed(0)

    def post(module, args, kwargs, output):
        if runner.micro_batch != mb or found:
            return
        outs = [o for o in tensor_leaves(output) if o.is_floating_point() and o.requires_grad]
        ins = [t for t in tensor_leaves((args, kwargs)) if t.is_floating_point()
               and t.requires_grad]
        # (the first 8 of each: a derivative per pair, taken at the event only)
        outs, ins = outs[:8], ins[:8]
        wrt = [(f"output {j}", o) for j, o in enumerate(outs)] + \
            [(f"input {j}", t) for j, t in enumerate(ins)]
        with torch.enable_grad():
            for i, a in enumerate(outs):
                for name, b in wrt:
                    if b is a or not a.dim() or not b.dim() or len(a) != len(b):
                        continue
                    v = torch.randn(a.shape, generator=cot).to(a)
                    g, = torch.autograd.grad(a, b, v, retain_graph=True, allow_unused=True)
                    if g is None:
                        continue
                    rows = [r for r in range(len(g)) if not g[r].any()]
                    if rows:
                        found.append((f"output {i} with respect to {name}", rows, len(g)))
                        return

    runner.run(backward=False, instrument=False,
               hooks=lambda model: [model.register_forward_hook(outside_transforms(post),
                                                                with_kwargs=True)])
    return found[0] if found else None


def spread_by_term(mb: int) -> str:
    """The note on parameters whose recorded gradient is non-finite while the output gradient
    fed through the model's backward leaves them finite: the loop's derivative term reached
    them itself, no clip spread the value."""
    return (f"more parameters had non-finite gradients in the recording than the output "
            f"gradient gives them: the loop differentiated micro-batch {mb}'s output itself "
            "(torch.autograd.grad with create_graph=True), and the backward of that derivative "
            "reaches the parameters directly, not only through the output")


def zero_derivative_hint(mb: int, found: tuple[str, list[int], int]) -> str:
    what, rows, size = found
    where = f"every sample ({size})" if len(rows) == size else f"samples {rows}"
    return (f"the loop differentiated micro-batch {mb}'s {what} itself (torch.autograd.grad "
            f"with create_graph=True), and in the re-run that derivative is exactly 0 in "
            f"{where}: a sqrt or norm of it (a path-length penalty's sqrt((g ** 2).sum()), a "
            "gradient penalty's norm) has an infinite derivative at 0, and 0 * inf is NaN. Put "
            "an eps under the sqrt (sqrt(x + 1e-8)), and find why the output does not depend "
            "on it there (a clamp that saturates, a layer of zeros)")


def loop_term_report(report, step: Step, runner: Runner, mb: int | None,
                     samples: list[int] | None) -> bool:
    """Give ``report`` (an output gradient that entered non-finite in ``samples``) the
    derivative the loop took itself at ``mb`` where the re-run finds it exactly 0 in some of
    those samples: cause ``invalid`` and the hint. False when the loop took none there, or
    none is 0 where the gradient entered non-finite (the NaN came from elsewhere)."""
    if not loop_differentiated(step, mb) or (found := zero_derivative(runner, mb)) is None:
        return False
    if samples and not set(found[1]) & set(samples):
        return False
    report["cause"], report["hint"] = "invalid", zero_derivative_hint(mb, found)
    return True

"""An op at its pole of 0 whose input was looked up in a buffer of the model or the loss (a
word's sampling probability in sampled softmax's log-Q correction, ``log(self.q[targets])``,
or a count normalised where it is looked up, ``log(self.counts[ids] / self.counts.sum())``;
a class prior, an idf weight): the 0 is an entry of a table the code was built with, which
the batch picked by id (a word or an item the counts never saw). The generic advice, an eps at the op, hides the
rare id behind a huge finite value; the fix is the table, where it is built.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .domains import describe

__all__ = ["looked_up_hint"]

SHOWN = 8  # entries named in the hint (then "..." and how many)


def looked_up_hint(hint: str | None, buffers: Iterable[tuple[str, torch.Tensor]], finder,
                   hit) -> str | None:
    """The hint naming the buffer the blamed op's 0 came from, with its zero entries, when
    the op (``hit``, blamed from finite inputs) took a value looked up in a floating buffer
    of ``buffers`` (name, tensor: the model's, or the loss's ``<loss>.NAME``) that holds
    exactly 0 and its values were 0 where its output went
    non-finite; else None. It replaces ``hint``'s advice (an eps at the op, a clamp)."""
    looked, ev = finder.names.hit_buffer, hit and hit.evidence
    if hint is None or looked is None or hit is not finder.first or ev is None:
        return None
    name, i = looked
    # (the 0 at the pole is the looked-up input's, not another's: prior[y] / count)
    if i >= len(ev.inputs) or not ev.elementwise[i] or not bool((ev.inputs[i] == 0).any()):
        return None
    table = dict(buffers).get(name)
    if table is None or not table.is_floating_point() or table.numel() == 0:
        return None
    rows = (table == 0).reshape(len(table), -1).any(1).nonzero().flatten().tolist()
    if not rows:
        return None
    ids = ", ".join(map(str, rows[:SHOWN])) + (f", ... ({len(rows)} in all)"
                                               if len(rows) > SHOWN else "")
    what = describe(hit.op.removeprefix("aten."), hit.evidence)[0]
    if (schedule := _schedule_end(table, rows)) is not None:
        return (f"{what}: its input was looked up in the buffer {name}, a schedule over "
                f"{len(table)} steps the code was built with (monotone in the step), exactly "
                f"0 at its {schedule} entry ({ids}): a time step drawn for the samples named "
                "(torch.randint over the whole schedule) picked it. A noise schedule's "
                "alpha_bar is 0 there when its last beta is 1 (a squared-cosine schedule "
                "without betas_for_alpha_bar's max_beta=0.999 cap, or rescaled to zero "
                "terminal SNR): cap the betas below 1 where the schedule is built, or keep "
                "that step out of what divides by it (draw t from the steps where it is "
                "above 0; for x0 = (x_t - sqrt(1 - a) * eps) / sqrt(a), predict v or x0 "
                "instead; for min-SNR weighting's min(snr, gamma) / snr, an SNR of 0 there, "
                "predict v, whose weight divides by snr + 1); a clamp after the op (clip_sample) hides the infinity in the "
                "forward, not in the backward")
    return (f"{what}: its input was looked up in the buffer {name}, a table the "
            f"code was built with, which is exactly 0 at {len(rows)} of its {len(table)} "
            f"entries ({ids}): the batch picked one of them by id (a word or class the counts "
            f"behind the table never saw, a sampling probability of 0). Fix the table where "
            f"it is built (smooth the counts, counts + 1, or floor it) or keep those ids out "
            f"of the batch; an eps at the op turns that id into a huge finite value instead")


def _schedule_end(table: torch.Tensor, rows: list[int]) -> str | None:
    """``"last"`` / ``"first"`` when ``table`` is 1-D, monotone and 0 at that end only: a
    schedule over steps (``alphas_cumprod``), not a table of counts; else None."""
    if table.dim() != 1 or len(table) < 3 or len(rows) != 1 or rows[0] not in (0, len(table) - 1):
        return None
    d = table.detach().diff()
    if not (bool((d <= 0).all()) or bool((d >= 0).all())):
        return None
    return "last" if rows[0] == len(table) - 1 else "first"

"""A division whose divisor is one of the model's or the loss's buffers as the code keeps it,
0 in some entries: a statistic of the data (a training set's per-feature std, ``(x -
self.mean) / self.std``, 0 for a feature constant there: an EEG reference electrode) or a
running one (ReMixMatch's distribution alignment, ``p * p_target / self.p_model``, 0 for a
class no row predicted yet), or a scalar setting stored as a buffer (a LoRA rank in
``alpha / self.ranknum``, 0 for a layer the rank pattern left out). Every sample divides by
the same entries, so the generic advice (an eps in the data, skip the rows, a feature
constant over the batch) points away from the fix, which is where the buffer is computed,
starts and is updated. So too for a divisor the code made of such a buffer alone, value by
value (a SNP's ``sqrt(2 * p * (1 - p))`` of training-set allele frequencies ``p``, 0 for a SNP
monomorphic there): the entries where it is 0 are named, with the buffer's values there. A
log of such a buffer is said by ``replay.held_pole``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from recorder.target import LOSS_PREFIX

from . import lost_eps
from .batch_written import written_divisor_hint
from .half_cast import flushed_text
from .held_pole import held_pole_hint

__all__ = ["held_divisor_hint", "loss_buffers"]

SHOWN = 8  # entries named in the hint


def loss_buffers(loss) -> list[tuple[str, torch.Tensor]]:
    """The loss module's buffers, named ``<loss>.NAME`` as its parameters are."""
    if not isinstance(loss, torch.nn.Module):
        return []
    return list(loss.named_buffers(prefix=LOSS_PREFIX[:-1]))


def held_divisor_hint(hint: str | None, cause: str, finder, hit,
                      buffers: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The hint naming the buffer the blamed division (``hit``) divided by as is, and its
    entries at 0, when it is one of ``buffers`` (name, tensor); a log's input so held, 0
    where the log is -inf (``replay.held_pole``: a class prior of 0); else None."""
    buffers = list(buffers)
    # (a log of a buffer clamped to a floor of exactly 0: that floor is the fix, lost_eps's)
    if not (hit and hit.evidence and lost_eps.zero(hit.evidence)) \
            and (pole := held_pole_hint(hint, cause, hit, buffers)):
        return pole
    name = finder.names.hit_divisor_held
    ev = hit and hit.evidence
    inverse = hit is not None and hit.op == "aten.reciprocal"  # (1 / d: one input)
    if hint is None or cause != "invalid" or hit is not finder.first \
            or ev is None or len(ev.inputs) < (1 if inverse else 2):
        return None
    kept = finder.names.hit_divisor_kept
    one = kept[0] if name is None and kept is not None and len(kept) == 1 else None
    if said := written_divisor_hint(hit.op, ev, one, finder.names.written.names,
                                    finder.names.hit_divisor):
        return said  # (made of a running statistic the forward updated: an EMA's counts)
    if name is None and kept is not None and len(kept) == 1:  # (made of one buffer alone)
        # (not an eps the code set to 0 there, std + eps with eps = 0: that hint names it)
        return None if lost_eps.zero(ev) else _made_of_hint(
            hit.op, kept[0], dict(buffers).get(kept[0]), finder.names.hit_divisor)
    buf = dict(buffers).get(name) if name is not None else None
    if buf is None or not bool((buf == 0).any()):
        return None
    what = "1 by 0 (1/0)" if inverse else "0 by 0 (0/0)" if bool(
        ((ev.inputs[0] == 0) & (ev.inputs[1] == 0)).any()) else "x by 0 (x/0)"
    short = name.rpartition(".")[2]
    if buf.dim() == 0:  # (no entries to name: a setting or count the code stored)
        return (f"{hit.op} of {what}: the divisor is the buffer {name}, a scalar the code "
                "keeps, and it is 0; every sample divides by it, no record is to blame. A "
                "setting or count stored as a buffer (a LoRA rank r in alpha / r, a number "
                "of steps) is 0 where the configuration built it so, a value the loop "
                "schedules (a temperature annealed toward 0) where the schedule reached 0: "
                "check it where the module is built (r > 0, or leave out the layers given 0) "
                "or where the loop writes it (anneal to a floor: max(tau, tau_min)), or "
                f"divide by self.{short}.clamp_min(eps)")
    at = (buf.detach() == 0).nonzero()
    where = ", ".join(str(tuple(i)) if len(i) > 1 else str(i[0]) for i in at[:SHOWN].tolist()) \
        + (f", ... ({len(at)} in all)" if len(at) > SHOWN else "")
    return (f"{hit.op} of {what}: the divisor is the buffer {name} as the code keeps it, 0 at "
            f"entr{'ies' if len(at) > 1 else 'y'} {where} of its shape {tuple(buf.shape)}; "
            "every sample divides by the same entries, so no record is to blame, there are no "
            "rows to drop and an eps in the data does not help. " + (
                _never_filled(name, buf) or flushed_text(name, buf) or _HELD_ADVICE.format(short=short)))


_HELD_ADVICE = ("A statistic of the data (a "
                "training set's std or scale) is 0 for a feature constant where it was computed "
                "(an EEG reference electrode, 0 against itself; a sensor never connected): floor it "
                "there (std.clamp_min(eps); scikit-learn's StandardScaler sets a zero scale to 1) or "
                "drop that feature. A running statistic (a running mean of the class "
                "probabilities, a count or histogram per class) is 0 where it started at 0 or was "
                "never updated: start it above 0 (uniform, not zeros), update it with the batch "
                "before dividing, or divide by self.{short}.clamp_min(eps)")


def _entries(at: torch.Tensor) -> str:
    return ", ".join(str(tuple(i)) if len(i) > 1 else str(i[0]) for i in at[:SHOWN].tolist()) \
        + (f", ... ({len(at)} in all)" if len(at) > SHOWN else "")


def _made_of_hint(op: str, name: str, buf: torch.Tensor | None,
                  divisor: torch.Tensor | None) -> str | None:
    """The hint of a division by a value made of buffer ``name`` alone, value by value, 0 at
    some entries (see the module); None when it is not so."""
    if buf is None or divisor is None or buf.dim() == 0 or divisor.shape[divisor.dim() - buf.dim():] != buf.shape:
        return None
    rows = divisor.detach().reshape(-1, *buf.shape)  # (as the op saw it: broadcast)
    divisor = rows[0]
    if not bool((rows == divisor).all()) or not bool((divisor == 0).any()):
        return None
    at = (divisor.detach() == 0).nonzero()
    held = sorted({float(v) for v in buf.detach()[divisor == 0].flatten()[:SHOWN].tolist()})
    return (f"{op} by 0: the divisor was made of the buffer {name} alone, value by value (no "
            f"sample's record, nothing learned), and is 0 at entr{'ies' if len(at) > 1 else 'y'} "
            f"{_entries(at)} of its shape {tuple(buf.shape)}, where the buffer holds "
            f"{' / '.join(f'{v:g}' for v in held)}; every sample divides by the same entries, so "
            "no record is to blame and there are no rows to drop. " + (
                _never_filled(name, buf) or flushed_text(name, buf) or "A statistic of the data at "
                "its edge for a feature constant where it was computed (an allele frequency of "
                "0 or 1 in sqrt(2p(1 - p)): a SNP monomorphic in the training set; a std of 0: "
                "an EEG reference electrode) is the cause: drop such features where the "
                "statistic is made (a minor-allele-frequency or variance filter), or floor the "
                "divisor (.clamp_min(eps))" + (_COUNTS if _whole(buf) else "")))


def _never_filled(name: str, buf: torch.Tensor) -> str | None:
    """The advice for a buffer of several entries that is 0 in every one: no statistic of
    data is 0 for every feature, so it is the value the buffer was built with, never written
    since (its statistic never computed, or a checkpoint without it loaded with strict=False,
    which leaves it at its init); None when some entry is not 0."""
    if buf.numel() < 2 or bool((buf.detach() != 0).any()):
        return None
    return (f"{name} is 0 in every entry, as a buffer is built before its statistic is "
            "written: it was never filled, neither computed from the data (a calibration or "
            "statistics pass the run skipped: a resume that goes straight to training) nor "
            "loaded (a checkpoint without it, loaded with load_state_dict(..., strict=False), "
            "leaves it at its init: check the missing_keys that load returns, or compute the "
            "statistic again after loading)")


# (a buffer of whole numbers, 0 where the division broke: a count per class or group)
_COUNTS = ("; a count of 0 (a class with no example in the split the counts were taken over, "
           "in an inverse frequency 1 / n or a class-balanced weight's effective number (1 - "
           "beta^n) / (1 - beta)) is such an edge too: floor the counts (counts.clamp_min(1)) "
           "or give the absent class a weight of 0")


def _whole(buf: torch.Tensor) -> bool:
    b = buf.detach()
    return bool((b >= 0).all() and (b == b.round()).all())

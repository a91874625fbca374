"""Samples whose model input or loss data is all 0, where an op hit its pole or left its
domain on those samples alone.

A metric depth head scaled by each camera's focal length (``depth * focal / f0``, the focal
an extra ``forward`` argument) outputs 0 for an image whose intrinsics were never filled
(focal 0), and the loss's ``log(pred)`` is -inf on that image; AdaBins' chamfer loss
between the bins and a LiDAR frame with no point averages over none (0/0). The op's advice
(clamp its input, an eps) would train on a record holding nothing; the hint names the
tensor and the samples, so the user fixes or filters the record where the data is made. Non-negative data of several
entries a sample (counts) is :mod:`replay.empty_counts`', 0/1 masks
:mod:`replay.empty_records`'; a hint that names the data already gains nothing here, one
that says its 0 is a true value (a count of 0: :mod:`replay.data_counts`, a stay's whole
days) only the data's name, no advice to filter the record. At a
0/0 only the loss's data is looked at: a model input's blank row divided by its own spread
(``(x - mean) / std``) is a normaliser's, which an eps fixes; but a model input the loss is
given as its data is the loss's data too (an autoencoder's target is its input: a dead
pixel's all-zero spectrum makes the spectral angle's cosine, or a sum-to-one layer after a
bias-free encoder, 0/0), named as the model input and the loss's argument; a blank model input is named at a forward
0/0 too where the normaliser's own eps is 0 (a frame of black crops through a bias-free re-id
head, ``e / (e.norm() + 0)``), beside that eps. Where the op's own eps was set to
0 (``log(q + c)`` with ``c = 0``, NSE*'s ``1 / (std + eps)^2`` with ``eps = 0``), the code meant
that eps for such zeros, which may be true values (an ephemeral stream's zero flow): the hint
gives the eps and the record's fix side by side. A backward NaN the forward had masked out at
those samples (a Poisson deviance's ``torch.where(y > 0, y * log(y / mu), 0)``, whose log's
backward is 0/0 at a policy with no claim) is of zeros the code handles: the hint keeps the
samples and asks for a safe input before the op; not where the zeros are the model's own input
alone, whose every value downstream is 0 as well (a radial ODE field ``sqrt(sum y²) * W y`` from
an all-zero record through a bias-free encoder: 0 times sqrt's infinite derivative), so
that the incoming 0 shows no mask of the code's: that record is named blank. A softmax over a row whose every key is masked
looks at the integer model inputs too: token ids all 0 (the padding) in exactly those samples,
an empty document (a note whose text extraction gave no sentence) under a hierarchical
attention network's sentence attention; not ids whose 0 sits between other ids in other
samples (a nested logit's nest ids: a market whose products are all in nest 0 leaves nest 1
empty, a real 0 and no blank record)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from recorder.capture import batch_path, loss_path
from recorder.finite import zero_one

from .carried_state import carried_names
from .data_counts import ORDINARY
from .drop import undroppable
from .empty_counts import root_inputs
from .empty_records import batch_data, zero_rows
from .legal_zero import legal_zero, legal_zero_text
from .load import Step
from .recorded import n_args, samples
from .shared_inputs import loss_input_refs
from .unlabelled_rows import label_flag, unlabelled_hint
from .xlogy_pole import VALID_ZEROS

# (the data is named already, or said to be none of a record's)
# (or its 0 said to be a true value: a count of 0, replay.data_counts)
_SAID = ("Sample(s) ", "sample(s) ", "nothing is to drop", "--try drop=",
         "exactly 0 at the samples named", "exactly 0 in the samples named",  # (a ridge's)
         VALID_ZEROS)  # (xlogy(y, y / mu) of a count of 0: replay.xlogy_pole)
_ZERO_BY_ZERO = "of 0 by 0 (0/0)"  # (a division's, replay.cause_text)
_GUARD_OFF = "so it guarded nothing"  # (replay.lost_eps: the op's eps is 0, or lost in its type)
# a backward origin whose incoming gradient is 0 where it made NaN (origin "masked"): the
# forward's own torch.where or masked_fill dropped the op's value at the data's zeros, so the
# code knows them (no claim on a policy, a count of none); they are no blank records to filter
MASKED_ZEROS = (
    " and not in any other sample, the entries where the forward dropped the op's value (the "
    "gradient entering the node is 0 there): the code masks these zeros out itself, so they "
    "are values it handles (a count or an amount of none), not blank records: keep those "
    "samples, and give the op a safe input at them before it runs (torch.where(y > 0, y, 1) "
    "inside the log or division, or a form that takes no op at the 0: xlogy(y, y) - y * "
    "log_mu for y * log(y / mu))")
# the same, the 0 gradient sent by an op's derivative at its value (abs's sign(0)), no mask's
FLAT_ZEROS = (
    " and not in any other sample, where the gradient entering the node is 0 because {by}'s "
    "derivative is 0 at the value it took there (|a - b| of two zeros), not because a mask "
    "dropped them: the blank record drove the op to its pole, but flat regions of real data "
    "reach the same 0, so give the op a safe input before it runs (an eps inside the sqrt or "
    "log, torch.where(x > 0, x, 1)), and fix or filter blank records where the data is made")
# the same backward origin where the zeros are the model's own input, every feature of the
# record: whatever the forward computed from that row is 0 too (a bias-free layer's output, a
# field scaled by the state's own radius, r * W y at y = 0), so the gradient entering the node
# is 0 there with no mask of the code's; the record is most likely blank, not a value it handles
_ZERO_INPUT = (
    " and not in any other sample, a model input with every feature exactly 0: the gradient "
    "entering the node is 0 there because the values the forward computed from that row are "
    "0 too (a bias-free layer's output, a product with a function of the state), not because "
    "the code masks these samples; such a row is most likely a blank record (a reading never "
    "filled, a sensor that returned nothing): fix or filter such records where the data is "
    "made")
_TRUE_ZERO = "; where 0 is a true value of that input, give the op the safe input above"
# a softmax over a row whose every key is masked (replay.plus_inf_row), and what its own advice
# (a key kept per row, a finite mask value) would do for a record with nothing in it
_MASKED_ROW = "(a fully masked row)"
_KEPT_KEY = (", where every position is padding; a key kept for them or a finite mask value "
             "would only hide that, as attention over padding")


def zero_records_hint(report: dict[str, Any], step: Step) -> None:
    """Append the data all 0 in exactly the samples of an ``invalid`` origin."""
    o, hint = report.get("origin") or {}, report.get("hint") or ""
    rows, mb = o.get("samples") or [], o.get("micro_batch") or 0
    if report.get("cause") != "invalid" or not rows or o.get("all_samples") or not hint \
            or any(said in hint for said in _SAID):
        return
    # (a 0/0 of a blank model input is a normaliser's, ``(x - mean) / std`` of a constant
    # row, which an eps fixes; of a blank target, a mean over none of its valid entries;
    # but where the normaliser's own eps is 0, the hint says so and the blank input is named
    # beside it: a frame of black crops through a bias-free re-id head, ``e / (|e| + 0)``)
    zero_div, masked_row = _ZERO_BY_ZERO in hint, _MASKED_ROW in hint
    # (a forward 0/0 whose own eps was set to 0 on a model input all 0 there: that input
    # drove it, not the loss's data, which the forward never read: silent audio under
    # GCC-PHAT's R / (|R| + eps), beside the clip's all-zero target)
    names = [name for name, t, d in _records(step, mb, loss=False) if _zero_in(t, d, rows)] \
        if zero_div and _GUARD_OFF in hint and o.get("phase") == "forward" else []
    # (every such tensor: a record's discharge and its std over the training period both 0)
    names = names or [name for name, t, d in _records(step, mb, inputs=not zero_div)
                      if _zero_in(t, d, rows)]
    if masked_row:  # (a softmax over no key: integer inputs too, token ids all padding)
        names += [name for name, t, d in batch_data(step, mb, loss=False)
                  if not t.is_floating_point() and t.dtype != torch.bool and zero_rows(t, d, rows)
                  and not _interior_zero(t, d, rows)]
    if not names:
        return
    which = ",".join(str(r) for r in rows)
    is_are = f"{' and '.join(names)} {'is' if len(names) == 1 else 'are'}"
    flag = label_flag(step, mb, rows, names[0])
    if flag is not None:  # (unlabelled samples of a mixed batch, masked after the op)
        report["hint"] = unlabelled_hint(hint, is_are, flag, which)
        return
    how = "" if undroppable(step, mb) else f" (--try drop={which} re-runs the step without them)"
    if _legal_said(report, step, rows, names, not zero_div, how):  # (t ~ U[0, 1] at 0)
        return
    if o.get("masked"):  # (the code's own where dropped the op's value there; or abs's sign(0))
        report["hint"] = _masked_hint(step, mb, names, hint, which, how, o.get("masked_by"))
        return
    if ORDINARY in hint:  # (a count of 0, said to be a true value: which data, no filter)
        report["hint"] = f"{hint} ({is_are} 0 everywhere in sample(s) {which})"
        return
    if _GUARD_OFF in hint:  # the code's own eps was meant for this 0: it may be a true value
        report["hint"] = (
            f"{hint}. {is_are} 0 everywhere in sample(s) {which} and not in any other "
            "sample, which drove the op there: where 0 is a true value of that data (a stream "
            "with no flow, a count of none), the eps is the fix; where it is a blank record "
            f"(a value never filled), fix or filter such records where the data is made{how}")
        return
    carried = carried_names(step, mb) if masked_row else []
    if carried:  # (segments of longer sequences: a row padded since its sequence ended)
        report["hint"] = _ended_hint(hint, is_are, which, carried, how)
        return
    hidden = "" if zero_div else _KEPT_KEY if masked_row else \
        ", which an eps would only hide as a wrong value"
    like = "a document whose text extraction gave no sentence, an utterance with no frame" \
        if masked_row else "a camera intrinsic never filled, a frame with no ground truth"
    report["hint"] = (
        f"{hint}. But {is_are} 0 everywhere in sample(s) {which} and not in any other "
        f"sample: a blank record ({like}) drove the op there{hidden}; fix or filter such "
        f"records where the data is made{how}")


def _legal_said(report: dict[str, Any], step: Step, rows: list[int], names: list[str],
                inputs: bool, how: str) -> bool:
    """Whether the hint now says that one of ``names``, one value per sample and 0 in
    ``rows``, lies inside the spread of the other samples' values (:mod:`replay.legal_zero`):
    a legal value to make the op safe at, no blank record."""
    mb = report["origin"].get("micro_batch") or 0
    for name, t, d in _records(step, mb, inputs=inputs):
        if name not in names or t.numel() != t.shape[d]:  # (one number per sample: a time)
            continue
        zero = torch.zeros(t.shape, dtype=torch.bool)
        zero.index_fill_(d, torch.tensor([r for r in rows if r < t.shape[d]],
                                        dtype=torch.long), True)
        if (spread := legal_zero(t.cpu(), zero, d)) is not None:
            check = f"; {how.strip(' ()')}, a check that nothing else in them is wrong" \
                if how else ""
            report["hint"] = f"{report['hint']}. But " + legal_zero_text(
                f"{name} in sample(s) {','.join(map(str, rows))}", spread) + check
            return True
    return False


def _records(step: Step, mb: int, inputs: bool = True, loss: bool = True
             ) -> Iterator[tuple[str, torch.Tensor, int]]:
    """(readable name, tensor, sample dim): the floating model inputs (with ``inputs``), then
    the loss's arguments that are data (a depth map; not made of the model output), also a
    model input the loss was given as its data (an autoencoder's target, its own input), where
    the model inputs are not looked at: named as both; without ``loss``, the model inputs
    alone."""
    if inputs:
        yield from root_inputs(step, mb, scalars=True)
    if not loss:  # (a forward origin's: the loss's data came after it)
        return
    entry, where = step.micro_batches[mb], samples(step, mb)
    made = set(entry.get("loss_grad_args") or ())
    given = [(key, loss_path(raw)) for key, raw in (entry.get("loss_paths") or {}).items()]
    if not inputs:
        paths, count = entry.get("paths") or {}, n_args(entry.get("inputs"))
        given += [(key, f"{batch_path(paths[key], count)} (also {name})")
                  for name, key in loss_input_refs(step, mb) if key in paths]
    for key, name in given:
        t = step.tensors.get(key)
        if key not in made and isinstance(t, torch.Tensor) and t.is_floating_point() \
                and t.numel() and (d := where.dim(t)) is not None:
            yield name, t, d


def _masked_hint(step: Step, mb: int, names: list[str], hint: str, which: str, how: str,
                 by: str | None) -> str:
    """A masked backward origin's hint: ``names`` are all 0 in its samples ``which``; an op's
    derivative sent the 0 (``by``: abs's sign(0)), else zeros the code handles, unless every
    one of them is a model input (a blank record: no mask need be the code's)."""
    said = f"{' and '.join(names)} {'is' if len(names) == 1 else 'are'} 0 everywhere in " \
        f"sample(s) {which}"
    if by:
        return f"{hint}. {said}{FLAT_ZEROS.format(by=by)}"
    inputs = {name for name, _, _ in root_inputs(step, mb, scalars=True)}
    if names and all(name in inputs for name in names):
        return f"{hint}. But {said}{_ZERO_INPUT}{how}{_TRUE_ZERO}"
    return f"{hint}. {said}{MASKED_ZEROS}"


def _zero_in(t: torch.Tensor, d: int, rows: list[int]) -> bool:
    """``t`` is not 0/1 data, all 0 in ``rows``, nonzero somewhere in every other row."""
    return not zero_one(t) and zero_rows(t, d, rows)


def _interior_zero(t: torch.Tensor, d: int, rows: list[int]) -> bool:
    """Some other sample of the integer tensor ``t`` (samples along ``d``) holds a 0 with a
    nonzero id before and after it along its last dim: 0 is an ordinary id there (a nested
    logit's nest 0 among nest 1's products), not the padding that fills a sequence's end or
    start, so a sample all 0 is no blank record (every product in one nest)."""
    if t.dim() < 2 or d == t.dim() - 1 or t.shape[-1] < 3:
        return False
    keep = torch.ones(t.shape[d], dtype=torch.bool)
    keep[[r for r in rows if 0 <= r < t.shape[d]]] = False
    other = t.index_select(d, keep.nonzero()[:, 0].to(t.device)) != 0
    before = other.int().cummax(-1).values.bool()
    after = other.flip(-1).int().cummax(-1).values.flip(-1).bool()
    return bool((~other & before & after).any())


def _ended_hint(hint: str, is_are: str, which: str, carried: list[str], how: str) -> str:
    """A fully masked row of samples all padding in a segment whose call was given the model's
    own state back (``carried``): most likely a sequence that ended in an earlier segment."""
    state = ", ".join(carried)
    return (
        f"{hint}. But {is_are} 0 everywhere in sample(s) {which} and not in any other sample, "
        f"while the loop passes the model its own state back ({state}, returned by the model "
        "the segment before): these are segments of longer sequences, and sample(s) "
        f"{which} most likely hold one that ended in an earlier segment (shorter than the "
        "batch's longest, padded to it), every position the op saw padding, the carried "
        "memory's included; no record is broken: let a padding query attend to its own "
        "position (or keep one key per row) and leave padding out of the loss, or batch "
        "sequences of similar length so that no segment is padding throughout; only an "
        f"empty sequence is to filter where the data is made{how}")

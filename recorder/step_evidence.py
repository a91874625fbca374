"""What the event finders (:mod:`recorder.events`) read of a step the single sync found
non-finite: the host copy of its row, what each entry is, and the live parameters that tell a
norm which only overflowed float32 from a non-finite tensor."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .finite import finite, tensors_kind
from .ring import StepLayout
from .samples import Samples, of_micro_batch
from .shards import local
from .tape import Tape

__all__ = ["StepEvidence"]


@dataclass
class StepEvidence:
    """What the finders read: a host copy of the step's row and what its entries are."""

    row: list[float]
    layout: StepLayout
    tape: Tape
    module_names: list[str]
    module_types: list[str]
    param_names: list[str]
    # the live parameters (in param_names order): they tell +Inf from -Inf and a squared norm
    # that overflowed float32 (finite values above ~1.8e19) from a non-finite tensor
    param_tensors: list[torch.Tensor] | None
    allowed: set[int]  # modules whose outputs may hold +-Inf
    strict_inf: bool = True
    params_from_update: bool = False  # an optimizer step ran since the previous step
    calls: list[dict[str, Any]] = field(default_factory=list)  # decoded, completion order
    # parameters changed during the step (another optimizer's step() after the forward read them;
    # a data-dependent init in the forward): what they hold now is no evidence of the step's start
    changed: set[int] = field(default_factory=set)
    rewritten: set[int] = field(default_factory=set)  # see chain.chain_origin
    overflowed: bool = False  # some non-finite norm was an overflow of finite values
    returned_inf: bool = False  # an evaluation's intended +-Inf output (chain.returned_infinity)
    arg_names: tuple = ()  # the root forward's positional parameters (see target_inputs)
    seq_first: bool = False  # the model takes sequences first (see recorder.samples)
    recurrent: bool = False  # it holds a recurrent module (hidden states: batch in dim 1)
    # no optimizer (the step is open through the loop's own update), or the weights moved
    # in place while the step was open (SAM's perturbation between its forwards)
    weights_moved: bool = False
    late: list[int] = field(default_factory=list)  # weights that update made non-finite
    # frozen parameters holding ±inf on purpose since attach (see recorder.constants)
    constants: dict[int, torch.Tensor] = field(default_factory=dict)
    stale: set[int] = field(default_factory=set)  # gradients from before it (stale_grads)

    def samples(self, mb: int) -> Samples:
        """Where micro-batch ``mb``'s tensors hold their samples."""
        return of_micro_batch(self.tape.micro_batches[mb], self.seq_first, self.recurrent,
                              self.arg_names)

    def really_bad(self, pairs: list[tuple[int, int]], grads: bool) -> list[int]:
        """The parameters of ``pairs`` (index, row entry) whose norm is non-finite and whose
        tensor (or gradient) holds a NaN/Inf; notes norms that only overflowed."""
        bad = [i for i, k in pairs if not math.isfinite(self.row[k])]
        if grads and self.stale:  # (another optimizer's, unused here: no event, as overflows)
            self.overflowed |= bool(stale := self.stale.intersection(bad))
            bad = [i for i in bad if i not in stale]
        really = bad
        if self.param_tensors is not None:
            really = []
            for i in bad:
                # (a DTensor's local shard: its own isfinite().all() would be a collective)
                t = local(self.param_tensors[i].grad if grads else self.param_tensors[i])
                if t is None or not finite(t.detach()):
                    really.append(i)
        self.overflowed |= len(really) < len(bad)
        return really

    def kind(self, indices: list[int], pairs, grads: bool = False) -> str:
        """The kind the parameters ``indices`` (or their gradients) hold: their tensors say it,
        else the row's squared norms, which lose the sign."""
        if self.param_tensors is not None:
            ts = [local(self.param_tensors[i].grad if grads else self.param_tensors[i])
                  for i in indices]
            found = tensors_kind(t for t in ts if t is not None)
            if found is not None:
                return found
        return "nan" if any(math.isnan(self.row[k]) for _, k in pairs) else "inf"

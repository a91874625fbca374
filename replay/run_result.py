"""What one re-run of the step saw: its module calls in completion order, the loss, the
parameters left with non-finite gradients, and what the model's own code raised.

:meth:`Run.forward_origin` and :meth:`Run.chain` read the forward's origin from the calls;
:meth:`Run.signature` is what two runs of a deterministic step agree on, bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from recorder.finite import finite, tensors_kind

from .source import raised_at


@dataclass
class Call:
    """One module call of a run, in completion order."""

    index: int  # completion order across the step
    module: str
    call: int  # k-th call of this module in its micro-batch
    micro_batch: int
    inputs_finite: bool
    outputs_finite: bool
    kind: str | None
    minmax: tuple  # exact (min, max) of each output, as strings, to compare runs
    parents: tuple[int, ...] = ()  # module-call ids enclosing it (outermost first)
    call_id: int = 0  # start order, for parent links
    bad_rows: list[int] = field(default_factory=list)  # samples of its non-finite output
    nan: bool = False  # an output holds NaN
    inputs_all_finite: bool = True  # no NaN/+-Inf in its inputs, allowed or not
    inputs_nan_free: bool = True
    # run inside backward (activation checkpointing's recomputation), which a forward-only
    # re-run (the bisection's probes) does not make
    in_backward: bool = False
    called_at: str | None = None  # the user's line that called the module (its caller's)
    # the type's name of a container it was given and returned (a dict it wrote its output
    # into: a sentence-transformers module's features, SchNetPack's), or IN_PLACE when it wrote
    # into an input tensor in place, replay.input_container
    returned_input: str | None = None
    # it wrote a non-finite value into its running statistics (its outputs finite or not):
    # state, an event by the default policy as a NaN is (recorder.running_stats)
    statistic: bool = False
    bits: tuple = ()  # its outputs' bits summed as integers, to compare runs bit for bit
    sums: tuple = ()  # its outputs' finite values' sum and absolute sum, output after output


@dataclass
class Run:
    calls: list[Call] = field(default_factory=list)
    # one entry per micro-batch that computed a loss, in order (not every micro-batch does:
    # two forwards of one contrastive loss); loss_micro_batches[j] is entry j's micro-batch
    loss_finite: list[bool] = field(default_factory=list)
    loss_micro_batches: list[int] = field(default_factory=list)
    loss_values: list[str] = field(default_factory=list)
    # the sign verdicts on its outputs' nodes, taken before its backward (replay.kept_signs)
    kept_signs: list = field(default_factory=list)
    # whether entry j's recorded loss arguments (targets, not the model output) were finite
    loss_args_finite: list[bool] = field(default_factory=list)
    # the micro-batches whose loss arguments held a non-finite value, known before the loss
    # ran (also of a loss that raised: a distribution's validation refusing what it computed)
    bad_loss_data: set = field(default_factory=set)
    losses: list = field(default_factory=list)  # each micro-batch's loss (replay.window)
    bad_grads: list[str] = field(default_factory=list)
    # micro-batch -> (parameters, kind) of the non-finite gradients the loop dropped before it
    # (a zero_grad with no step(): an update skipped on a non-finite gradient norm)
    dropped: dict[int, tuple[list[str], str | None]] = field(default_factory=dict)
    outputs: list[list[torch.Tensor]] = field(default_factory=list)
    objects: list = field(default_factory=list)  # each micro-batch's output as returned
    # each micro-batch's input tensors as the model took them, by bundle key (a loss's $in)
    inputs: list[dict[str, torch.Tensor]] = field(default_factory=list)
    error: Exception | None = None  # what the model's own code raised, ending the run there
    # micro-batch -> (phase, error) of a loss or backward that raised where the loop went on
    # past it in training (replay.handled_loss)
    handled: dict[int, tuple[str, str]] = field(default_factory=dict)
    strict_inf: bool = True  # the recording's policy (see FlightRecorder's strict_inf)
    allowed: frozenset = frozenset()  # modules allowed to hold +-Inf (allow_inf)
    # micro-batches whose inputs' infinities are all additive -inf masks (intended)
    masked: set = field(default_factory=set)
    # call id -> (module, micro-batch, (input flags, enclosing call ids)) of the calls that
    # started and never returned: the model raised inside them
    open: dict = field(default_factory=dict)

    @property
    def raised(self) -> str | None:
        """``error`` in one line (``"RuntimeError: ..."``), or None."""
        e = self.error
        if e is None:
            return None
        if not str(e).strip():  # a bare ``assert`` in the model: where, as there is no what
            at = raised_at(e)
            return type(e).__name__ + (f" at {at}" if at else "")
        return " ".join(f"{type(e).__name__}: {e}".split())

    def loss_phase(self, j: int) -> str:
        """``"input"`` when loss entry ``j`` took a non-finite target (a reward of +inf in a
        DQN's TD target: the recorder's event is an input event), else ``"loss"``."""
        ok = self.loss_args_finite
        return "input" if j < len(ok) and not ok[j] else "loss"

    def loss_first(self, origin: Call | None) -> bool:
        """A micro-batch's loss went non-finite before the forward ``origin``'s micro-batch
        ran, as the recorder orders them (each micro-batch's forward, then its loss): an
        autoregressive rollout's lead-0 loss overflowed on a forecast that lead 1's forward
        then made NaN of. The loss is the origin then."""
        return origin is not None and any(
            not ok and mb < origin.micro_batch
            for ok, mb in zip(self.loss_finite, self.loss_micro_batches))

    def forward_origin(self) -> Call | None:
        """First call (completion order) to make a non-finite output from finite inputs; by
        the default policy, where the chain of the forward event starts (:meth:`chain`)."""
        if not self.strict_inf:
            return self.chain()[0]
        bad = [c for c in self.calls if not c.outputs_finite]
        made = [c for c in bad if c.inputs_finite]
        if not made and bad and self.open:  # the call whose own code made it raised
            return self._enclosing_maker(bad[0]) or bad[0]
        return made[0] if made else (bad[0] if bad else None)

    def chain(self) -> tuple[Call | None, Call | None, bool]:
        """By the default policy (``strict_inf=False``, as ``recorder.events`` decides): the
        call where the forward event's chain starts, the event's call (the first NaN made from
        NaN-free inputs, else a +-Inf in the root output), and whether the chain started in
        the batch (+-Inf that came in; the first call is then the root's). When the event's
        inputs held an infinity that no call made, the chain starts in the innermost call
        enclosing it with finite inputs, whose own code made it (``log(0)`` in the root's
        forward, passed to a submodule). Nones: no event."""
        calls, allowed = self.calls, self.allowed
        nan = [c for c in calls if c.nan or c.statistic]
        made = [c for c in nan if c.inputs_nan_free]
        trigger = made[0] if made else (nan[0] if nan else None)
        if trigger is None:
            trigger = next((c for c in calls if c.module == "" and not c.outputs_finite
                            and "" not in allowed), None)
        if trigger is None:
            return None, None, False
        before = [c for c in calls[:calls.index(trigger)]
                  if c.micro_batch == trigger.micro_batch and not c.outputs_finite
                  and c.inputs_finite and c.module not in allowed]  # (a mask's -inf: finite)
        if trigger.inputs_all_finite:  # made inside it: by it, or by a call it encloses
            # unless a call that ended before it began made an infinity first, which the
            # code enclosing both turned into NaN (an MoE router's overflowed logits, a
            # softmax's NaN, before the expert that completed first overflowed on that record)
            earlier = [c for c in before if c.call_id < trigger.call_id]
            return (earlier or [self.made_inside(trigger)])[0], trigger, False
        infs = [c for c in before if not c.nan]
        if infs:  # it consumed an infinity made earlier (an overflow)
            return infs[0], trigger, False
        maker = None if trigger.inputs_finite else self._enclosing_maker(trigger)
        if maker is not None:  # no call made it: the own code of one enclosing the event did
            return maker, trigger, False
        root = next((c for c in calls if c.module == "" and c.micro_batch == trigger.micro_batch
                     and not c.inputs_all_finite), None)
        if trigger.micro_batch in self.masked:  # a -inf mask came in: intended, as recorded
            return trigger, trigger, False
        if root is None and self._from_loss_data(trigger):  # (the loss's targets held it)
            return trigger, trigger, True
        return (root or trigger), trigger, root is not None

    def made_inside(self, trigger: Call) -> Call:
        """The first call inside ``trigger`` (or itself) that made a non-finite value from
        finite inputs: where the recorder's chain starts when ``trigger``'s inputs were all
        finite, which :meth:`chain` passes over for an infinity made before ``trigger`` began."""
        return next((c for c in self.calls[:self.calls.index(trigger)]
                     if c.micro_batch == trigger.micro_batch and not c.outputs_finite
                     and c.inputs_finite and c.module not in self.allowed
                     and trigger.call_id in c.parents), trigger)

    def _from_loss_data(self, call: Call) -> bool:
        """``call`` ran outside its micro-batch's root forward (a module the loss called: a
        zuko flow's hyper-network, built lazily and run inside ``log_prob`` on the loss's
        data) and that micro-batch's loss took non-finite data: no call made what it took."""
        roots = {c.call_id for c in self.calls
                 if c.module == "" and c.micro_batch == call.micro_batch}
        return call.module != "" and not roots.intersection(call.parents) \
            and call.micro_batch in self.bad_loss_data

    def _enclosing_maker(self, call: Call) -> Call | None:
        """The innermost call enclosing ``call`` whose inputs were finite (a mask's intended
        -inf aside: a transformer layer's own residual sum), among those that
        returned and those the model raised in (the root's, when a distribution's
        ``validate_args`` refused the NaN its own code made)."""
        by_id = {c.call_id: c for c in self.calls}
        return next((p for i in reversed(call.parents)
                     if (p := by_id.get(i) or self._unfinished(i)) is not None
                     and (p.inputs_finite if p.module else p.inputs_all_finite)), None)

    def _unfinished(self, call_id: int) -> Call | None:
        """The call ``call_id`` that never returned, as a :class:`Call` with no outputs."""
        if call_id not in self.open:
            return None
        name, mb, ((ok, every, nan_free), parents) = self.open[call_id]
        k = sum(1 for c in self.calls if c.module == name and c.micro_batch == mb)
        return Call(len(self.calls), name, k, mb, ok, True, None, (), parents, call_id,
                    inputs_all_finite=every, inputs_nan_free=nan_free)

    def forward_calls(self) -> int:
        """How many calls a forward-only re-run makes (the backward's recomputations left out)."""
        return sum(not c.in_backward for c in self.calls)

    def signature(self) -> tuple:
        """What two runs of a deterministic step must agree on, bit for bit."""
        # (the rows too: two runs NaN in other rows have the same min and max, NaN)
        return (tuple((c.module, c.call, c.micro_batch, c.minmax, tuple(c.bad_rows), c.bits)
                      for c in self.calls),
                tuple(self.loss_values), tuple(self.bad_grads), self.raised)

    def same_but_rounding(self, other: Run, rel: float = 1e-3) -> bool:
        """``other`` made the same calls, each non-finite where and as this run's (the same
        rows), the same losses' and gradients' verdicts and the same error, every (min, max)
        and loss value within ``rel`` of this run's: two runs of a kernel that rounds
        differently each time (CUDA's atomic adds), not two computations."""
        if len(self.calls) != len(other.calls) or (
                self.loss_finite, self.bad_grads, self.raised) != (
                other.loss_finite, other.bad_grads, other.raised):
            return False
        for a, b in zip(self.calls, other.calls):
            if (a.module, a.call, a.micro_batch, a.outputs_finite, a.kind, a.bad_rows, a.nan) \
                    != (b.module, b.call, b.micro_batch, b.outputs_finite, b.kind, b.bad_rows,
                        b.nan) or len(a.minmax) != len(b.minmax):
                return False
            if not all(_near(x, y, rel) for pa, pb in zip(a.minmax, b.minmax)
                       for x, y in zip(pa, pb)) or not _sums_near(a.sums, b.sums, rel):
                return False
        return len(self.loss_values) == len(other.loss_values) and all(
            len(la.split(";")) == len(lb.split(";"))
            and all(_near(x, y, rel) for x, y in zip(la.split(";"), lb.split(";")))
            for la, lb in zip(self.loss_values, other.loss_values))


def _sums_near(a: tuple, b: tuple, rel: float) -> bool:
    """Each output's finite sums (sum, absolute sum) within ``rel`` of the absolute sum."""
    return len(a) == len(b) and all(
        abs(a[i] - b[i]) <= rel * max(a[i + 1], b[i + 1]) + 1e-6
        and math.isclose(a[i + 1], b[i + 1], rel_tol=rel, abs_tol=1e-6)
        for i in range(0, len(a), 2))


def _near(a: str, b: str, rel: float) -> bool:
    """Two values as :class:`Call` and ``loss_values`` keep them (``repr``), within ``rel``;
    NaN near NaN only, an infinity near the same infinity only."""
    x, y = float(a), float(b)
    if math.isnan(x) or math.isnan(y):
        return math.isnan(x) and math.isnan(y)
    return x == y or math.isclose(x, y, rel_tol=rel, abs_tol=1e-6)


def dropped_non_finite(model: torch.nn.Module) -> tuple[list[str], str | None]:
    """The parameters whose gradients are non-finite, and their kind, as a loop drops them."""
    bad = [(n, p.grad) for n, p in model.named_parameters()
           if p.grad is not None and not finite(p.grad)]
    return [n for n, _ in bad], tensors_kind([g for _, g in bad])

"""The recorder's settings: one frozen dataclass, checked once when it is built.

:class:`~recorder.FlightRecorder` takes these as keyword arguments (documented there) and builds
a :class:`Settings`; the Trainer callbacks check their options with :func:`check_callback_options`
when they are built, reading the same fields, so a mistake surfaces before training starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .lossdesc import factory_path
from .partial_writes import sweep
from .validate import (
    check_factory,
    check_factory_kwargs,
    check_loss_fn,
    check_writable,
    out_dir_path,
)

ON_EVENT = ("raise", "warn")
STATS = ("minmax", "full")
# the lowest value each integer setting takes
_COUNTS = {"start_step": 0, "max_skipped_steps": 0, "max_micro_batches": 1}


@dataclass(frozen=True)
class Settings:
    """What the recorder checks and keeps, as given to :class:`~recorder.FlightRecorder`."""

    out_dir: Path = Path("nan-bundles")  # where bundles go (created if missing)
    # "module:function" that rebuilds the model for the replay (or the function: stored so)
    factory: Any = None
    factory_kwargs: dict[str, Any] | None = None  # JSON keyword arguments for the factory
    history: int = 64  # steps kept in the ring buffer
    on_event: str = "raise"  # "raise" NonFiniteError, or "warn" (log once, keep training)
    allow_inf: tuple[str, ...] = ()  # fnmatch patterns of names that may hold +-Inf
    # fnmatch patterns of root inputs that may hold NaN (missing values the model imputes)
    allow_nan: tuple[str, ...] = ()
    strict_inf: bool = False  # every +-Inf is an event (else only those that matter)
    min_scale: float = 1.0  # a GradScaler scale below this (or not finite) is an event
    max_skipped_steps: int = 50  # more skips in a row (GradScaler, end_step(skipped=True)) are an event
    guard_optimizer: bool = False  # copy the update's inputs, check weights right after it
    stats: str = "minmax"  # "full" adds means, RMS and parameter norms
    start_step: int = 0  # index of the first recorded step
    max_micro_batches: int = 1024  # a step without optimizer.step() closes after this many
    rewind: int | None = None  # steps between copies of the training state (None: off)

    def __post_init__(self):
        put = object.__setattr__  # (frozen: normalised once, here)
        if self.factory is not None and not isinstance(self.factory, str):  # the function
            path, kwargs = factory_path(self.factory, self.factory_kwargs)
            put(self, "factory", path)
            put(self, "factory_kwargs", kwargs)
        put(self, "out_dir", out_dir_path(self.out_dir))
        self._check()
        put(self, "allow_inf", tuple(self.allow_inf))
        put(self, "allow_nan", tuple(self.allow_nan))
        put(self, "min_scale", float(self.min_scale))
        put(self, "guard_optimizer", bool(self.guard_optimizer))
        if self.factory_kwargs is not None:
            put(self, "factory_kwargs", dict(self.factory_kwargs))

    @property
    def param_norms(self) -> bool:
        """Every step reads every weight (``stats="full"``); by default weights are read only
        when an event needs them, as a pass over them costs as much as the gradient norms."""
        return self.stats == "full"

    def _check(self) -> None:
        if self.on_event not in ON_EVENT:
            raise ValueError(f"FlightRecorder: on_event must be 'raise' or 'warn', got "
                             f"{self.on_event!r}")
        if not isinstance(self.history, int) or self.history < 1:
            raise ValueError(f"FlightRecorder: history must be a positive int, got "
                             f"{self.history!r}")
        for name, example in (("allow_inf", "['*.attn.mask']"), ("allow_nan", "['args[0]']")):
            allow = getattr(self, name)
            if isinstance(allow, str) or not all(isinstance(p, str) for p in allow):
                raise TypeError(f"FlightRecorder: {name} must be a list of name patterns such "
                                f"as {example}")
        check_writable(self.out_dir)
        sweep(self.out_dir)  # (once, as the recorder is built: never on a step's path)
        if self.factory is not None:
            check_factory(self.factory)
        for name, low in _COUNTS.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"FlightRecorder: {name} must be an int >= {low}, got {v!r}")
        if self.stats not in STATS:
            raise ValueError(f"FlightRecorder: stats must be 'minmax' or 'full', got "
                             f"{self.stats!r}")
        v = self.min_scale
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or v < 0:
            raise ValueError(f"FlightRecorder: min_scale must be a finite number >= 0 (0 turns "
                             f"the scale-collapse check off), got {v!r}")
        if not isinstance(self.strict_inf, bool):
            raise TypeError(f"FlightRecorder: strict_inf must be True (every +-Inf is an event) "
                            f"or False (the default: only a +-Inf that reaches the output, the "
                            f"loss, a gradient or a weight, or turns into NaN), got "
                            f"{self.strict_inf!r}")
        check_factory_kwargs(self.factory_kwargs, "FlightRecorder: factory_kwargs")
        v = self.rewind
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"FlightRecorder: rewind must be an int >= 1 (steps between copies "
                             f"of the training state; the window is rewind to 2*rewind steps) "
                             f"or None to turn it off, got {v!r}")


SETTINGS = tuple(f.name for f in dataclasses.fields(Settings))
# FlightRecorder's keyword arguments that are objects, not settings
OBJECTS = ("loss_fn", "scaler", "lr_scheduler")
# what a Trainer callback takes from the Trainer instead of its options
FROM_TRAINER = ("optimizer", "scaler", "lr_scheduler", "start_step")


# what other tools call FlightRecorder's keyword arguments (difflib finds spelling slips)
_ALIASES = {"loss": "loss_fn", "criterion": "loss_fn", "loss_func": "loss_fn",
            "outdir": "out_dir", "output_dir": "out_dir", "save_dir": "out_dir",
            "scheduler": "lr_scheduler", "grad_scaler": "scaler", "mode": "on_event"}


def unknown_options(owner: str, unknown: list[str], known: list[str]) -> str:
    """The one line for keyword arguments ``owner`` does not take: each with the known name
    it most likely means (``loss=`` for ``loss_fn=``), else the list of known ones."""
    meant = {k: _ALIASES.get(k) or next(iter(difflib.get_close_matches(k, known, 1, 0.6)), None)
             for k in unknown}
    if all(meant.values()):
        return (f"{owner}: unknown keyword argument(s) {', '.join(unknown)}; did you mean "
                f"{', '.join(f'{m}=' for m in meant.values())}?")
    return (f"{owner}: unknown keyword argument(s) {', '.join(unknown)}; it takes "
            f"{', '.join(known)}")


def check_callback_options(loss_fn, options: dict[str, Any]) -> None:
    """A training-framework callback's options, checked when it is built: the Trainer supplies
    the optimizer, scheduler, scaler and first step; the rest are FlightRecorder's."""
    taken = [k for k in FROM_TRAINER if k in options]
    if taken:
        raise TypeError(f"FlightRecorderCallback: {', '.join(taken)} come(s) from the Trainer; "
                        "leave them out")
    known = set(SETTINGS) | set(OBJECTS)
    if unknown := sorted(set(options) - known):
        raise TypeError(unknown_options("FlightRecorderCallback", unknown,
                                        sorted(known - set(FROM_TRAINER))))
    check_loss_fn(loss_fn)
    Settings(**{k: v for k, v in options.items() if k in SETTINGS})

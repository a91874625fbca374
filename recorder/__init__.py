"""nanreplay's flight recorder: per-layer statistics on the device, guards, and ``.nan`` bundles.

>>> from recorder import FlightRecorder, NonFiniteError      # doctest: +SKIP
>>> with FlightRecorder(model, optimizer, loss_fn=criterion, out_dir="nan-bundles"):
...     train()   # raises NonFiniteError(bundle_path=...) at the first NaN/Inf

Layout (dependencies run one way, top to bottom): :mod:`~recorder.flight` is the facade that
builds the parts; :mod:`~recorder.guard` (optimizer hooks) and :mod:`~recorder.calls` (module,
loss and gradient hooks) write into the step that :mod:`~recorder.cycle` opens and closes with
one host read (helped by :mod:`~recorder.grads` and :mod:`~recorder.buffers`; with
``rewind=N`` it also keeps the copies and step log of :mod:`~recorder.rewind`);
:mod:`~recorder.alarm` turns a failed check into an :class:`~recorder.events.Event`
(:mod:`~recorder.events`) and a bundle (:mod:`~recorder.snapshot`, :mod:`~recorder.bundle`;
:mod:`~recorder.entries` writes a micro-batch and a parameter group the same way for the
event step and the rewind window);
:mod:`~recorder.target` is what is recorded and :mod:`~recorder.settings` how. Under
torch.distributed, :mod:`~recorder.ranks` makes the ranks agree on each step's verdict and on
who saw an event first, and :mod:`~recorder.shards` says what FSDP2's local shards are.
:mod:`~recorder.tape`, :mod:`~recorder.slots` and :mod:`~recorder.ring` hold the statistics,
:mod:`~recorder.finite` says what is finite, and every private PyTorch API is in
:mod:`~recorder.compat`.
"""

from .errors import BundleError, NonFiniteError

__all__ = ["FlightRecorder", "NonFiniteError", "BundleError"]


def __getattr__(name: str):
    # FlightRecorder is imported at its first use, not with the package: ``nanreplay --info``
    # and ``--help`` import recorder.errors and recorder.bundle, which run this file, and
    # must not pay for every hook module (seconds of torch imports).
    if name == "FlightRecorder":
        from .flight import FlightRecorder

        return FlightRecorder
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""nanreplay's replayer: re-runs the step in a ``.nan`` bundle and names the op, module,
samples and cause of its first non-finite value. The command line is ``nanreplay``.

>>> from replay import replay                                  # doctest: +SKIP
>>> report = replay("nan-bundles/step00000006-rank0.nan")
>>> report["origin"]["op"], report["cause"]
('aten.log', 'invalid')

Layout, in the order a replay goes (each module imports only those before it):

- ``compat``: every private PyTorch API used here (dispatch mode, pytree, version counters,
  op schemas, module tables); ``errors``: ``ReplayError`` and the run-ending ``StopRun``;
- ``trust``, ``factory``, ``losses``, ``shards``, ``load``, ``strip``: the trust rule for
  recorded names; resolving the model factory; rebuilding the loss; one distributed event's
  bundles (siblings, the first rank, full tensors from shards); ``read_step`` / ``build``
  (model, weights, optimizer, batches); shareable copies (of a shard set too);
- ``source``, ``memo``, ``ops``: whose code a frame is; values kept per unmodified tensor; the
  aten op finder (``OpFinder``), the float64 mode and the op capture;
- ``run_result``, ``instrument``, ``bisection``, ``precision``, ``rerun``: what a re-run saw
  (``Run``, ``Call``); the instrumented pass; the probes and the bisection; FSDP2's mixed
  precision dtypes; ``Runner``, which runs the step as recorded (or in float64) with those
  hooks;
- ``fidelity``, ``outside``, ``backward``, ``domains``, ``cause_text``, ``cause``: is the
  rebuilt model the recorded one; a loss outside the model; the backward node finder; the cause
  and its words;
- ``precursors``, ``findings``, ``recorded``, ``forward``, ``origins``: the history; the
  report's fields; what the bundle alone says; localising each phase;
- ``window``, ``rewind_text``, ``whatif``, ``window_report``: re-running a rewind window
  (``FlightRecorder(rewind=N)``) or the recorded step with a ``Change``; their words in the
  reports; the ``--try`` what-ifs; the report's ``window`` part;
- ``analyze``: the analysis that picks the phase, then the window and the what-ifs;
- ``report``, ``html``, ``cli``: the text/JSON report and ``--info``, the HTML page, the
  ``nanreplay`` command.
"""

from __future__ import annotations

from .errors import ReplayError


def replay(path, *, factory=None, device: str | None = None,
           factory_kwargs: dict | None = None, tries: list[str] | None = None) -> dict:
    """The report for one bundle, as ``nanreplay --json`` prints it (plus ``history``);
    ``factory``: ``"module:function"``, or the function (or model class) itself, called with
    ``factory_kwargs`` (a notebook's own ``make_model``: trusted, as the caller passes it);
    ``factory_kwargs`` replace the recorded ones; ``tries`` are ``--try`` what-ifs
    (``["lr=0.1x", "auto"]``)."""
    from .analyze import analyze_bundle

    return analyze_bundle(path, factory, device, factory_kwargs, tries or ())


__all__ = ["replay", "ReplayError"]

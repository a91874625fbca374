"""nanreplay's replayer: re-runs the step in a ``.nan`` bundle and names the op, module,
samples and cause of its first non-finite value. The command line is ``nanreplay``.

>>> from replay import replay                                  # doctest: +SKIP
>>> report = replay("nan-bundles/step00000006-rank0.nan")
>>> report["origin"]["op"], report["cause"]
('aten.log', 'invalid')

``replay(path, factory=, factory_kwargs=, device=, tries=, html=, debug=)`` is ``nanreplay``'s
options as arguments (``path`` may be the run's out_dir); ``bundle_info`` is ``--info``,
``strip_bundle`` is ``--strip``, ``report_text`` / ``report_json`` the command's outputs
(:mod:`replay.api`). Its errors are ``ReplayError`` / ``BundleError``, one line each.

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
  ``nanreplay`` command; ``bundle_dir``, ``api_words``, ``api``: a run's out_dir given as the
  bundle; the options' words in the Python API; the Python API.
"""

from __future__ import annotations

from recorder.errors import BundleError

from .api import bundle_info, replay, report_json, report_text, strip_bundle
from .errors import ReplayError

__all__ = ["replay", "bundle_info", "strip_bundle", "report_text", "report_json", "ReplayError",
           "BundleError"]

"""The window's steps run plainly (``replay.window._run_step``): instrumented only where a step
went wrong. What the replay reports must be what re-running every step instrumented reports,
for each planted bug of ``test_rewind.py`` and its what-ifs (those that stay finite run every
step plainly; those that do not, instrumented at the step where they go non-finite)."""

from __future__ import annotations

import json

import pytest
import test_rewind as T

from replay import instrument, window


def _report(bundle, tries):
    from replay import replay

    rep = replay(bundle, tries=tries)
    rep.pop("history")
    return json.dumps(rep, sort_keys=True, default=repr)  # (a NaN loss equals itself here)


@pytest.mark.parametrize("loop, tries", [
    (T.lr_spike, ["lr=1e-4x", "drop=0"]),
    (T.rare_tokens, ["eps=1e-8", "lr=0.1x"]),
    (T.late_input, ["auto"]),
    (T.drifting_fp16, ["auto", "drop=0"]),
])
def test_plain_window_reports_what_an_instrumented_one_does(out_dir, monkeypatch, loop, tries):
    monkeypatch.chdir(T.HERE)  # where the factories' modules live
    bundle = loop(out_dir).bundle_path
    installs = []
    real = instrument.CallRecorder.install
    monkeypatch.setattr(instrument.CallRecorder, "install",
                        lambda self, model: installs.append(1) or real(self, model))
    plain = _report(bundle, tries)
    plain_installs = len(installs)
    monkeypatch.setattr(window, "_run_step", lambda runner: runner.run())
    installs.clear()
    every = _report(bundle, tries)
    assert plain == every
    # the instrumented pass ran for fewer steps: not for those the plain check passed
    assert plain_installs < len(installs), (plain_installs, len(installs))

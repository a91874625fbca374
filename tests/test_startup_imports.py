"""What ``nanreplay --help``, ``--info`` and ``--strip`` and ``import recorder`` import: none
of them may pull in the replay's machinery, the recorder's hooks or ``torch._dynamo`` (seconds
of imports, paid by every bundle a user or a CI script inspects). Checked on ``sys.modules``
in a fresh interpreter, not by timing."""

from __future__ import annotations

import json
import subprocess
import sys

from bundles import ROOT, shared_toy_bundle

# runs each command line as the nanreplay script does, then says which modules are loaded
_PROBE = """
import json, runpy, sys
def loaded():
    return sorted(m for m in sys.modules if m in WATCHED)
WATCHED = {"torch", "torch._dynamo", "recorder.flight", "replay.analyze", "replay.load"}
seen = {}
import recorder
seen["import recorder"] = loaded()
for args in json.loads(sys.argv[1]):
    sys.argv = ["nanreplay", *args]
    try:
        runpy.run_module("replay.cli", run_name="__main__")
    except SystemExit as e:
        assert e.code == 0, (args, e.code)
    seen[args[0]] = loaded()
import torch
from recorder import FlightRecorder
seen["from recorder import FlightRecorder"] = loaded()
model = torch.nn.Linear(2, 2)
with FlightRecorder(model, torch.optim.SGD(model.parameters(), lr=0.1), out_dir="unused"):
    hooks = list(model._forward_pre_hooks.values())
    seen["attached"] = loaded()
# a model compiled after attach must not trace the hooks: wrapped for dynamo all the same
seen["fenced"] = [getattr(h.func, "_torchdynamo_disable", False) for h in hooks]
print(json.dumps(seen))
"""


def test_startup_imports_only_what_each_command_needs(tmp_path_factory, tmp_path):
    bundle = str(shared_toy_bundle(tmp_path_factory))
    runs = [["--help"], ["--info", bundle, "--json"], ["--info", bundle],
            [bundle, "--strip", "batch", "-o", str(tmp_path / "shared.nan")]]
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(runs)], cwd=tmp_path,
                         env={"PYTHONPATH": str(ROOT), "PATH": ""}, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.splitlines()[-1])
    # import recorder, --help and --info (text and JSON) read no tensor: not even torch
    assert seen["import recorder"] == []
    assert seen["--help"] == []
    assert seen["--info"] == []
    # --strip copies tensors (torch), and needs nothing of the replay or the recorder's hooks
    assert seen[bundle] == ["torch"]
    # the recorder: dynamo is imported at attach, where its hooks are wrapped for it
    assert seen["from recorder import FlightRecorder"] == ["recorder.flight", "torch"]
    assert seen["attached"] == ["recorder.flight", "torch", "torch._dynamo"]
    assert seen["fenced"] == [True]
    assert (tmp_path / "shared.nan").is_file()

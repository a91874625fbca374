#!/usr/bin/env python
"""Per-step overhead of NaN/Inf detectors, measured side by side in one process.

For each model, one model + Adam copy is built per detector from the same seed. Single training
steps (zero_grad, forward, loss, backward, optimizer.step) then alternate round-robin across the
copies, on the same batch within a round and with the starting copy rotated every round, so slow
drifts of a shared, noisy machine hit every detector alike. Each detector's step time is divided
by the bare step time of the same round; the table reports the median of those ratios and their
interquartile range, plus the median step time.

Detectors:

- ``bare``: no detection at all (the baseline);
- ``hooks``: the usual recipe: a forward hook on every module doing
  ``if torch.isnan(out).any() or torch.isinf(out).any(): raise`` and, after backward, a
  total-gradient-norm check ``if not torch.isfinite(clip_grad_norm_(params, inf)): raise``;
- ``anomaly``: ``torch.autograd.set_detect_anomaly(True)``, enabled only around this copy's steps;
- ``debug_uo``: ``transformers.debug_utils.DebugUnderflowOverflow`` (skipped when transformers is
  not installed);
- ``recorder``: ``FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp).attach()``.

After timing, a few more steps per copy count host reads (syncs): ``Tensor.item``, ``__bool__``,
``tolist``, ``__float__``, ``__int__`` and ``__index__`` are wrapped with counters (reads of the
optimizer's own CPU ``step`` counters, which Adam does every step and which never touch the
device, are left out). On CUDA, ``torch.cuda.set_sync_debug_mode("warn")`` warnings are counted
too. Counting runs in separate steps so the wrappers never slow the timed ones.

    python benchmarks/overhead.py [--models mlp,cnn,transformer,mlp16,cnn_cl,lm_small]
                                  [--rounds N]
                                  [--device cpu|cuda] [--json out.json] [--quick]
                                  [--processes N] [--compile]

Progress goes to stderr, the markdown tables to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from recorder import FlightRecorder  # noqa: E402
from recorder.capture import tensor_leaves  # noqa: E402
from recorder.slots import split_extrema  # noqa: E402

SEED = 1234
DETECTORS = ("bare", "hooks", "anomaly", "debug_uo", "recorder")
MODELS = ("mlp", "cnn", "transformer")
# Timed rounds per model for a full CPU run (about 5-10 minutes on 2 cores in all).
DEFAULT_ROUNDS = {"mlp": 600, "cnn": 120, "transformer": 80, "mlp16": 3000, "cnn_cl": 120,
                  "lm_small": 600}
RATIO_TARGET = 1.05
FLOOR_GAP_TARGET = 0.02  # the recorder's own cost above the floor, in bare steps


# ----------------------------------------------------------------------------------------------
# models


class MLP(nn.Module):
    """5 Linear layers of width 512 with ReLU between; 10 classes."""

    def __init__(self, width: int = 512, depth: int = 5, classes: int = 10):
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(depth):
            layers.append(nn.Linear(width, classes if i == depth - 1 else width))
            if i < depth - 1:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """CIFAR-style ResNet: a 3x3 stem and 6 residual blocks (16, 16, 32, 32, 64, 64 channels)."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16),
                                  nn.ReLU())
        plan = [(16, 16, 1), (16, 16, 1), (16, 32, 2), (32, 32, 1), (32, 64, 2), (64, 64, 1)]
        self.blocks = nn.Sequential(*(BasicBlock(a, b, s) for a, b, s in plan))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, classes)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))


class CausalSelfAttention(nn.Module):
    """Multi-head attention with an additive causal mask of -inf above the diagonal."""

    def __init__(self, d: int, heads: int, seq: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        mask = torch.full((seq, seq), float("-inf")).triu(1)
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
        att = F.softmax(att + self.causal_mask[:t, :t], dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, d: int, heads: int, seq: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads, seq)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Transformer(nn.Module):
    """GPT-style decoder: 4 layers, d=256, 4 heads, learned positions, untied head."""

    def __init__(self, vocab: int = 1024, d: int = 256, layers: int = 4, heads: int = 4,
                 seq: int = 128):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(1, seq, d))
        self.blocks = nn.Sequential(*(Block(d, heads, seq) for _ in range(layers)))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[:, : idx.shape[1]]
        return self.head(self.ln(self.blocks(x)))


class ModelSpec:
    """How to build one benchmark model, its batches and its loss arguments."""

    def __init__(self, name, build, make_batch, describe, flatten=False):
        self.name = name
        self.build = build
        self.make_batch = make_batch
        self.describe = describe
        self.flatten = flatten

    def loss_args(self, out, y):
        if self.flatten:  # next-token cross-entropy over every position
            return out.reshape(-1, out.shape[-1]), y.reshape(-1)
        return out, y


def _mlp_batch(g, device):
    return (torch.randn(64, 512, generator=g).to(device),
            torch.randint(0, 10, (64,), generator=g).to(device))


def _mlp16_batch(g, device):
    return (torch.randn(4, 16, generator=g).to(device),
            torch.randint(0, 10, (4,), generator=g).to(device))


def _cnn_batch(g, device):
    return (torch.randn(32, 3, 32, 32, generator=g).to(device),
            torch.randint(0, 10, (32,), generator=g).to(device))


def _cnn_cl_batch(g, device):
    x, y = _cnn_batch(g, device)
    return x.contiguous(memory_format=torch.channels_last), y


def _lm_batch(g, device, seq: int = 128):
    tokens = torch.randint(0, 1024, (8, seq + 1), generator=g)
    return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)


SPECS = {
    "mlp": ModelSpec("mlp", MLP, _mlp_batch, "5-layer MLP, width 512, batch 64"),
    "cnn": ModelSpec("cnn", ResNet, _cnn_batch,
                     "ResNet-style CNN, 6 residual blocks, 32x32 images, batch 32"),
    "transformer": ModelSpec("transformer", Transformer, _lm_batch,
                             "4-layer causal transformer, d=256, seq 128, batch 8, -inf mask",
                             flatten=True),
    # opt-in (--models mlp16): the same MLP at width 16, batch 4, where the device work is
    # next to nothing, so a detector's extra step time is its Python bookkeeping, in us
    "mlp16": ModelSpec("mlp16", lambda: MLP(width=16), _mlp16_batch,
                       "5-layer MLP, width 16, batch 4 (bookkeeping only)"),
    # opt-in (--models cnn_cl): the CNN in channels-last memory format, as PyTorch's
    # performance guide recommends for convolutions; its activations are not contiguous
    "cnn_cl": ModelSpec("cnn_cl", lambda: ResNet().to(memory_format=torch.channels_last),
                        _cnn_cl_batch, "the ResNet-style CNN in channels-last memory format"),
    # opt-in (--models lm_small): the transformer at a small model's size (2 layers, d=64,
    # seq 64), as tutorials and first experiments train it, where a step is ~20 ms on CPU and
    # a per-module detector costs the most relative to it
    "lm_small": ModelSpec("lm_small", lambda: Transformer(d=64, layers=2, seq=64),
                          lambda g, device: _lm_batch(g, device, seq=64),
                          "2-layer causal transformer, d=64, seq 64, batch 8, -inf mask",
                          flatten=True),
}


# ----------------------------------------------------------------------------------------------
# detectors: one model + optimizer copy each


class Trainer:
    """The bare training step; subclasses add one detector each."""

    name = "bare"

    def __init__(self, spec: ModelSpec, device: torch.device, tmp: str, compiled: bool = False):
        torch.manual_seed(SEED)
        self.spec = spec
        self.model = spec.build().to(device)
        if compiled:  # every copy alike, so "bare" is the compiled model without a detector
            self.model = torch.compile(self.model)
        self.crit = nn.CrossEntropyLoss()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.setup(tmp)

    def setup(self, tmp: str) -> None:
        pass

    def step(self, x, y) -> None:
        self.opt.zero_grad(set_to_none=True)
        out = self.model(x)
        loss = self.crit(*self.spec.loss_args(out, y))
        loss.backward()
        self.after_backward()
        self.opt.step()

    def after_backward(self) -> None:
        pass

    def optimizer_counters(self) -> set[int]:
        """ids of the optimizer's host-side step counters (Adam reads them every step)."""
        return {id(st["step"]) for st in self.opt.state.values()
                if isinstance(st.get("step"), torch.Tensor)}

    def close(self) -> None:
        pass


def _nan_inf_hook(module, inputs, output):
    for t in tensor_leaves(output):
        if t.is_floating_point() and (torch.isnan(t).any() or torch.isinf(t).any()):
            raise FloatingPointError(f"non-finite output from {type(module).__name__}")


class HookRecipe(Trainer):
    name = "hooks"

    def setup(self, tmp):
        self.handles = [m.register_forward_hook(_nan_inf_hook) for m in self.model.modules()]

    def after_backward(self):
        norm = torch.nn.utils.clip_grad_norm_(self.params, float("inf"))
        if not torch.isfinite(norm):
            raise FloatingPointError("non-finite gradient norm")

    def close(self):
        for h in self.handles:
            h.remove()


class Anomaly(Trainer):
    name = "anomaly"

    def step(self, x, y):
        # set_detect_anomaly is global: on for this copy's step only, restored on exit.
        with torch.autograd.set_detect_anomaly(True):
            super().step(x, y)


class DebugUO(Trainer):
    name = "debug_uo"

    def setup(self, tmp):
        from transformers.debug_utils import DebugUnderflowOverflow

        self.debug = DebugUnderflowOverflow(self.model)


class Recorder(Trainer):
    name = "recorder"

    def setup(self, tmp):
        out = os.path.join(tmp, f"bundles-{self.spec.name}")
        self.recorder = FlightRecorder(self.model, self.opt, loss_fn=self.crit,
                                       out_dir=out).attach()

    def close(self):
        self.recorder.detach()


class RecorderRewind(Recorder):
    """The recorder with ``rewind=16``: two copies of the training state every 16 steps and
    each step's batch, RNG states and hyper-parameters since the older copy."""

    name = "recorder_rewind16"

    def setup(self, tmp):
        out = os.path.join(tmp, f"bundles-rewind-{self.spec.name}")
        self.recorder = FlightRecorder(self.model, self.opt, loss_fn=self.crit, out_dir=out,
                                       rewind=16).attach()


class Floor(Trainer):
    """Not a detector but a yardstick (opt in with ``--detectors floor``): exactly the device work
    of the recorder's default checks and nothing else, with the barest hooks. One min and max per
    leaf module output, the root input and the loss (``aminmax``, or ``amin`` + ``amax`` where the
    recorder splits it: ``recorder.slots.split_extrema``); one squared norm per gradient before the
    update, of the gradient entering the model's output and per weight right after the update
    (its step post-hook; kept for the next step's check); the min and max of the BatchNorm
    layers' running statistics, copied into one vector; the two checks, each one dot: the loss
    and the norms must be finite, the outputs and the input must hold no NaN (a +-Inf that stays
    inside is no event); one read of both flags per step. No call records, RNG states or batch
    references: the recorder's distance to it is what its bookkeeping costs."""

    name = "floor"

    def setup(self, tmp):
        self.slots = torch.zeros(4096)  # must be finite: the last update's, the loss, the step's
        self.views = self.slots.unbind(0)
        self.outs = torch.zeros(4096)  # NaN only: the outputs and the input
        self.out_views = self.outs.unbind(0)
        self.zeros = torch.zeros(4096)
        self.flags = torch.zeros(2)
        self.flag_views = self.flags.unbind(0)
        self.k = self.base = self.j = 0
        leaves = [m for m in self.model.modules() if next(m.children(), None) is None]
        self.stats = [b.view(-1) for m in self.model.modules()
                      if isinstance(m, nn.modules.batchnorm._NormBase)
                      for b in m.buffers(recurse=False) if b.dtype is torch.float32]
        self.stats_flat = torch.empty(sum(b.numel() for b in self.stats),
                                      device=self.slots.device)
        self.handles = [m.register_forward_hook(self._post) for m in leaves]
        self.handles.append(self.crit.register_forward_hook(self._loss))
        self.handles.append(self.model.register_forward_pre_hook(self._pre))
        self.handles.append(self.model.register_forward_hook(self._root_out))
        self.handles.append(self.opt.register_step_pre_hook(self._check))
        self.handles.append(self.opt.register_step_post_hook(self._after_update))

    def _minmax(self, t, strict: bool = False):
        if t.is_floating_point() and t.numel():
            if strict:
                k, views = self.k, self.views
                self.k = k + 2
            else:
                k, views = self.j, self.out_views
                self.j = k + 2
            d = t.detach()
            if d.dtype is torch.float32 and d.is_cpu and split_extrema(d):  # the recorder's kernels
                torch.amin(d, dim=(), out=views[k])
                torch.amax(d, dim=(), out=views[k + 1])
            else:
                torch.aminmax(d, out=(views[k], views[k + 1]))

    def _pre(self, module, args):
        self.k, self.j = self.base, 0  # the last update's weight norms stay in front
        for t in tensor_leaves(args):
            self._minmax(t)

    def _post(self, module, args, output):
        for t in (output,) if type(output) is torch.Tensor else tensor_leaves(output):
            self._minmax(t)

    def _loss(self, module, args, output):
        self._minmax(output, strict=True)

    def _root_out(self, module, args, output):
        if output.requires_grad:  # the gradient entering the model's output, in backward
            output.register_hook(self._out_grad)

    def _out_grad(self, grad):
        self._sq_norm(grad, self.k)
        self.k += 1

    def _sq_norm(self, t, k):
        flat = t.detach().reshape(-1)
        torch.dot(flat, flat, out=self.views[k])

    def _check(self, opt, args, kwargs):
        for p in self.params:
            if p.grad is not None:
                self._sq_norm(p.grad, self.k)
                self.k += 1
        if self.stats:  # BatchNorm's running statistics: one vector, its min and max
            torch.cat(self.stats, out=self.stats_flat)
            self._minmax(self.stats_flat, strict=True)
        n, m = self.k, self.j
        finite, nan_only = self.flag_views
        torch.dot(self.slots[:n], self.zeros[:n], out=finite)  # 0, or NaN for NaN and +-Inf
        torch.dot(self.outs[:m], self.outs[:m], out=nan_only)  # NaN for NaN, +Inf at most
        if any(math.isnan(v) for v in self.flags.tolist()):
            raise FloatingPointError("non-finite value in the step")

    def _after_update(self, opt, args, kwargs):
        for k, p in enumerate(self.params):
            self._sq_norm(p, k)
        self.base = len(self.params)

    def close(self):
        for h in self.handles:
            h.remove()


def baseline_trainer(checkout: str) -> type[Trainer]:
    """The ``recorder`` package of another checkout (``--baseline``), imported under another
    name (its imports are relative), as detector ``recorder_base``: before/after in one run."""
    import importlib.util

    pkg = Path(checkout).resolve() / "recorder"
    spec = importlib.util.spec_from_file_location(
        "recorder_base", pkg / "__init__.py", submodule_search_locations=[str(pkg)])
    if spec is None or not (pkg / "__init__.py").exists():
        raise SystemExit(f"--baseline {checkout}: no recorder/ package there")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["recorder_base"] = mod
    spec.loader.exec_module(mod)

    class BaseRecorder(Recorder):
        name = "recorder_base"

        def setup(self, tmp):
            out = os.path.join(tmp, f"bundles-base-{self.spec.name}")
            self.recorder = mod.FlightRecorder(self.model, self.opt, loss_fn=self.crit,
                                               out_dir=out).attach()

    return BaseRecorder


TRAINERS = {"bare": Trainer, "hooks": HookRecipe, "anomaly": Anomaly, "debug_uo": DebugUO,
            "recorder": Recorder, "floor": Floor, "recorder_rewind16": RecorderRewind}


def have_transformers() -> bool:
    try:
        from transformers.debug_utils import DebugUnderflowOverflow  # noqa: F401
    except Exception:
        return False
    return True


# ----------------------------------------------------------------------------------------------
# counting host reads


_READS = ("item", "__bool__", "tolist", "__float__", "__int__", "__index__")


@contextlib.contextmanager
def count_host_reads(exclude: set[int]):
    """Count Python-level host reads of tensor values; ``exclude`` holds ids not to count."""
    counter = {"n": 0}
    saved = {}

    def wrap(orig):
        def counted(self, *args, **kwargs):
            if id(self) not in exclude:
                counter["n"] += 1
            return orig(self, *args, **kwargs)
        return counted

    for name in _READS:
        saved[name] = torch.Tensor.__dict__.get(name)
        setattr(torch.Tensor, name, wrap(getattr(torch.Tensor, name)))
    try:
        yield counter
    finally:
        for name, orig in saved.items():
            if orig is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, orig)


@contextlib.contextmanager
def count_cuda_syncs(device: torch.device):
    """Count torch.cuda.set_sync_debug_mode('warn') warnings (CUDA only)."""
    counter = {"n": 0}
    if device.type != "cuda":
        counter["n"] = None
        yield counter
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counter
        finally:
            torch.cuda.set_sync_debug_mode(old)
    counter["n"] = sum("synchroniz" in str(w.message) for w in caught)


# ----------------------------------------------------------------------------------------------
# the measurement


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _minor_faults() -> int | None:
    """This thread's minor page faults so far (Linux), or None."""
    try:
        with open("/proc/thread-self/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[7])
    except (OSError, ValueError, IndexError):
        return None


def _quartiles(xs):
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def measure(model: str, detectors: list[str], rounds: int, warmup: int, count_steps: int,
            device: torch.device, compiled: bool = False, run: int = 1) -> dict:
    """Each round, every copy takes ``run`` steps in a row, timed together (per step); the
    copies take turns, whoever goes first rotating."""
    spec = SPECS[model]
    g = torch.Generator().manual_seed(SEED)
    batches = [spec.make_batch(g, device) for _ in range(8)]
    with tempfile.TemporaryDirectory(prefix="nanreplay-bench-") as tmp:
        trainers = [TRAINERS[d](spec, device, tmp, compiled) for d in detectors]
        n = len(trainers)
        times: dict[str, list[float]] = {t.name: [] for t in trainers}
        # beside the wall clock: the thread's CPU time (what the OS gave other processes is
        # not in it; on CPU with --threads 1 all of the step's work is this thread's) and its
        # minor page faults (glibc returning and re-faulting the heap's top: kernel time that
        # moves with heap layout, not with a detector's own work)
        cpu: dict[str, list[float]] = {t.name: [] for t in trainers}
        faults: dict[str, list[int]] = {t.name: [] for t in trainers}
        started = time.perf_counter()
        total = warmup + rounds
        for r in range(total):
            for k in range(n):
                t = trainers[(r + k) % n]  # rotate who goes first
                _sync(device)
                f0, c0 = _minor_faults(), time.thread_time()
                t0 = time.perf_counter()
                for j in range(run):
                    x, y = batches[(r * run + j) % len(batches)]
                    t.step(x, y)
                _sync(device)
                dt = (time.perf_counter() - t0) / run
                c1, f1 = time.thread_time(), _minor_faults()
                if r >= warmup:
                    times[t.name].append(dt)
                    cpu[t.name].append((c1 - c0) / run)
                    if f0 is not None and f1 is not None:
                        faults[t.name].append((f1 - f0) / run)
            if (r + 1) % max(1, total // 10) == 0 or r + 1 == total:
                el = time.perf_counter() - started
                print(f"  {model}: round {r + 1}/{total} ({'warm-up' if r < warmup else 'timed'}"
                      f"), {el:.0f}s elapsed, ~{el / (r + 1) * (total - r - 1):.0f}s left",
                      file=sys.stderr, flush=True)

        reads: dict[str, float] = {}
        syncs: dict[str, float | None] = {}
        for t in trainers:
            exclude = t.optimizer_counters()
            with count_host_reads(exclude) as c, count_cuda_syncs(device) as s:
                for i in range(count_steps):
                    x, y = batches[i % len(batches)]
                    t.step(x, y)
                _sync(device)
            reads[t.name] = c["n"] / count_steps
            syncs[t.name] = None if s["n"] is None else s["n"] / count_steps
        # what the recorders hold at the end (the rewind window's host copies, full by now)
        memory = {t.name: dict(t.recorder.memory_bytes) for t in trainers
                  if getattr(t, "recorder", None) is not None}
        for t in trainers:
            t.close()

    bare = times["bare"]
    rows = {}
    for name in detectors:
        ts = times[name]
        ratios = [a / b for a, b in zip(ts, bare)]
        q1, q3 = _quartiles(ratios)
        rows[name] = {
            "median_step_ms": statistics.median(ts) * 1e3,
            "median_ratio": statistics.median(ratios),
            "ratio_q1": q1,
            "ratio_q3": q3,
            "host_reads_per_step": reads[name],
            "cuda_sync_warnings_per_step": syncs[name],
            "memory_bytes": memory.get(name),
            "faults_per_step": statistics.median(faults[name]) if faults[name] else None,
        }
        if "floor" in times and name not in ("bare", "floor"):
            # paired within each round: (this step - the floor's step) / the bare step, so a
            # round the whole machine ran slow moves all three alike and cancels out
            gaps = [(a - f) / b for a, f, b in zip(ts, times["floor"], bare)]
            rows[name]["minus_floor"] = statistics.median(gaps)
            rows[name]["minus_floor_q1"], rows[name]["minus_floor_q3"] = _quartiles(gaps)
            if device.type == "cpu":  # the same in the thread's CPU time
                cpu_gaps = [(a - f) / b for a, f, b in zip(cpu[name], cpu["floor"], cpu["bare"])]
                rows[name]["cpu_minus_floor"] = statistics.median(cpu_gaps)
                rows[name]["cpu_minus_floor_q1"], rows[name]["cpu_minus_floor_q3"] = \
                    _quartiles(cpu_gaps)
    return {"model": model, "description": spec.describe, "rounds": rounds, "warmup": warmup,
            "compiled": compiled, "run": run, "detectors": rows}


def measure_in_processes(model: str, detectors: list[str], rounds: int, warmup: int,
                         args) -> dict:
    """``measure`` in ``args.processes`` fresh processes: per detector the median, over the
    processes, of each process's median ratio (and of its median step time), and their range."""
    import subprocess

    runs = []
    with tempfile.TemporaryDirectory(prefix="nanreplay-bench-") as tmp:
        for i in range(args.processes):
            out = os.path.join(tmp, f"{i}.json")
            cmd = [sys.executable, str(Path(__file__).resolve()), "--models", model,
                   "--detectors", ",".join(detectors), "--rounds", str(rounds),
                   "--warmup", str(warmup), "--device", args.device, "--json", out,
                   "--run", str(args.run)]
            if args.threads is not None:
                cmd += ["--threads", str(args.threads)]
            if args.baseline:
                cmd += ["--baseline", args.baseline]
            if args.compile:
                cmd.append("--compile")
            print(f"  {model}: process {i + 1}/{args.processes}", file=sys.stderr, flush=True)
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            runs.append(json.loads(Path(out).read_text())["results"][0])
    rows = {}
    for name in detectors:
        per = [r["detectors"][name] for r in runs]
        ratios = [p["median_ratio"] for p in per]
        rows[name] = {
            "median_step_ms": statistics.median(p["median_step_ms"] for p in per),
            "median_ratio": statistics.median(ratios),
            "ratio_q1": min(ratios),  # shown as the range across processes
            "ratio_q3": max(ratios),
            "process_ratios": ratios,
            "host_reads_per_step": max(p["host_reads_per_step"] for p in per),
            "cuda_sync_warnings_per_step": per[0]["cuda_sync_warnings_per_step"],
        }
        gaps = [p["minus_floor"] for p in per if "minus_floor" in p]
        if gaps:  # the median over the processes, and their range
            rows[name].update(minus_floor=statistics.median(gaps), minus_floor_q1=min(gaps),
                              minus_floor_q3=max(gaps))
        cpu_gaps = [p["cpu_minus_floor"] for p in per if "cpu_minus_floor" in p]
        if cpu_gaps:
            rows[name].update(cpu_minus_floor=statistics.median(cpu_gaps),
                              cpu_minus_floor_q1=min(cpu_gaps), cpu_minus_floor_q3=max(cpu_gaps))
        fl = [p["faults_per_step"] for p in per if p.get("faults_per_step") is not None]
        rows[name]["faults_per_step"] = statistics.median(fl) if fl else None
    return {"model": model, "description": SPECS[model].describe, "rounds": rounds,
            "warmup": warmup, "processes": args.processes, "compiled": args.compile,
            "detectors": rows}


# ----------------------------------------------------------------------------------------------
# output


def machine_info(device: torch.device) -> dict:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {"cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "device": str(device), "loadavg_start": list(os.getloadavg()),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    info["recorder_commit"] = recorder_commit()
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except Exception:
        info["transformers"] = None
    return info


def recorder_commit() -> str | None:
    """The last commit that touched recorder/ (+ '-dirty' with local changes), if in git."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "log", "-1", "--format=%h", "--", "recorder"], cwd=root,
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "recorder"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (rev + ("-dirty" if dirty else "")) or None


def _fmt_reads(v):
    if v is None:
        return "-"
    return f"{v:g}"


def render(results: list[dict], device: torch.device) -> str:
    cuda = device.type == "cuda"
    many = any("processes" in r for r in results)
    spread = "ratio range over processes" if many else "ratio IQR"
    lines = [f"| model | detector | median step (ms) | ratio to bare (median) | {spread} "
             "| host reads/step | page faults/step |" + (" CUDA syncs/step |" if cuda else ""),
             "|---|---|---:|---:|---|---:|---:|" + ("---:|" if cuda else "")]
    for res in results:
        for name, row in res["detectors"].items():
            line = (f"| {res['model']} | {name} | {row['median_step_ms']:.2f} "
                    f"| {row['median_ratio']:.3f}x | {row['ratio_q1']:.3f}-{row['ratio_q3']:.3f} "
                    f"| {_fmt_reads(row['host_reads_per_step'])} "
                    f"| {_fmt_reads(row.get('faults_per_step'))} |")
            if cuda:
                line += f" {_fmt_reads(row['cuda_sync_warnings_per_step'])} |"
            lines.append(line)
    # compact matrix: median ratio per detector (rows) and model (columns)
    names = []
    for res in results:
        names += [n for n in res["detectors"] if n not in names]
    lines += ["", "| detector | " + " | ".join(r["model"] for r in results) + " |",
              "|---|" + "---:|" * len(results)]
    for name in names:
        cells = []
        for res in results:
            row = res["detectors"].get(name)
            cells.append("-" if row is None else f"{row['median_ratio']:.3f}x")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdicts(results: list[dict]) -> list[str]:
    """One line per claim and model, each the outcome of a comparison of the measured numbers:
    the recorder against the ratio target, against every other detector, against the floor (is
    the target within reach of any hook-based recorder here, and what the recorder adds to it),
    and its host reads against the budget of one per step."""
    out = []
    for res in results:
        rows = res["detectors"]
        if "recorder" not in rows:
            continue
        m = res["model"]
        rec = rows["recorder"]["median_ratio"]
        out.append(f"- {m}: FlightRecorder {rec:.3f}x bare, target <= {RATIO_TARGET}x: "
                   f"{'met' if rec <= RATIO_TARGET else 'MISSED'}")
        # (recorder_base is the recorder of another checkout, not another detector)
        others = {n: r["median_ratio"] for n, r in rows.items()
                  if n not in ("bare", "recorder", "floor", "recorder_base",
                               "recorder_rewind16")}
        if others:
            worse = [n for n, v in others.items() if v <= rec]
            cheapest = min(others, key=others.get)
            if worse:
                out.append(f"- {m}: FlightRecorder is NOT cheaper than {', '.join(worse)} "
                           f"(cheapest other: {cheapest} {others[cheapest]:.3f}x)")
            else:
                out.append(f"- {m}: FlightRecorder is cheaper than every other detector "
                           f"(next: {cheapest} {others[cheapest]:.3f}x)")
        if "floor" in rows:
            floor = rows["floor"]["median_ratio"]
            reach = "within reach" if floor <= RATIO_TARGET else "out of reach"
            gap = round((rec - floor) * 100, 1) + 0.0  # no "-0.0"
            below = "; the recorder measured below its floor (noise)" if rec < floor else ""
            out.append(f"- {m}: floor (the statistics' device work alone, bare hooks) "
                       f"{floor:.3f}x bare, target <= {RATIO_TARGET}x {reach} for a recorder on "
                       f"module hooks; recorder minus floor: {gap:+.1f}% of a bare step (its "
                       f"bookkeeping, less the reductions it reuses){below}")
            paired = rows["recorder"].get("minus_floor")
            if paired is not None:
                lo, hi = rows["recorder"]["minus_floor_q1"], rows["recorder"]["minus_floor_q3"]
                out.append(f"- {m}: recorder minus floor, paired round by round: {paired:+.3f} "
                           f"of a bare step (IQR {lo:+.3f} to {hi:+.3f}), target <= "
                           f"{FLOOR_GAP_TARGET}: {'met' if paired <= FLOOR_GAP_TARGET else 'MISSED'}")
            cpu_gap = rows["recorder"].get("cpu_minus_floor")
            if cpu_gap is not None:
                lo, hi = (rows["recorder"]["cpu_minus_floor_q1"],
                          rows["recorder"]["cpu_minus_floor_q3"])
                out.append(f"- {m}: the same in the thread's CPU time: {cpu_gap:+.3f} of a bare "
                           f"step (IQR {lo:+.3f} to {hi:+.3f})")
        reads = rows["recorder"]["host_reads_per_step"]
        syncs = rows["recorder"]["cuda_sync_warnings_per_step"]
        line = (f"- {m}: FlightRecorder host reads/step = {reads:g}, budget 1: "
                f"{'met' if reads == 1 else 'MISSED'}")
        if syncs is not None:
            line += f"; CUDA sync warnings/step = {syncs:g}: {'met' if syncs <= 1 else 'MISSED'}"
        out.append(line)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS),
                    help="comma-separated subset of: " + ", ".join(SPECS) + " (mlp16: the MLP "
                    "at width 16, batch 4, where a step is mostly Python; cnn_cl: the CNN in "
                    "channels-last memory format; lm_small: the transformer at 2 layers, d=64, seq 64; "
                    "none of them is in the default)")
    ap.add_argument("--detectors", default=",".join(DETECTORS),
                    help="comma-separated subset of: " + ", ".join(DETECTORS)
                    + " (bare is always run), and floor: a yardstick run only when named (the"
                    " statistics' device work with the barest hooks), and recorder_rewind16: the"
                    " recorder with rewind=16, run only when named")
    ap.add_argument("--rounds", type=int, default=None,
                    help="timed rounds per model (default: "
                    + ", ".join(f"{k} {v}" for k, v in DEFAULT_ROUNDS.items()) + ")")
    ap.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default 10)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads(N) first (default: torch's own). On a shared, "
                    "busy CPU, 1 avoids OpenMP barrier stalls that swamp the measurement")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    ap.add_argument("--quick", action="store_true",
                    help="a few rounds only: a smoke test, not a measurement")
    ap.add_argument("--processes", type=int, default=1, metavar="N",
                    help="measure each model in N fresh processes, one after the other, and "
                    "report the median of their ratios and their range (default 1). Ratios "
                    "move from process to process (heap and cache placement) more than within one")
    ap.add_argument("--baseline", metavar="DIR",
                    help="also time the recorder of another checkout (DIR holds its recorder/ "
                    "package, e.g. a worktree of main) as detector recorder_base, interleaved "
                    "with the others: a before/after comparison within one run")
    ap.add_argument("--run", type=int, default=1, metavar="K",
                    help="steps each copy takes in a row per round, timed together (default 1). "
                    "With 1, every step follows the other copies' steps, which evict its model's "
                    "state and the detector's own objects from the caches (an MLP copy's weights, "
                    "gradients and Adam state are about 17 MB); a training loop's steps follow "
                    "its own. K > 1 measures that, the round's first, cold step included")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile every copy's model (inductor) and compare the recorder "
                    "with the compiled bare model; the other detectors do not run")
    args = ap.parse_args(argv)
    if args.processes < 1:
        ap.error("--processes must be at least 1")
    if args.run < 1:
        ap.error("--run must be at least 1")

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in models if m not in SPECS]
    if bad:
        ap.error(f"unknown model(s) {bad}; choose from {', '.join(SPECS)}")
    detectors = [d.strip() for d in args.detectors.split(",") if d.strip()]
    if args.baseline:
        TRAINERS["recorder_base"] = baseline_trainer(args.baseline)
        if "recorder_base" not in detectors:
            detectors.append("recorder_base")
    bad = [d for d in detectors if d not in TRAINERS]
    if bad:
        ap.error(f"unknown detector(s) {bad}; choose from {', '.join(DETECTORS)}")
    detectors = ["bare"] + [d for d in (*DETECTORS, "recorder_base", "recorder_rewind16",
                                        "floor")
                            if d in detectors and d != "bare"]
    if "debug_uo" in detectors and not have_transformers():
        print("transformers is not installed: skipping DebugUnderflowOverflow "
              "(pip install transformers)", file=sys.stderr)
        detectors.remove("debug_uo")
    if args.compile:  # the other detectors' per-module hooks would be traced into the graphs
        detectors = [d for d in detectors if d in ("bare", "recorder", "recorder_base",
                                                   "recorder_rewind16")]
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available")

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 10)
    count_steps = 1 if args.quick else 3
    info = machine_info(device)
    print(f"machine: {info['cpu']}, {info['cpu_count']} CPUs, torch {info['torch']} "
          f"({info['torch_threads']} threads), device {device}", file=sys.stderr)

    results = []
    for m in models:
        rounds = args.rounds if args.rounds is not None else (
            3 if args.quick else DEFAULT_ROUNDS[m])
        print(f"{m}: {SPECS[m].describe}; {len(detectors)} copies, {warmup} warm-up + "
              f"{rounds} timed rounds of {args.run} step(s) a copy", file=sys.stderr, flush=True)
        if args.processes == 1:
            results.append(measure(m, detectors, rounds, warmup, count_steps, device,
                                   args.compile, args.run))
        else:
            results.append(measure_in_processes(m, detectors, rounds, warmup, args))
        print(render(results[-1:], device), file=sys.stderr, flush=True)
        if args.json:  # partial results survive an interrupted run
            Path(args.json).write_text(json.dumps({"machine": info, "quick": args.quick,
                                                   "complete": False, "results": results},
                                                  indent=2))

    info["loadavg_end"] = list(os.getloadavg())
    print(f"Per-step overhead on {device} ({info['cpu']}, torch {info['torch']}, "
          f"{info['torch_threads']} threads, recorder {info['recorder_commit']}, {info['date']})"
          + (", every model torch.compile'd" if args.compile else "")
          + (" [--quick: not a measurement]" if args.quick else ""))
    print()
    print(render(results, device))
    print()
    for res in results:  # the rewind window's memory, when it was measured
        mem = (res["detectors"].get("recorder_rewind16") or {}).get("memory_bytes")
        if mem:
            print(f"- {res['model']}: recorder_rewind16 holds {mem['rewind_host'] / 1e6:.2f} MB "
                  f"of host memory (two state copies and the steps since the older one), "
                  f"{mem['rewind_device'] / 1e6:.2f} MB on the device")
    print()
    print("Targets:")
    for v in verdicts(results):
        print(v)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "quick": args.quick,
                                               "complete": True, "results": results},
                                              indent=2))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

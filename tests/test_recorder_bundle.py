"""The ``.nan`` bundle: exact round trip, standard tools open it, atomic never-overwriting
writes, a failed write that leaves nothing behind, and a reader that rejects bad files with a
one-line BundleError."""

from __future__ import annotations

import errno
import itertools
import json
import random
import threading
from pathlib import Path

import hypothesis.strategies as st
import models as M
import numpy as np
import pytest
import safetensors.torch
import torch
import zstandard
from hypothesis import HealthCheck, example, given, settings
from models import all_files, bundles, check_event, identical
from torch import nn

import recorder.bundle as bundle_mod
from recorder import BundleError, FlightRecorder, NonFiniteError
from recorder.bundle import BundleReader, header_bytes, read_bundle, write_bundle
from recorder.rng import capture_rng, restore_rng, rng_from_bundle, rng_to_bundle

K = 3

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
          torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64]


def make_tensor(dtype: torch.dtype, shape: list[int], seed: int, special: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point or dtype.is_complex:
        base = torch.randn(shape, generator=g, dtype=torch.float64) * 100
        if special and base.numel():
            flat = base.view(-1)
            for i, v in enumerate([float("nan"), float("inf"), -float("inf"), -0.0]):
                flat[i % flat.numel()] = v
        if dtype.is_complex:
            imag = torch.randn(shape, generator=g, dtype=torch.float64)
            return torch.complex(base, imag).to(dtype)
        return base.to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    info = torch.iinfo(dtype) if dtype not in (torch.uint16, torch.uint32, torch.uint64) else None
    lo, hi = (info.min, info.max) if info is not None else (0, 2 ** 15)
    lo, hi = max(lo, -(2 ** 62)), min(hi, 2 ** 62)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


def vary_layout(t: torch.Tensor, how: str) -> torch.Tensor:
    """The same values or a view of them, laid out non-contiguously."""
    if how == "transposed" and t.dim() >= 2:
        return t.transpose(0, 1)
    if how == "strided" and t.dim() >= 1:
        return t[::2]
    if how == "offset" and t.numel() > 1:
        return t.reshape(-1)[1:]
    if how == "expanded" and t.dim() >= 1 and t.shape[0] >= 1:
        return t[:1].expand(3, *t.shape[1:])
    if how == "conj" and t.is_complex():
        return t.conj()
    return t


tensor_specs = st.tuples(
    st.sampled_from(DTYPES),
    st.lists(st.integers(0, 4), min_size=0, max_size=3),
    st.integers(0, 2 ** 16),
    st.booleans(),
    st.sampled_from(["plain", "transposed", "strided", "offset", "expanded", "conj"]),
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 63), 2 ** 63)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                  max_size=3),
    max_leaves=10,
)


_example_ids = itertools.count()


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(specs=st.lists(tensor_specs, max_size=6), meta=st.dictionaries(st.text(max_size=6),
                                                                      json_values, max_size=4))
def test_round_trip_is_exact(tmp_path, specs, meta):
    tensors = {}
    for i, (dtype, shape, seed, special, how) in enumerate(specs):
        tensors[f"t/{i}/{str(dtype).removeprefix('torch.')}"] = vary_layout(
            make_tensor(dtype, shape, seed, special), how)
    d = tmp_path / f"rt{next(_example_ids)}"  # hypothesis reuses tmp_path across examples
    d.mkdir()
    path = write_bundle(d, "rt", meta, tensors)
    got_meta, got = read_bundle(path)
    assert got_meta == meta
    assert list(got) == list(tensors)  # file order is insertion order
    for name, t in tensors.items():
        expected = t.resolve_conj()
        assert identical(got[name], expected), name
        assert got[name].is_contiguous()


def test_round_trip_every_dtype_and_shape_edge(tmp_path):
    tensors = {}
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        tensors[f"{name}/scalar"] = make_tensor(dtype, [], 1, False)
        tensors[f"{name}/empty"] = make_tensor(dtype, [0, 3], 2, False)
        tensors[f"{name}/matrix"] = make_tensor(dtype, [3, 4], 3, True).t()
    tensors["requires_grad"] = torch.ones(2, requires_grad=True) * 2
    meta = {"nested": {"a": [1, 2.5, "x", None, True]}, "unicode": "ünï ✓", "big": 2 ** 62}
    path = write_bundle(tmp_path, "all", meta, tensors)
    got_meta, got = read_bundle(path)
    assert got_meta == meta
    for name, t in tensors.items():
        assert identical(got[name], t), name
    assert got["float32/scalar"].shape == () and got["bool/empty"].shape == (0, 3)


def test_meta_spells_non_finite_floats_and_tuples(tmp_path):
    path = write_bundle(tmp_path, "m", {"x": float("nan"), "y": (1, -float("inf"))}, {})
    meta, tensors = read_bundle(path)
    assert meta == {"x": "nan", "y": [1, "-inf"]} and tensors == {}
    assert float(meta["y"][1]) == -float("inf")


def test_rng_states_round_trip(tmp_path):
    random.seed(7)
    random.gauss(0, 1)  # leaves a cached gaussian in Python's state
    np.random.seed(7)
    np.random.standard_normal()  # and in numpy's
    torch.manual_seed(7)
    state = capture_rng()
    expected = (random.random(), random.gauss(0, 1), np.random.standard_normal(3),
                np.random.random(), torch.rand(3))
    rng_meta, rng_tensors = rng_to_bundle(state)
    path = write_bundle(tmp_path, "rng", {"rng": rng_meta}, rng_tensors)
    meta, tensors = read_bundle(path)
    assert meta["rng"] == json.loads(json.dumps(rng_meta))
    restored = rng_from_bundle(meta["rng"], tensors)
    assert restored["python"] == state["python"]
    assert torch.equal(restored["torch_cpu"], state["torch_cpu"])
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    restore_rng(restored)
    again = (random.random(), random.gauss(0, 1), np.random.standard_normal(3),
             np.random.random(), torch.rand(3))
    assert again[:2] == expected[:2]
    assert np.array_equal(again[2], expected[2]) and again[3] == expected[3]
    assert torch.equal(again[4], expected[4])


_DRAWS = {
    "random": lambda: random.random(),
    "bits": lambda: random.getrandbits(32),
    "many_bits": lambda: random.getrandbits(32 * 700),  # past a regeneration of the words
    "gauss": lambda: random.gauss(0, 1),  # alternates drawing and using the cached value
    "seed_py": lambda: random.seed(3),
    "np_random": lambda: np.random.random(),
    "np_normal": lambda: np.random.standard_normal(),
    "np_many": lambda: np.random.random(700),
    "seed_np": lambda: np.random.seed(3),
    "torch": lambda: torch.rand(2),
    "torch_many": lambda: torch.rand(700),  # past a regeneration of the words
    "torch_wrap": lambda: [torch.randint(0, 9, (1,)) for _ in range(624)],  # same position
    "torch_normal": lambda: torch.randn(1),  # alternates drawing and using the cached value
    "torch_dropout": lambda: torch.nn.functional.dropout(torch.ones(64), 0.5),
    "seed_torch": lambda: torch.manual_seed(3),
}


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.sampled_from(sorted(_DRAWS)), max_size=4), min_size=1, max_size=6))
# found by this test: re-seeding to the same words with a gaussian newly cached (once missed)
@example([["seed_np", "np_normal", "np_normal"], ["seed_np", "np_normal"]])
@example([["torch_normal"], ["torch_normal"], ["seed_torch", "torch_normal"], ["seed_torch"]])
def test_a_reused_capture_always_matches_the_real_states(steps):
    """The capture skips re-reading Python's, NumPy's and torch's CPU states when their
    fingerprints did not move: whatever was drawn in between, what it returns is the state
    right now."""
    from recorder.rng import RngCapture

    capture = RngCapture()
    for draws in steps:
        for d in draws:
            _DRAWS[d]()
        state = capture()
        assert state["python"] == random.getstate()
        ours, real = state["numpy"], np.random.get_state()
        assert ours[0] == real[0] and np.array_equal(ours[1], real[1])
        assert ours[2:] == real[2:]
        assert torch.equal(state["torch_cpu"], torch.get_rng_state())
    # nothing drew since: nothing is read again (the same capture, its tensor never written)
    assert capture() is state and state["torch_cpu"] is capture()["torch_cpu"]


def test_reader_streams_with_a_filter_and_iterates_once(tmp_path):
    tensors = {"weights/a": torch.arange(6.0), "grads/a": torch.ones(6), "ring/x": torch.zeros(2)}
    path = write_bundle(tmp_path, "f", {"k": 1}, tensors)
    with BundleReader(path) as r:
        assert r.meta == {"k": 1} and r.format_version == 1
        assert [e[0] for e in r.entries] == list(tensors)
        got = dict(r.tensors(lambda n: n.startswith("weights/")))
        with pytest.raises(RuntimeError, match="can be iterated once"):
            list(r.tensors())
    assert list(got) == ["weights/a"] and torch.equal(got["weights/a"], tensors["weights/a"])


# ---------------------------------------------------------------------------------------------
# standard tools open a bundle


def _recorded_bundle(out_dir) -> Path:
    model = nn.Sequential(nn.Linear(M.D_IN, M.HIDDEN), nn.BatchNorm1d(M.HIDDEN), M.LogOf(),
                          nn.Linear(M.HIDDEN, M.N_CLASSES))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir):
            M.train(model, opt, crit, 6, at=M.arm_at(K, model[2]))
    return info.value.bundle_path


def test_zstd_and_safetensors_open_a_recorded_bundle(out_dir, tmp_path):
    path = _recorded_bundle(out_dir)
    raw = zstandard.ZstdDecompressor().decompress(path.read_bytes())
    plain = safetensors.torch.load(raw)
    meta, tensors = read_bundle(path)
    assert plain.keys() == tensors.keys()
    for k in tensors:
        assert identical(plain[k], tensors[k]), k
    for prefix in ("weights/", "buffers/", "grads/", "optim/", "batch/0/", "loss_in/0/",
                   "outgrad/0/", "rng/", "ring/"):
        assert any(k.startswith(prefix) for k in tensors), prefix
    for key in ("ring/steps", "ring/loss", "ring/grad_norm", "ring/param_norm",
                "ring/grad_norms", "ring/lr", "ring/calls", "ring/call_module", "ring/skipped",
                "ring/scale", "rng/torch_cpu", "buffers/1.running_mean",
                "optim/0.weight/exp_avg_sq"):
        assert key in tensors, key
    # the metadata is standard safetensors metadata too
    st_path = tmp_path / "plain.safetensors"
    st_path.write_bytes(raw)
    with safetensors.safe_open(str(st_path), "pt") as f:
        md = f.metadata()
    assert md["format"] == "nanreplay-bundle" and md["version"] == "1"
    assert json.loads(md["meta"]) == meta
    for key in ("event", "params", "buffers", "modules", "call_order", "micro_batches",
                "optimizer", "rng", "env", "factory", "state"):
        assert key in meta, key
    assert meta["buffers"] == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    assert set(meta["micro_batches"][0]) >= {"inputs", "paths", "loss_inputs"}
    assert meta["optimizer"]["class"] == "torch.optim.adam.Adam"
    assert meta["optimizer"]["defaults"]["lr"] == 1e-3


def test_bundle_buffers_hold_the_pre_step_value(out_dir):
    """BatchNorm running stats change during the failing step's forward: the bundle keeps the
    value they had when the step began, so a re-run starts from the same state."""
    model = nn.Sequential(nn.Linear(M.D_IN, M.HIDDEN), nn.BatchNorm1d(M.HIDDEN), M.LogOf())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.MSELoss()
    before = {}

    def at(step):
        model[2].armed = step == K
        before[step] = {n: b.clone() for n, b in model.named_buffers()}

    def make(step):
        x, _ = M.batch(step)
        return x, torch.zeros(M.BATCH, M.HIDDEN)

    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir):
            M.train(model, opt, crit, 6, at=at, make_batch=make)
    _, t = read_bundle(info.value.bundle_path)
    for name, b in before[K].items():
        assert identical(t[f"buffers/{name}"], b), name
        assert not torch.equal(dict(model.named_buffers())[name], b)  # the live one moved


class OccasionalBuffer(nn.Module):
    """A buffer that its forward changes only on some steps (an EMA updated every k steps, a
    counter bumped on a condition): here, only on the armed step, which also makes a NaN."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(M.HIDDEN))
        self.armed = False

    def forward(self, x):
        if self.armed:
            self.scale.mul_(3.0)
            return torch.log(x.abs() - 1e3) * self.scale
        return x * self.scale


def test_bundle_buffer_changed_only_by_the_failing_step(out_dir):
    model = nn.Sequential(nn.Linear(M.D_IN, M.HIDDEN), OccasionalBuffer())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.MSELoss()

    def make(step):
        return M.batch(step)[0], torch.zeros(M.BATCH, M.HIDDEN)

    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir):
            M.train(model, opt, crit, 6, at=M.arm_at(K, model[1]), make_batch=make)
    check_event(info.value.event, step=K, phase="forward", module="1")
    _, t = read_bundle(info.value.bundle_path)
    assert torch.equal(model[1].scale, torch.full((M.HIDDEN,), 3.0))  # the step changed it
    assert torch.equal(t["buffers/1.scale"], torch.ones(M.HIDDEN))  # the bundle: before it


# ---------------------------------------------------------------------------------------------
# writing: atomic, never overwrites


def test_write_never_overwrites(tmp_path):
    first = write_bundle(tmp_path, "step00000003-rank0", {"n": 1}, {"a": torch.ones(2)})
    second = write_bundle(tmp_path, "step00000003-rank0", {"n": 2}, {"a": torch.zeros(2)})
    third = write_bundle(tmp_path, "step00000003-rank0", {"n": 3}, {"a": torch.zeros(2)})
    assert [first.name, second.name, third.name] == [
        "step00000003-rank0.nan", "step00000003-rank0-1.nan", "step00000003-rank0-2.nan"]
    assert read_bundle(first)[0] == {"n": 1} and read_bundle(second)[0] == {"n": 2}
    assert set(all_files(tmp_path)) == {first, second, third}  # no temporary file left


def test_write_does_not_touch_a_foreign_file_with_the_name(tmp_path):
    squatter = tmp_path / "x.nan"
    squatter.write_bytes(b"someone else's file")
    path = write_bundle(tmp_path, "x", {}, {"a": torch.ones(1)})
    assert path.name == "x-1.nan" and squatter.read_bytes() == b"someone else's file"


def test_two_recorders_same_step_same_dir(out_dir):
    paths = []
    for _ in range(2):
        model = nn.Sequential(nn.Linear(M.D_IN, M.HIDDEN), M.LogOf())
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        crit = nn.MSELoss()
        with pytest.raises(NonFiniteError) as info:
            with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir):
                M.train(model, opt, crit, 5, at=M.arm_at(K, model[1]),
                        make_batch=lambda s: (M.batch(s)[0], torch.zeros(M.BATCH, M.HIDDEN)))
        paths.append(info.value.bundle_path)
    assert [p.name for p in paths] == ["step00000003-rank0.nan", "step00000003-rank0-1.nan"]
    assert set(bundles(out_dir)) == set(paths)


def test_concurrent_writes_of_the_same_name(tmp_path):
    """Threads of one process writing the same name at once: every bundle is whole."""
    n = 4
    payloads = [{"a": make_tensor(torch.float32, [64, 64], i, False)} for i in range(n)]
    barrier = threading.Barrier(n)
    results: dict[int, Path] = {}
    errors: list[BaseException] = []

    def write(i):
        try:
            barrier.wait(timeout=30)
            results[i] = write_bundle(tmp_path, "same", {"i": i}, payloads[i])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert {p.name for p in results.values()} == {
        "same.nan", "same-1.nan", "same-2.nan", "same-3.nan"}
    for i, path in results.items():
        meta, t = read_bundle(path)
        assert meta == {"i": i} and identical(t["a"], payloads[i]["a"])
    assert sorted(all_files(tmp_path)) == sorted(results.values())


# ---------------------------------------------------------------------------------------------
# a failed write


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train_with_failing_write(out_dir, break_it, on_event="raise"):
    model = nn.Sequential(nn.Linear(M.D_IN, M.HIDDEN), M.LogOf(),
                          nn.Linear(M.HIDDEN, M.N_CLASSES))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.CrossEntropyLoss()
    weights_at_start = {}

    def at(step):
        model[1].armed = step == K
        weights_at_start[step] = _snapshot(model)
        if step == K:
            break_it()

    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, on_event=on_event)
    with rec:
        M.train(model, opt, crit, 6, at=at)
    return rec, model, weights_at_start


def test_write_failure_mid_file_removes_it_and_raises(out_dir, monkeypatch):
    real = bundle_mod._host_bytes
    written = []

    def no_space_after_two(t):
        if len(written) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(t)
        return real(t)

    def break_it():
        monkeypatch.setattr(bundle_mod, "_host_bytes", no_space_after_two)

    with pytest.raises(NonFiniteError) as info:
        _train_with_failing_write(out_dir, break_it)
    err = info.value
    assert len(written) == 2  # the write had started: a partial temporary file existed
    assert err.bundle_path is None
    assert isinstance(err.write_error, OSError) and err.write_error.errno == errno.ENOSPC
    assert err.__cause__ is err.write_error
    check_event(err.event, step=K, phase="forward", module="1")
    msg = str(err)
    assert "\n" not in msg and f"step {K}" in msg
    assert "Writing the bundle failed" in msg and "No space left on device" in msg
    assert all_files(out_dir) == []  # nothing left behind, not even a hidden temporary


def test_write_failure_at_fsync_removes_the_file(out_dir, monkeypatch):
    """The whole frame was written, then fsync failed: the complete-looking temporary must
    not stay, nor get its final name."""

    def break_it():
        def fail(*a, **k):
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(bundle_mod.os, "fsync", fail)

    with pytest.raises(NonFiniteError) as info:
        _train_with_failing_write(out_dir, break_it)
    err = info.value
    assert err.bundle_path is None and err.write_error.errno == errno.EIO
    assert "Input/output error" in str(err)
    assert all_files(out_dir) == []


def test_failed_write_keeps_the_weights_of_the_step(out_dir, monkeypatch):
    model = nn.Sequential(nn.Linear(M.D_IN, M.HIDDEN), M.LogOf(),
                          nn.Linear(M.HIDDEN, M.N_CLASSES))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.CrossEntropyLoss()
    snapshots = {}

    def at(step):
        model[1].armed = step == K
        snapshots[step] = _snapshot(model)
        if step == K:
            monkeypatch.setattr(bundle_mod, "write_bundle", _enospc)

    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir):
            M.train(model, opt, crit, 6, at=at)
    assert info.value.write_error is not None
    after = _snapshot(model)
    for name, w in snapshots[K].items():
        assert identical(after[name], w), name  # the failing step never updated the weights
    assert not identical(snapshots[K]["0.weight"], snapshots[0]["0.weight"])  # earlier ones did


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_out_dir_replaced_by_a_file_after_construction(out_dir, tmp_path, monkeypatch):
    def break_it():
        for f in out_dir.iterdir():
            f.unlink()
        out_dir.rmdir()
        out_dir.write_text("now a file")

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with pytest.raises(NonFiniteError) as info:
        _train_with_failing_write(out_dir, break_it)
    err = info.value
    # (tests/test_out_dir_at_event.py replays the bundle from the temporary directory)
    assert err.bundle_path.parent.parent == tmp_path and isinstance(err.write_error, OSError)
    assert out_dir.read_text() == "now a file"


def test_write_failure_in_warn_mode_logs_and_trains_on(out_dir, monkeypatch, caplog):
    def break_it():
        monkeypatch.setattr(bundle_mod, "write_bundle", _enospc)

    with caplog.at_level("WARNING", logger="nanreplay"):
        rec, _, weights = _train_with_failing_write(out_dir, break_it, on_event="warn")
    assert sorted(weights) == list(range(6))  # every step ran
    assert rec.bundle_path is None and rec.event["step"] == K
    msgs = [r.getMessage() for r in caplog.records if r.name == "nanreplay"]
    assert len(msgs) == 1 and "Writing the bundle failed" in msgs[0]
    assert all_files(out_dir) == []


# ---------------------------------------------------------------------------------------------
# the reader rejects bad files


@pytest.fixture
def good_bundle(tmp_path) -> Path:
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(64, 64, generator=g), "b": torch.arange(500),
               "c": torch.ones(3, dtype=torch.bool)}
    return write_bundle(tmp_path, "good", {"event": {"step": 1}}, tensors)


def _reject(path: Path, *phrases: str) -> str:
    with pytest.raises(BundleError) as info:
        read_bundle(path)
    msg = str(info.value)
    assert "\n" not in msg, msg
    assert msg.startswith(f"{path}: "), msg
    for phrase in phrases:
        assert phrase in msg, msg
    return msg


def _frame(raw: bytes) -> bytes:
    return zstandard.ZstdCompressor(write_checksum=True, write_content_size=True).compress(raw)


def _safetensors_bytes(header: dict, data: bytes = b"") -> bytes:
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    return len(head).to_bytes(8, "little") + head + data


@pytest.mark.parametrize("fraction", [0.02, 0.5, 0.97])
def test_truncated_file(good_bundle, fraction):
    data = good_bundle.read_bytes()
    good_bundle.write_bytes(data[: int(len(data) * fraction)])
    _reject(good_bundle, "truncated: it ends at byte ", "the file is incomplete (",
            "copy it again")


def test_truncated_to_a_few_bytes(good_bundle):
    good_bundle.write_bytes(good_bundle.read_bytes()[:6])
    _reject(good_bundle, "corrupted zstd frame header")


@pytest.mark.parametrize("where", [0.3, 0.6, 0.9])
def test_corrupted_bytes(good_bundle, where):
    data = bytearray(good_bundle.read_bytes())
    data[int(len(data) * where)] ^= 0xFF
    good_bundle.write_bytes(bytes(data))
    _reject(good_bundle, "corrupted data while reading", "the file is damaged; copy it again")


@pytest.mark.parametrize("junk", [b"\0" * 16, b"appended garbage"])
def test_trailing_junk_after_the_frame(good_bundle, junk):
    good_bundle.write_bytes(good_bundle.read_bytes() + junk)
    _reject(good_bundle, "the file is corrupted")


def test_empty_file(tmp_path):
    path = tmp_path / "x.nan"
    path.write_bytes(b"")
    _reject(path, "empty (0 bytes)", "the file is incomplete (")


@pytest.mark.parametrize("content", [b"PK\x03\x04 a zip file", b"{\"not\": \"zstd\"}"])
def test_not_a_zstd_file(tmp_path, content):
    path = tmp_path / "x.nan"
    path.write_bytes(content)
    _reject(path, "not a nanreplay bundle (no zstd frame at the start)",
            "pass the .nan file the recorder wrote")


def test_missing_file(tmp_path):
    _reject(tmp_path / "nope.nan", "cannot open (No such file or directory)",
            "pass the path of the .nan file the recorder wrote")


def test_a_directory_given_to_the_reader(tmp_path):
    """(The CLI finds the bundle in a run's out_dir; replay.replay(dir) reads the path given.)"""
    _reject(tmp_path, "cannot open (Is a directory); pass the path of the .nan file")


def test_newer_format_version(tmp_path, monkeypatch):
    monkeypatch.setattr(bundle_mod, "VERSION", 2)
    path = write_bundle(tmp_path, "future", {}, {"a": torch.ones(1)})
    monkeypatch.setattr(bundle_mod, "VERSION", 1)
    _reject(path, "format version 2 is newer than this nanreplay reads (1)",
            "upgrade nanreplay")


def test_version_not_a_number(tmp_path):
    head = {"__metadata__": {"format": "nanreplay-bundle", "version": "one", "meta": "{}"}}
    path = tmp_path / "v.nan"
    path.write_bytes(_frame(_safetensors_bytes(head)))
    _reject(path, "format version 'one' is not a number")


def test_header_not_json(tmp_path):
    raw = b"this is not json at all!"
    path = tmp_path / "h.nan"
    path.write_bytes(_frame(len(raw).to_bytes(8, "little") + raw))
    _reject(path, "header is not JSON", "the file is corrupted")


def test_header_not_an_object(tmp_path):
    path = tmp_path / "h.nan"
    path.write_bytes(_frame(_safetensors_bytes([1, 2, 3])))  # type: ignore[arg-type]
    _reject(path, "header is not a JSON object")


def test_huge_declared_header_size(tmp_path):
    path = tmp_path / "huge.nan"
    path.write_bytes(_frame((2 ** 40).to_bytes(8, "little") + b"{}      "))
    _reject(path, "header claims 1099511627776 bytes (limit 268435456)",
            "the file is corrupted or not a bundle")


def test_plain_safetensors_without_our_metadata(tmp_path):
    raw = safetensors.torch.save({"a": torch.ones(2)})
    path = tmp_path / "plain.nan"
    path.write_bytes(_frame(raw))
    _reject(path, "safetensors file without nanreplay metadata")


def test_meta_not_json(tmp_path):
    head = {"__metadata__": {"format": "nanreplay-bundle", "version": "1", "meta": "{oops"}}
    path = tmp_path / "m.nan"
    path.write_bytes(_frame(_safetensors_bytes(head)))
    _reject(path, "metadata 'meta' is missing or not JSON")


def test_tensor_table_inconsistent(tmp_path):
    entries = [("a", torch.ones(4))]
    head, _ = header_bytes({}, entries, [])
    header = json.loads(head)
    header["a"]["data_offsets"] = [0, 12]  # 4 float32 need 16 bytes
    path = tmp_path / "t.nan"
    path.write_bytes(_frame(_safetensors_bytes(header, b"\0" * 12)))
    _reject(path, "tensor 'a' has offsets [0, 12) but its shape [4] needs 16 bytes")


def test_declared_content_size_mismatch(tmp_path):
    entries = [("a", torch.ones(4))]
    head, size = header_bytes({}, entries, [])
    raw = len(head).to_bytes(8, "little") + head + b"\0" * size
    path = tmp_path / "c.nan"
    path.write_bytes(_frame(raw + b"\0" * 8))  # 8 bytes more than the header describes
    _reject(path, "zstd frame declares", "the file is corrupted")


class _TwoHeads(nn.Module):
    """Returns two tensors made by one autograd node (a split): output_nr 0 and 1."""

    def __init__(self):
        super().__init__()
        self.body = M.mlp(d_out=2 * M.N_CLASSES)

    def forward(self, x):
        return self.body(x).split(M.N_CLASSES, dim=1)


@pytest.mark.parametrize("two_heads", [False, True])
def test_output_gradients_are_the_ones_backward_sent(out_dir, two_heads):
    """outgrad/<mb>/<j> holds exactly the gradient that reached the j-th output tensor."""
    model = _TwoHeads() if two_heads else M.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.CrossEntropyLoss()
    seen = {}
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=out_dir):
            for step in range(5):
                x, y = M.batch(step)
                if step == 2:
                    x[1, 0] = float("nan")
                opt.zero_grad()
                outs = model(x)
                outs = outs if two_heads else (outs,)
                for j, o in enumerate(outs):
                    o.register_hook(lambda g, j=j: seen.__setitem__(j, g.clone()))
                sum(crit(o, y) * (j + 1) for j, o in enumerate(outs)).backward()
                opt.step()
    _, t = read_bundle(info.value.bundle_path)
    assert sorted(k for k in t if k.startswith("outgrad/")) == \
        [f"outgrad/0/{j}" for j in range(len(seen))]
    for j, g in seen.items():
        assert identical(t[f"outgrad/0/{j}"], g)


def test_a_root_relu_ends_its_micro_batch(out_dir):
    """A model that is one ``nn.ReLU`` (its own root): the bundle links the output like any."""
    model = nn.ReLU()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, out_dir=out_dir):
            for step in range(3):
                x = torch.randn(4, 3)
                if step == 2:
                    x[1, 1] = float("nan")
                model(x)
    meta, _ = read_bundle(info.value.bundle_path)
    assert info.value.event["phase"] == "input" and meta["micro_batches"][0]["n_outputs"] == 1

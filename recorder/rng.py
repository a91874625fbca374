"""The RNG states a training step may draw from: captured as each step (and each later
micro-batch) begins, drawing nothing; stored in a bundle as JSON and tensors; restored by the
replay."""

from __future__ import annotations

import ctypes
import operator
import os
import random
import struct
import sys
from typing import Any

import torch

# a generator the model or loss keeps as an attribute (``self.gen = torch.Generator()``, drawn
# by ``torch.randint(..., generator=self.gen)`` in the forward) is a state key of its own
GENERATOR = "generator/"


def module_generators(modules) -> list[tuple[str, Any]]:
    """The generators kept as attributes of ``(name, module)`` pairs, by ``module.attr`` (each
    generator once: one shared by several modules is restored once), then those of the Python
    modules that define their classes, by ``pymodule:attr``: augmentation code seeded apart
    from the model's initialisation (``AUG_GEN = torch.Generator().manual_seed(1234)`` beside
    the transforms that draw from it) draws the step's parameters from no module's attribute,
    and a replay drawing from that generator as the factory's import left it drew others.
    Generators are torch's, NumPy's (``np.random.default_rng(0)``, a ``RandomState`` of its
    own) and Python's (``random.Random(0)``): see :func:`is_generator`."""
    found: dict[int, tuple[str, Any]] = {}
    homes: dict[str, None] = {}
    for name, m in modules:
        for attr, v in vars(m).items():
            if is_generator(v) and id(v) not in found:
                found[id(v)] = (f"{name}.{attr}" if name else attr, v)
        homes[type(m).__module__] = None
    for home in homes:
        py = sys.modules.get(home) if home != "torch" and not home.startswith("torch.") else None
        # (getattr: an entry of sys.modules that is no module, a lazy loader, has no __dict__)
        for attr, v in list(getattr(py, "__dict__", {}).items()):
            if is_generator(v) and id(v) not in found:
                found[id(v)] = (f"{home}:{attr}", v)
    return list(found.values())


def is_generator(v) -> bool:
    """``v`` is a random generator of the user's own: a ``torch.Generator``, a NumPy
    ``Generator`` or ``RandomState``, a ``random.Random``; not the process-wide ones behind
    ``random``'s and ``np.random``'s functions, which are captured as such."""
    if isinstance(v, torch.Generator):
        return True
    if isinstance(v, random.Random):
        return v is not random.getstate.__self__
    np = sys.modules.get("numpy")
    return np is not None and (isinstance(v, np.random.Generator) or (
        isinstance(v, np.random.RandomState) and v is not np.random.get_state.__self__))


def generator_state(g) -> Any:
    """``g``'s state: a tensor for a ``torch.Generator``, else plain JSON (lists, ints)."""
    if isinstance(g, torch.Generator):
        return g.get_state()
    if isinstance(g, random.Random):
        version, words, gauss = g.getstate()
        return {"random": [version, list(words), gauss]}
    state = g.get_state(legacy=False) if hasattr(g, "get_state") else g.bit_generator.state
    return {"numpy": _plain(state)}


def set_generator_state(g, state) -> None:
    """Put back what :func:`generator_state` returned (raises if it is another kind's)."""
    if isinstance(g, torch.Generator):
        g.set_state(state)
    elif isinstance(g, random.Random):
        version, words, gauss = state["random"]
        g.setstate((version, tuple(words), gauss))
    elif hasattr(g, "set_state"):  # (a RandomState)
        g.set_state(state["numpy"])
    else:
        g.bit_generator.state = state["numpy"]


def _plain(v):
    """A NumPy generator's state as JSON: arrays as lists, NumPy scalars as Python's."""
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if hasattr(v, "tolist"):
        return v.tolist()
    return v


class RngCapture:
    """Captures every RNG a training step may draw from (see :meth:`__call__`).

    ``random.getstate()`` (a 625-tuple, ~9 us), NumPy's ``get_state()`` (~30 us) and torch's
    ``get_state()`` (a new 5 KB tensor: the largest share of the recorder's cache misses when a
    step opens) are a large share of a small step, so each is re-read only when a fingerprint
    of the generator's raw MT19937 words (position and three key words) and its cached
    gaussian has moved since the last read. Every draw moves the position or the cached
    gaussian and every wrap regenerates the words, so an unchanged fingerprint means an
    unchanged state. The words are read in place: NumPy's through its documented ``ctypes``
    interface (its cached gaussian inside the ``RandomState`` object), CPython's at the
    ``RandomObject`` layout, torch's inside its ``CPUGeneratorImpl``, each used only after it
    is checked against the real state at the first capture.
    """

    def __init__(self, generators=()):
        # the model's own generators (``module_generators``): set at attach, cleared at detach
        self.generators: list[tuple[str, torch.Generator]] = list(generators)
        # the generator (and RandomState) whose memory is read is held, so it can never
        # dangle; one replaced by another is looked at afresh
        self._np_owner = self._np_rs = self._np_words = self._np_gauss = None
        self._np_last: tuple | None = None
        self._np_key: tuple | None = None
        self._python, self._torch = _Fingerprinted(), _Fingerprinted()
        # the last capture, while no generator moved (see __call__)
        self._fast: tuple | None = None
        self._fast_key: tuple | None = None
        self._fast_state: dict[str, Any] | None = None

    def _numpy_state(self, np) -> Any:
        # the generator behind np.random's functions (bound to it when NumPy was imported)
        rs = getattr(np.random.get_state, "__self__", None)
        owner = getattr(rs, "_bit_generator", None)
        if owner is not self._np_owner or rs is not self._np_rs:  # (the gauss cells are rs's)
            self._np_owner, self._np_rs, self._np_last = owner, rs, None
            try:
                addr = owner.ctypes.state_address
                self._np_words = _uint32s((ctypes.c_uint32 * 625).from_address(addr))
                cells = _numpy_gauss_cells(rs, addr)
                self._np_gauss = cells and (_cell(cells[0], "i"), _cell(cells[1], "d"))
            except Exception:
                self._np_words = False
        words, gauss = self._np_words, self._np_gauss
        if words is False or gauss is False:
            return np.random.get_state()
        # A legacy gaussian draw leaves its second value cached (``has_gauss``, ``gauss``) and
        # the next one uses it without moving the words: both are part of the key.
        key = (_NP_WORDS(words), gauss[0][0], gauss[1][0])
        if key != self._np_key or self._np_last is None:
            self._np_last, self._np_key = np.random.get_state(), key
        return self._np_last

    def _python_state(self) -> tuple:
        # (the instance behind random's functions)
        return self._python.get(random.getstate.__self__, _python_mt_words, random.getstate,
                                _python_key)

    def _torch_state(self) -> torch.Tensor:
        gen = torch.default_generator
        return self._torch.get(gen, _torch_mt_words, gen.get_state, _torch_key)

    def __call__(self) -> dict[str, Any]:
        """Every RNG a training step may draw from, as it is now. Draws nothing itself. A state
        that did not move since the last call is the same object (never written to); when
        none did, the whole capture is the last one, told by one fingerprint of them all (it
        runs as every step opens, its code cold after the step's kernels: one function)."""
        fast = self._fast
        if fast is not None and _fast_key(fast) == self._fast_key:
            return self._fast_state
        state: dict[str, Any] = {"python": self._python_state(),
                                 "torch_cpu": self._torch_state()}
        np = sys.modules.get("numpy")
        if np is not None:
            state["numpy"] = self._numpy_state(np)
        if _cuda_initialized():  # else no CUDA generator has drawn yet
            state["cuda"] = torch.cuda.get_rng_state_all()
        for name, g in self.generators:
            state[GENERATOR + name] = generator_state(g)
        self._fast = self._fast_parts(np, state)
        self._fast_key, self._fast_state = self._fast and _fast_key(self._fast), state
        return state

    def _fast_parts(self, np, state: dict[str, Any]) -> tuple | None:
        """What :func:`_fast_key` reads, where every generator's words are read in place and
        none is a CUDA or the model's own; else None."""
        py, pt = self._python, self._torch
        if self.generators or "cuda" in state or not py.words or not pt.words or (
                np is not None and not (self._np_words and self._np_gauss)):
            return None
        return np, py.owner, py.words, pt.owner, pt.words, self._np_rs, self._np_owner, \
            self._np_words, self._np_gauss


def _fast_key(parts: tuple) -> tuple:
    """Every generator's fingerprint (see :class:`_Fingerprinted`), and what would make the
    capture read another generator: CUDA initialised (never, in a build without it), NumPy
    imported, ``random``'s and ``np.random``'s functions rebound (each is a bound method made
    once, at import). torch's default generator is one object for the process. Equal: no
    state moved. (Each lookup here is a cache miss when a step opens, after its kernels.)"""
    np, inst, pw, _, tw, _, _, nw, gauss = parts
    return (_cuda_initialized(), random.getstate, _PY_WORDS(pw), inst.gauss_next,
            _TORCH_WORDS(tw), sys.modules.get("numpy") if np is None else (
                np.random.get_state, _NP_WORDS(nw), gauss[0][0], gauss[1][0]))


# whether CUDA's generators are to be captured too (see RngCapture.__call__); in a build
# without CUDA never (``bool()`` is False: a C call, where a function would cost a frame)
_cuda_initialized = torch.cuda.is_initialized if torch.backends.cuda.is_built() else bool


class _Fingerprinted:
    """One generator's last state read, read again only when a fingerprint of its words (read
    in place, ``find(owner)``: False where they cannot be) moved; the owner whose memory is
    read is held, so it can never dangle, and one replaced by another is looked at afresh."""

    __slots__ = ("owner", "words", "last", "key")

    def __init__(self):
        self.owner = self.words = self.last = self.key = None

    def get(self, owner, find, read, key_of):
        if owner is not self.owner:
            self.owner, self.last = owner, None
            words = find(owner)
            self.words = words and _uint32s(words)
        words = self.words
        if words is False:
            return read()
        key = key_of(words, owner)
        if key != self.key or self.last is None:
            self.last, self.key = read(), key
        return self.last


# the words each fingerprint reads: position (index, left/next, pos), state words spread
# over the array, and torch's cached normal samples after them
_PY_WORDS = operator.itemgetter(0, 1, 312, 624)
_TORCH_WORDS = operator.itemgetter(0, 2, 3, 314, 626, 627, 628, 629, 630, 631, 632, 633)
_NP_WORDS = operator.itemgetter(624, 0, 311, 623)


def _python_key(w: memoryview, inst: random.Random) -> tuple:
    # (gauss() keeps a second value outside the words: part of the state too)
    return _PY_WORDS(w), inst.gauss_next


def _torch_key(w: memoryview, _) -> tuple:
    return _TORCH_WORDS(w)


def _uint32s(words) -> memoryview:
    """A ctypes ``c_uint32`` array as a memoryview: indexing it is a plain C read, where a
    ctypes index goes through ctypes' item machinery (a few us each when it runs once a step,
    its code out of the CPU's caches after the step's kernels)."""
    return memoryview(words).cast("B").cast("I")


def _cell(cell, fmt: str) -> memoryview:
    """A ctypes scalar as a one-element memoryview (see :func:`_uint32s`)."""
    return memoryview(cell).cast("B").cast(fmt)


def _numpy_gauss_cells(rs, state_address: int):
    """(``has_gauss``, ``gauss``) of NumPy's legacy ``RandomState`` as ctypes cells over the
    object itself, or False where they cannot be found. The object holds a ``bitgen_t`` whose
    first field points at the bit generator's state (``state_address``) and, after it, an
    ``aug_bitgen_t`` ``{bitgen_t *bit_generator; int has_gauss; double gauss}`` pointing back
    at that ``bitgen_t``: both pointers are looked for within the object's own size, and the
    cells are used only if they agree with ``get_state()`` now."""
    try:
        base, n = id(rs), type(rs).__basicsize__ // 8
        words = (ctypes.c_uint64 * n).from_address(base)
        bitgen = next(k for k in range(n) if words[k] == state_address)
        aug = next(k for k in range(bitgen + 1, n) if words[k] == base + 8 * bitgen)
        if 8 * aug + 24 > 8 * n:
            return False
        has = ctypes.c_int.from_address(base + 8 * aug + 8)
        cached = ctypes.c_double.from_address(base + 8 * aug + 16)
        _, _, _, has_gauss, gauss = rs.get_state()
        if has.value == has_gauss and (not has_gauss or cached.value == gauss):
            return has, cached
    except Exception:
        pass
    return False


def _python_mt_words(inst: random.Random):
    """CPython's ``RandomObject`` after its object header: ``int index; uint32 state[624]``,
    as 625 uint32 words (index first), or False where the layout is not that one (another
    interpreter or build): checked against ``getstate()``, whose tuple is the state words
    followed by the index."""
    try:
        if sys.implementation.name != "cpython" or type(inst) is not random.Random:
            return False
        header = object.__basicsize__  # refcount and type pointer
        words = (ctypes.c_uint32 * 625).from_address(id(inst) + header)
        version, internal, _ = inst.getstate()
        if version == 3 and list(internal) == [*words[1:], words[0]]:
            return words
    except Exception:
        pass
    return False


def _torch_mt_words(gen: torch.Generator):
    """The words of torch's ``CPUGeneratorImpl`` from its MT19937 engine on: ``int left_;
    bool seeded_; uint32 next_; uint32 state_[624]`` then the cached normal samples
    (``optional<float>``, ``optional<double>``: 24 to 28 bytes), as 634 uint32 words (``left_``
    first), or False where the layout is not that one. The generator object holds a pointer to the
    implementation after its header (``at::Generator``); the engine is found by the first state words of
    ``get_state()`` (whose legacy layout is ``uint64 seed; int left; int seeded; uint64 next;
    uint64 state[624]; double normal_x, normal_y, normal_rho; int normal_is_valid``) and used
    only if its position, all 624 words and the cached double sample agree with it."""
    try:
        header = object.__basicsize__
        if sys.implementation.name != "cpython" or type(gen) is not torch.Generator \
                or gen.device.type != "cpu" or not os.path.exists("/proc/self/mem"):
            return False
        state_now = gen.get_state()  # (a CPU byte tensor: read in place, no tensor method)
        raw = ctypes.string_at(state_now.data_ptr(), state_now.numel())
        _, left, _, nxt = struct.unpack_from("<QiiQ", raw, 0)
        state = [w & 0xFFFFFFFF for w in struct.unpack_from("<624Q", raw, 24)]
        _, normal_y, _, normal_valid = struct.unpack_from("<dddi", raw, 24 + 624 * 8)
        impl = ctypes.c_void_p.from_address(id(gen) + header).value
        # (read through /proc/self/mem: an address that is not the engine's, on another build,
        # fails there with an error instead of faulting)
        with open("/proc/self/mem", "rb", buffering=0) as mem:
            mem.seek(impl)
            head = list(struct.unpack_from("<64I", mem.read(4 * (64 + 634))))  # (all it reads)
        at = next(k for k in range(3, 61) if head[k: k + 3] == state[:3])
        words = (ctypes.c_uint32 * 634).from_address(impl + 4 * (at - 3))
        at_double = -(-(ctypes.addressof(words) + 4 * 627 + 8) // 8) * 8  # (aligned to 8)
        double = ctypes.c_double.from_address(at_double)
        has_double = ctypes.c_bool.from_address(at_double + 8)
        if (words[0], words[2]) == (left, nxt) and list(words[3:627]) == state \
                and has_double.value == bool(normal_valid) \
                and (not normal_valid or double.value == normal_y):
            return words
    except Exception:
        pass
    return False


def capture_rng() -> dict[str, Any]:
    """Every RNG a training step may draw from, as it is now. Draws nothing itself."""
    return RngCapture()()


def restore_rng(state: dict[str, Any], generators: dict[str, torch.Generator] | None = None
                ) -> None:
    """Put back what :func:`capture_rng` (or :func:`rng_from_bundle`) returned; generators it
    leaves out (see :func:`rng_drawn`) stay as they are. ``generators``: the rebuilt model's
    own, by the names :func:`module_generators` gives (one it lacks, or on another device
    type, stays as the factory made it)."""
    for key, s in state.items():
        g = (generators or {}).get(key.removeprefix(GENERATOR)) \
            if key.startswith(GENERATOR) else None
        if g is not None:
            try:
                set_generator_state(g, s)
            except (RuntimeError, ValueError, TypeError, KeyError, IndexError):
                pass  # (a CUDA generator's state on a CPU replay; another kind of the name)
    if "python" in state:
        random.setstate(state["python"])
    if "torch_cpu" in state:
        torch.set_rng_state(state["torch_cpu"])
    if "numpy" in state:
        import numpy as np  # only when the recorded run used it

        np.random.set_state(state["numpy"])
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        for i, s in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)


def rng_to_bundle(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Split an RNG state into JSON metadata and tensors for the bundle."""
    meta: dict[str, Any] = {}
    tensors = {"rng/torch_cpu": state["torch_cpu"].clone()} if "torch_cpu" in state else {}
    if "python" in state:
        version, internal, gauss = state["python"]
        meta["python"] = {"version": version, "gauss": gauss}
        tensors["rng/python"] = torch.tensor(internal, dtype=torch.int64)
    if "numpy" in state:
        name, keys, pos, has_gauss, cached = state["numpy"]
        meta["numpy"] = {"name": name, "pos": int(pos), "has_gauss": int(has_gauss),
                         "cached_gaussian": float(cached)}
        tensors["rng/numpy"] = torch.tensor(keys.tolist(), dtype=torch.int64)
    for i, s in enumerate(state.get("cuda", [])):
        tensors[f"rng/cuda/{i}"] = s.cpu().clone()
    meta["cuda_devices"] = len(state.get("cuda", []))
    gens = {k.removeprefix(GENERATOR): v for k, v in state.items() if k.startswith(GENERATOR)}
    if torch_gens := [n for n, v in gens.items() if isinstance(v, torch.Tensor)]:
        meta["generators"] = torch_gens
        tensors.update({f"rng/{GENERATOR}{n}": gens[n].cpu().clone() for n in torch_gens})
    if others := {n: v for n, v in gens.items() if not isinstance(v, torch.Tensor)}:
        meta["generator_states"] = others  # (NumPy's and Python's: JSON)
    return meta, tensors


def rng_drawn(state: dict[str, Any], before: dict[str, Any] | None) -> dict[str, Any]:
    """The generators of ``state`` (a capture) that moved since the capture ``before``: those
    a later micro-batch's entry must restore (all of them when ``before`` is None)."""
    if before is None:
        return state
    return {k: v for k, v in state.items() if not _same_state(v, before.get(k))}


def _same_state(a, b) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):  # python (version, words, gauss), numpy's, cuda's list
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(
            _same_state(x, y) for x, y in zip(a, b))
    if hasattr(a, "shape") and hasattr(b, "shape"):  # numpy's key array
        return a.shape == b.shape and bool((a == b).all())
    return a == b


def rng_from_bundle(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Inverse of :func:`rng_to_bundle`."""
    state: dict[str, Any] = {}
    if "python" in meta:  # (a micro-batch's states hold the generators that drew: rng_drawn)
        py = meta["python"]
        state["python"] = (py["version"], tuple(tensors["rng/python"].tolist()), py["gauss"])
    if "rng/torch_cpu" in tensors:
        state["torch_cpu"] = tensors["rng/torch_cpu"]
    if "numpy" in meta:
        import numpy as np

        npm = meta["numpy"]
        keys = np.array(tensors["rng/numpy"].tolist(), dtype=np.uint32)
        state["numpy"] = (npm["name"], keys, npm["pos"], npm["has_gauss"], npm["cached_gaussian"])
    if meta.get("cuda_devices"):
        state["cuda"] = [tensors[f"rng/cuda/{i}"] for i in range(meta["cuda_devices"])]
    for n in meta.get("generators") or ():
        if isinstance(n, str) and f"rng/{GENERATOR}{n}" in tensors:
            state[GENERATOR + n] = tensors[f"rng/{GENERATOR}{n}"]
    others = meta.get("generator_states")
    for n, v in (others.items() if isinstance(others, dict) else ()):
        if isinstance(n, str) and isinstance(v, dict):
            state[GENERATOR + n] = v
    return state

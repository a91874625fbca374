"""Whose code it was: the user's source line of an op or an autograd node, and whether an
exception came from the model's own code or from the replay.

A frame is the user's when it is neither torch's nor nanreplay's (nor Python's own glue:
``<string>``, ``contextlib``, ``threading``); code generated with its source in ``linecache``
(a torch.fx ``GraphModule``'s ``<eval_with_key>``) is the model's own, named by the line it
was traced from where its node keeps one (:mod:`replay.fx_lines`: an exported model).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import linecache
import os
import re
import sys
import tokenize
import traceback
import warnings

import torch

from .compat import OP_ERROR, eager_torch, frame_tracebacks, no_process_group
from .fx_lines import traced_line

_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIRS = tuple(os.path.dirname(os.path.dirname(__file__)) + os.sep + d + os.sep
                  for d in ("replay", "recorder"))
# modes of the replay's that pass every torch call on (grad_hooks' watch of register_hook,
# lost_eps' watch of guards, below_one's of softmaxes, update_linalg's of an update) sit among torch's frames, between the
# user's call and the op: read them as torch's; so is the wrapper every mode's dispatch runs in
# (compat's, handing it real zeros for autograd's efficient ones), and the definitions
# torch.cond and torch.while_loop run by there (an op of their own: the user's call is the line)
_PASS_THROUGH = tuple(os.path.join(os.path.dirname(__file__), f)
                      for f in ("grad_hooks.py", "lost_eps.py", "below_one.py", "compat.py",
                                 "update_linalg.py", "eager_control_flow.py"))
_DIST_DIR = os.path.join(_TORCH_DIR, "distributed") + os.sep
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def user_source(stack=None) -> str | None:
    """``file:line`` of the innermost frame that is neither torch nor nanreplay (see
    :func:`_first_user`), from the current stack or ``stack``."""
    if stack is None:
        return _first_user(_live_stack(inspect.currentframe()))
    return _first_user((fr.filename, fr.lineno) for fr in reversed(stack)
                       if not _subclass_handler(fr.name, fr.filename))


def _live_stack(frame) -> list[tuple[str, int]]:
    """``(file, line)`` of the frames ``traceback.extract_stack()`` lists from ``frame`` out
    (``sys.tracebacklimit`` of them), innermost first, less a tensor subclass's handlers. Read
    off the frames without its summaries and source lines: this runs at each op a watcher
    keeps, dozens of frames deep. Its check of ``linecache`` is kept (an edited file's stale
    lines dropped), as the report reads lines from there."""
    limit = getattr(sys, "tracebacklimit", None)
    frames, files = [], set()
    while frame is not None and (limit is None or len(frames) < max(limit, 0)):
        code = frame.f_code
        files.add(code.co_filename)
        linecache.lazycache(code.co_filename, frame.f_globals)
        frames.append((code.co_filename, frame.f_lineno, code.co_name))
        frame = frame.f_back
    for f in files:
        linecache.checkcache(f)
    return [(f, line) for f, line, name in frames if not _subclass_handler(name, f)]


# a tensor subclass's handler (a masked-activations wrapper's, a parameter subclass's) passes
# every op of its tensors on: the line that wrote the op is its caller's
_HANDLERS = ("__torch_function__", "__torch_dispatch__")


def _subclass_handler(name: str, filename: str) -> bool:
    return name in _HANDLERS and not filename.startswith(_OWN_DIRS)


def library_caller(source: str | None) -> str | None:
    """Where ``source`` (a ``file:line`` read off the live stack) is an installed package's
    (site-packages, dist-packages): the line of the user's own code that called into that
    package (GPyTorch's setter, whose inverse transform made a value; Pyro's log-probabilities),
    like :func:`user_source` passing the packages' frames too. None for any other source, or
    where no user code lies between (the replay itself called the package's model)."""
    if not in_package(source):
        return None
    # (read as torch's, not dropped: a package's frames between the replay's own are no user
    # code either, and the replay's callers beyond them are not it)
    return _first_user(((fr.filename, fr.lineno) for fr in reversed(traceback.extract_stack())),
                       skip=_LIBRARY_DIRS)


_LIBRARY_DIRS = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)


def installed_package(source: str | None) -> str | None:
    """The top-level name of the installed package (site-packages, dist-packages) whose file
    ``source`` (``file:line``) is, e.g. ``pytorch_metric_learning``; None for any other."""
    for d in _LIBRARY_DIRS:
        if source and d in source:
            first = source.rsplit(d, 1)[1].split(os.sep, 1)[0]
            return first.partition(":")[0].removesuffix(".py") or None
    return None


def in_package(source: str | None) -> bool:
    """Whether ``source`` (``file:line``) is an installed package's: a library's code, not
    the user's."""
    return installed_package(source) is not None


def caller_source(frame) -> str | None:
    """``file:line`` of the user's code that called into torch from ``frame`` outwards (a
    module hook's frame: the line that called the module), read off the live frames."""
    def outward(f):
        while f is not None:
            yield f.f_code.co_filename, f.f_lineno
            f = f.f_back
    return _first_user(outward(frame))


def node_source(fn) -> str | None:
    """``file:line`` of the user's code whose forward made autograd node ``fn``, from the
    traceback anomaly mode keeps on it (see :func:`node_tracebacks`); None without one."""
    return _first_user(_node_frames(fn))


def node_caller(fn) -> str | None:
    """Where node ``fn``'s forward line (:func:`node_source`) is an installed package's (a
    library loss's term: MONAI's focal loss inside the user's compound loss): the line of the
    user's code that called into that package, from the same traceback, as
    :func:`library_caller` reads it off the live stack for a forward op. None otherwise."""
    src = node_source(fn)
    if not src or not any(d in src for d in _LIBRARY_DIRS):
        return None
    return _first_user(_node_frames(fn), skip=_LIBRARY_DIRS)


def _node_frames(fn) -> list[tuple[str, int]]:
    """``(file, line)`` of the frames of node ``fn``'s forward traceback, innermost first."""
    tb = (getattr(fn, "metadata", None) or {}).get("traceback_")
    if not tb:
        return []
    text = "".join(tb) if isinstance(tb, list) else str(tb)
    return [(path, int(line)) for path, line in reversed(_FRAME.findall(text))]


@contextlib.contextmanager
def node_tracebacks():
    """A forward under anomaly mode without its NaN check: each node keeps its forward's
    traceback (:func:`node_source`), and a NaN raises nothing; a torch.cond's branch makes its
    own ops' nodes, not one node for the whole op (:func:`replay.compat.eager_torch`)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autograd.detect_anomaly(check_nan=False), eager_torch(), frame_tracebacks():
            yield


def _first_user(frames, skip: tuple[str, ...] = ()) -> str | None:
    """The first of ``(file, line)`` frames, innermost first, that is the user's.

    Walking out from the op: the watcher's own frames, then torch's; the first other frame is
    the user's code that called into torch. Reaching a frame of nanreplay instead means the
    replay itself called torch there (a model built of torch's modules only, ``optimizer.step()``
    of a built-in optimizer): no user line made the op, and the replay's callers (the CLI,
    click, a test) are not it either.
    """
    left_own = False
    for f, line in frames:
        if left_own and f in _PASS_THROUGH:
            continue
        if f.startswith(_OWN_DIRS):
            if left_own:
                return None
            continue
        left_own = True
        if (traced := traced_line(f, line)) is not None:  # (an exported model's code)
            return f"{short_path(traced[0])}:{traced[1]}"
        if f.startswith(_TORCH_DIR) or any(d in f for d in skip) or f.startswith("<") and (
                f.startswith("<frozen") or not linecache.getline(f, line)):
            continue  # (code generated with its source kept is the user's: torch.fx's)
        if os.sep + "contextlib.py" in f or os.sep + "threading.py" in f:
            continue
        return f"{short_path(f)}:{line}"
    return None


def is_torch_file(path: str) -> bool:
    """Whether ``path`` is one of torch's own source files."""
    return os.path.abspath(path).startswith(_TORCH_DIR + os.sep)


def raised_at(e: BaseException) -> str | None:
    """``file:line`` of the user's code that raised ``e`` (its innermost user frame)."""
    return _first_user((f.filename, f.lineno)
                       for f in reversed(traceback.extract_tb(e.__traceback__)))


def short_path(path: str) -> str:
    """``path`` relative to the current directory when it lies below it."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith("..") else path


def raised_by_model(e: BaseException) -> bool:
    """Whether the model's (or its loss's) own code raised ``e`` during a re-run, rather than
    the replay: an op failing inside a dispatch mode (marked :data:`OP_ERROR`), else the
    innermost frame outside torch is not nanreplay's."""
    if getattr(e, OP_ERROR, False):
        return True
    for frame in reversed(traceback.extract_tb(e.__traceback__)):
        if frame.filename.startswith(_TORCH_DIR) or frame.filename.startswith("<"):
            continue
        return not frame.filename.startswith(_OWN_DIRS)
    return False


def distributed_call(e: BaseException) -> tuple[str | None, str] | None:
    """(``file:line`` of the user's code, the torch.distributed function it called) when
    ``e`` is that call failing for want of a process group (a collective in a loss: the
    replay runs one process, without the run's ranks), else None."""
    if not no_process_group(e):
        return None
    frames = traceback.extract_tb(e.__traceback__)
    inside = [i for i, f in enumerate(frames) if f.filename.startswith(_DIST_DIR)]
    # the function called, past torch's logging decorators (c10d_logger's ``wrapper``)
    named = [i for i in inside if frames[i].name not in ("wrapper", "inner")]
    if not named:
        return None
    called = frames[named[0]]
    module = os.path.relpath(called.filename, os.path.dirname(_TORCH_DIR))
    module = module.removesuffix(".py").removesuffix(os.sep + "__init__").replace(os.sep, ".")
    # (torch.distributed re-exports distributed_c10d's functions: the name users write)
    module = module.removesuffix(".distributed_c10d")
    return (_first_user((f.filename, f.lineno) for f in reversed(frames[:inside[0]])),
            f"{module}.{called.name}")


def statement(path: str, line: int, most: int = 6) -> str:
    """The source text of ``path``:``line`` with the lines that continue its statement (after a
    backslash or an open bracket) joined on: an op on a continuation line (the ``/ idcg`` of
    ``delta = a * \\`` newline ``b / idcg``) is reported at the statement's first line. A
    line inside a statement (one closing a bracket it did not open) is kept as it is."""
    text = linecache.getline(path, line).rstrip()
    parts = [text]
    while len(parts) < most and _continued("\n".join(parts)):
        nxt = linecache.getline(path, line + len(parts)).rstrip()
        if not nxt:
            break
        parts.append(nxt)
    still_open = _continued("\n".join(parts))
    if len(parts) == 1 or still_open is None:
        return text
    try:  # a statement longer than ``most`` lines is still open at the end: cut with " ..."
        for tok in tokenize.generate_tokens(io.StringIO("\n".join(parts) + "\n").readline):
            if tok.type == tokenize.COMMENT and (still_open or tok.start[0] < len(parts)):
                row = tok.start[0] - 1  # (not the last line's, unless the statement goes on)
                parts[row] = parts[row][:tok.start[1]]
    except tokenize.TokenError:
        pass
    joined = " ".join(p.strip().removesuffix("\\").rstrip() for p in parts)
    return joined + " ..." if still_open else joined


def _continued(code: str) -> bool | None:
    """Whether ``code`` is a statement that goes on past its last line; None when it is not
    the start of one (a bracket closed that it did not open)."""
    depth = 0
    try:
        for tok in tokenize.generate_tokens(io.StringIO(code + "\n").readline):
            if tok.type == tokenize.OP and tok.string in "([{)]}":
                depth += 1 if tok.string in "([{" else -1
                if depth < 0:
                    return None
    except tokenize.TokenError:  # EOF inside brackets or after a backslash
        return True
    except SyntaxError:
        return None
    return False

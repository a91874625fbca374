"""The user's line behind a torch.fx ``GraphModule``'s generated code (``<eval_with_key>.N``):
a model made by ``torch.export.export(...).module()`` runs aten calls from generated code, and
its node's ``stack_trace`` names the line of the module that was exported. The replay's models'
GraphModules are remembered by their ``forward``'s code file as they are built."""

from __future__ import annotations

import re
import weakref

from torch import fx, nn

from .compat import fx_node_at

_BY_FILE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def remember(model: nn.Module) -> nn.Module:
    """Note ``model``'s GraphModules (itself included) by their generated code's file;
    ``model`` returned."""
    for m in model.modules():
        if isinstance(m, fx.GraphModule):
            code = getattr(type(m).forward, "__code__", None)
            if code is not None:
                _BY_FILE[code.co_filename] = m
    return model


def traced_line(path: str, line: int) -> tuple[str, int] | None:
    """``(file, line)`` of the traced code that made the node at ``path:line`` of a
    remembered GraphModule's generated code, its innermost frame; None otherwise."""
    gm = _BY_FILE.get(path) if path.startswith("<") else None
    node = fx_node_at(gm, line) if gm is not None else None
    frames = _FRAME.findall((node.meta.get("stack_trace") or "") if node is not None else "")
    return (frames[-1][0], int(frames[-1][1])) if frames else None

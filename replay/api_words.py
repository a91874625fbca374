"""The Python API's words for the options the replay's messages name: the messages are
written once, in the command line's words (``--factory MOD:FN``, ``--try lr=0.1x``), and
``replay.replay`` says them as its caller passes them (``factory=``, ``tries=["lr=0.1x"]``)
through this one mapping, for its errors and its report alike."""

from __future__ import annotations

import re
from typing import Any

# a --try / --device / --factory value: up to a space, less the punctuation that ends a phrase
_VALUE = r"('[^']*'|\"[^\"]*\"|[^\s'\"]+)"
_END = ",;:.)"


def _quoted(value: str) -> str:
    """``value`` as a Python string literal (a ``repr`` already is one)."""
    return value if value[:1] in "'\"" else f'"{value}"'


def _valued(word: str, wrap=lambda v: v):
    """Replace ``--option VALUE`` by ``word=`` + the wrapped value, leaving the punctuation
    that ends the phrase after it."""
    def sub(m: re.Match) -> str:
        value = m.group(1)
        core = value.rstrip(_END) if value[:1] not in "'\"" else value
        shown = core + "..." if core.endswith("=") else core  # (``drop=`` of samples named)
        return f"{word}={wrap(_quoted(shown))}{value[len(core):]}"
    return sub


_WORDS: list[tuple[re.Pattern, Any]] = [
    (re.compile(r"nanreplay(?: \S+)? --strip (\w+) -o ([^\s)]+)"),
     r'replay.strip_bundle(path, "\2", ["\1"])'),
    (re.compile(r"--factory MOD:FN \(and --factory-kwargs\)"),
     "factory= (and factory_kwargs=)"),
    (re.compile(r"--factory MOD:FN \(a function returning the model\)"),
     'factory= (the function or class that builds the model, or "MOD:FN")'),
    (re.compile(r"--factory MOD:FN"), 'factory= (the function or class itself, or "MOD:FN")'),
    (re.compile(r"--factory-kwargs '([^']*)'"), r"factory_kwargs=\1"),
    (re.compile(r"--factory-kwargs\b"), "factory_kwargs="),
    (re.compile(r"--factory (?!-)" + _VALUE), _valued("factory")),
    (re.compile(r"--factory\b(?!-)"), "factory="),
    (re.compile(r"--try (?!-)(?=\S*=|auto\b|'|\")" + _VALUE), _valued("tries", lambda v: f"[{v}]")),
    (re.compile(r"--try\b"), "tries="),
    (re.compile(r"--device (cpu|cuda)\b"), r'device="\1"'),
    (re.compile(r"--device\b"), "device="),
    (re.compile(r"--debug\b"), "debug=True"),
    (re.compile(r"--html\b"), "html="),
    (re.compile(r"--info\b"), "replay.bundle_info(path)"),
    (re.compile(r"another -o path"), "another output path"),
    (re.compile(r"(?:-o/)?--output\b"), "strip_bundle's output"),
    (re.compile(r"--strip\b"), "replay.strip_bundle"),
    (re.compile(r"--json\b"), "replay.report_json"),
]

# report parts that are not the replay's words: the user's own source lines, the ring buffer
_NOT_WORDS = ("source_lines", "history")


def python_words(text: str) -> str:
    """``text`` with each option in the words of ``replay.replay``'s arguments."""
    if "-" not in text:
        return text
    for pattern, repl in _WORDS:
        text = pattern.sub(repl, text)
    return text


def in_python_words(value: Any) -> Any:
    """A report (its dicts, lists and strings) with :func:`python_words` applied in place;
    returned for its caller's convenience."""
    if isinstance(value, str):
        return python_words(value)
    if isinstance(value, dict):
        for k, v in value.items():
            if k not in _NOT_WORDS:
                value[k] = in_python_words(v)
    elif isinstance(value, list):
        value[:] = [in_python_words(v) for v in value]
    return value

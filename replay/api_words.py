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
# a shell word of a command in backquotes (shlex.quote's quoting)
_ARG = r"('[^']*'|[^\s'`]+)"


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


def _notebook_factory(name: str) -> str:
    """The command's advice with the API's one after it (a class defined in a notebook): the
    API's caller is where it is defined, so only the API's is said, naming the class."""
    if name == "that_function":
        return 'factory=FN (the function or class that builds the model, or "MOD:FN")'
    return f"factory={name} (the class itself, or a function that builds the model)"


# a command's options as ``replay.replay``'s arguments: name, and whether a list holds the value
_ARGUMENTS = {"--factory": ("factory", False), "--try": ("tries", True),
              "--device": ("device", False), "--factory-kwargs": ("factory_kwargs", False)}


def _call(path: str, options: str) -> str:
    """```nanreplay PATH --factory MOD:FN``` as ```replay.replay("PATH", factory="MOD:FN")```."""
    args, words = [_quoted(path)], re.findall(_ARG, options)
    for option, value in zip(words[::2], words[1::2] + [""] * len(words)):
        name, listed = _ARGUMENTS.get(option, (option.lstrip("-").replace("-", "_"), False))
        shown = value.strip("'") if name == "factory_kwargs" else _quoted(value)
        args.append(f"{name}=[{shown}]" if listed else f"{name}={shown}")
    return f"`replay.replay({', '.join(args)})`"


_WORDS: list[tuple[re.Pattern, Any]] = [
    (re.compile(r"nanreplay(?: \S+)? --strip (\w+) -o ([^\s)]+)"),
     r'replay.strip_bundle(path, "\2", ["\1"])'),
    # (a command to run from another directory: the working directory the API imports from)
    (re.compile(rf"`cd {_ARG} && nanreplay {_ARG}`"),
     lambda m: f"`os.chdir({_quoted(m[1])}); replay.replay({_quoted(m[2])})`"),
    (re.compile(rf"`nanreplay {_ARG}((?: --?[\w-]+(?: {_ARG})?)*)`"), lambda m: _call(m[1], m[2])),
    (re.compile(r"--factory MOD:FN \(and --factory-kwargs\)"),
     "factory= (and factory_kwargs=)"),
    (re.compile(r"--factory MOD:FN \(a function returning the model\)( to re-run the step)?, "
                r"or, where it is defined \(a notebook\), replay\.replay\(path, factory=(\w+)\)"),
     lambda m: _notebook_factory(m[2]) + (m[1] or "")),
    (re.compile(r"--factory MOD:FN \(a function returning the model\)"),
     'factory=FN (the function or class that builds the model, or "MOD:FN")'),
    # (FN: what follows in a message describes FN, "a function returning the model")
    (re.compile(r"--factory MOD:FN"), 'factory=FN (or "MOD:FN")'),
    (re.compile(r"--factory-kwargs '([^']*)'"), r"factory_kwargs=\1"),
    (re.compile(r"--factory-kwargs\b"), "factory_kwargs="),
    (re.compile(r"--factory (?!-)" + _VALUE), _valued("factory")),
    (re.compile(r"--factory\b(?!-)"), "factory="),
    # (two what-ifs said as one: "--try lr=0.1x and clip=1.0 re-run ...")
    (re.compile(r"--try ([\w\[\]]+=[^\s'\"]+) and ([\w\[\]]+=[^\s'\"]+)"),
     r'tries=["\1", "\2"]'),
    (re.compile(r"--try (?!-)(?=\S*=|auto\b|'|\")" + _VALUE), _valued("tries", lambda v: f"[{v}]")),
    (re.compile(r"--try\b"), "tries="),
    (re.compile(r"--device (?!-)" + _VALUE), _valued("device")),
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
    if "-" not in text and "nanreplay " not in text:  # (no option, no command: most text)
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

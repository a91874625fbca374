"""``nanreplay BUNDLE``: re-run the recorded step and say which op made the first NaN/Inf.

Exit codes: 0 reproduced and localised, 1 replayed but not reproduced, 2 bad usage or bundle.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
import warnings
from pathlib import Path

import click

# torch warns when it is imported where NumPy is not installed; nanreplay does not use NumPy
# (not one of its dependencies), so on its command line that warning is only noise.
_NO_NUMPY = "Failed to initialize NumPy"
warnings.filterwarnings("ignore", message=_NO_NUMPY, category=UserWarning)

# Only what every run needs is imported here: --help, --info and --strip must start in a
# fraction of a second, so the replay's machinery (and torch) comes with the path that uses it.
from recorder.errors import BundleError  # noqa: E402

from .errors import ReplayError, one_line  # noqa: E402


def _fail(message: str) -> None:
    # One line, whatever the message (exception texts from model code often span several).
    message = " ".join(part.strip() for part in message.splitlines() if part.strip())
    click.echo(f"nanreplay: {message}", err=True)
    sys.exit(2)


class _OneLineUsage(click.Command):
    """Usage errors as one ``nanreplay:`` line, like every other error, instead of click's
    three (usage, hint, error)."""

    def main(self, *args, **kwargs):
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)
        except click.UsageError as e:
            _fail(f"{e.format_message()} (nanreplay --help lists the options)")
        except click.Abort:
            _fail("interrupted")
        sys.exit(rv if isinstance(rv, int) else 0)  # --help returns 0; the command exits itself


@click.command(cls=_OneLineUsage, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("bundle", type=click.Path(exists=True, path_type=Path))
@click.option("--json", "as_json", is_flag=True,
              help="Print the machine-readable report on stdout, nothing else.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write a self-contained HTML report to this file.")
@click.option("--info", is_flag=True,
              help="Summarise the bundle (event, sizes, environment) without running code.")
@click.option("--factory", metavar="MOD:FN",
              help="The function that builds the model (trusted; overrides the recorded one).")
@click.option("--factory-kwargs", "factory_kwargs", metavar="JSON",
              help="Keyword arguments for the factory, as a JSON object (overrides the "
                   "recorded factory_kwargs).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]),
              help="Replay on this device (e.g. a GPU bundle on a CPU machine).")
@click.option("--strip", "strip_parts", multiple=True, type=click.Choice(["batch", "weights"]),
              help="With -o: write a shareable copy without the batch and/or the weights.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="Where --strip writes the copy.")
@click.option("--try", "tries", multiple=True, metavar="KEY=VALUE",
              help="Re-run with one change and say if it stays finite (repeatable, each tried "
                   "separately): lr=1e-4, lr=0.1x (every parameter group's rate; lr[2]=1e-4: group "
                   "2's alone), eps=1e-8, clip=1.0, wd=0.01, "
                   "dtype=float32|float64|bfloat16, drop=3,7, Rprop's "
                   "step_sizes=1e-6,50 and etas=0.5,1.2, or auto.")
@click.option("--debug", is_flag=True, hidden=True, help="Show tracebacks of internal errors.")
def main(bundle: Path, as_json: bool, html_path: Path | None, info: bool, factory: str | None,
         factory_kwargs: str | None, device: str | None, strip_parts: tuple[str, ...],
         output: Path | None, tries: tuple[str, ...], debug: bool) -> None:
    """Replay the step recorded in BUNDLE and report the op, module, samples and cause of its
    first non-finite value. BUNDLE may be the directory the recorder wrote it to (its
    out_dir) when that holds one event's bundle."""
    _check_tries(tries)
    if bundle.is_dir():
        from .bundle_dir import bundle_in

        try:
            bundle = bundle_in(bundle)
        except ReplayError as e:  # (said as a usage error: a path to pass)
            raise click.UsageError(str(e)) from None
    try:
        from .bundle_dir import check_finished

        check_finished(bundle)  # (a bundle's unfinished temporary file: said for what it is)
        # the step's code warns at each of the many re-runs ("std(): degrees of freedom is
        # <= 0"): each one once (the registry the "default" action keeps per location is cleared
        # by every catch_warnings block the analysis enters)
        with warnings.catch_warnings():
            warnings.filterwarnings("once", category=UserWarning)
            # (torch is first imported in here, by the path that needs it)
            warnings.filterwarnings("ignore", message=_NO_NUMPY, category=UserWarning)
            code = _run(bundle, as_json, html_path, info, factory, _kwargs(factory_kwargs),
                        device, strip_parts, output, tries, debug)
    except click.ClickException:
        raise  # bad usage: _OneLineUsage prints it
    except (BundleError, ReplayError) as e:
        _fail(str(e))
    except KeyboardInterrupt:
        _fail("interrupted")
    except Exception as e:  # a bug of ours or of the replayed model's code
        if debug:
            traceback.print_exc()
        _fail(f"replay failed ({type(e).__name__}: {one_line(e)}); re-run with --debug for "
              "the traceback")
    sys.exit(code)


def _kwargs(text: str | None) -> dict | None:
    """``--factory-kwargs``: a JSON object of keyword arguments, or None when not given."""
    if text is None:
        return None
    import json

    from recorder.validate import check_factory_kwargs

    try:
        kwargs = json.loads(text)
    except ValueError as e:
        raise click.UsageError(f"--factory-kwargs {text!r} is not JSON ({e}); pass a JSON "
                               "object, e.g. --factory-kwargs '{\"scale\": 4.0}'") from None
    try:
        check_factory_kwargs(kwargs, "--factory-kwargs")
    except TypeError as e:
        raise click.UsageError(f"{e}; e.g. --factory-kwargs '{{\"scale\": 4.0}}'") from None
    return kwargs


def _check_tries(tries) -> None:
    """``--try`` values, checked before anything runs: a bad one is a usage error."""
    if not tries:
        return
    from .whatif import TryError, parse_try

    for t in tries:
        try:
            parse_try(t)
        except TryError as e:
            raise click.UsageError(str(e)) from None


def _run(bundle, as_json, html_path, info, factory, factory_kwargs, device, strip_parts,
         output, tries=(), debug=False) -> int:
    if html_path is not None and (info or strip_parts or output):
        raise click.UsageError("--html writes the report of a replay; --info and --strip do "
                               "not replay: run them separately")
    _check_no_replay_options(info, strip_parts or output, as_json, tries, factory,
                             factory_kwargs, device)
    if strip_parts or output:
        if not (strip_parts and output):
            raise click.UsageError("--strip and -o/--output go together: "
                                   "nanreplay B.nan --strip batch -o shareable.nan",
                                   ctx=click.get_current_context())
        from .strip import strip_set

        try:  # (one rank's shards are stripped with their set: one copy per rank)
            paths = strip_set(bundle, output, list(strip_parts))
        except OSError as e:  # reading errors are BundleErrors: this is the copy's path
            from recorder.validate import why_unwritable  # (imports the recorder's checks)

            raise ReplayError(f"cannot write {output} ({why_unwritable(output.parent, e)}); "
                              "pass another -o path") from None
        click.echo(f"wrote {', '.join(map(str, paths))} without {', '.join(strip_parts)}")
        return 0
    if info:
        from .info import info, info_text, to_json

        d = info(bundle)
        _emit(to_json(d) if as_json else info_text(d))
        return 0
    from .analyze import analyze_bundle
    from .failed_stage import show_tracebacks
    from .info import to_json
    from .report import to_text

    show_tracebacks(debug)  # (of an analysis stage that failed: the report goes on without it)

    if html_path is not None:
        _check_html_dir(html_path)
    # the user's code prints (a factory's "building model...", a forward's debug shapes) go to
    # stderr: stdout is the report's alone, and --json's one JSON document
    with contextlib.redirect_stdout(sys.stderr):
        report = analyze_bundle(bundle, factory, device, factory_kwargs, tries)
    # printed first: a page that cannot be written must not cost the report of a long replay
    _emit(to_json(report) if as_json else to_text(report))
    if html_path is not None:
        from .html import render_html

        try:
            html_path.write_text(render_html(report, report["history"]), encoding="utf-8")
        except OSError as e:
            raise ReplayError(f"cannot write the HTML report to {html_path} "
                              f"({e.strerror or e}); the report was printed; pass another "
                              "--html path") from None
    return 0 if report["reproduced"] and report["origin"].get("phase") else 1


def _check_no_replay_options(info, strip, as_json, tries, factory, factory_kwargs,
                             device) -> None:
    """Options of a replay given with --info or --strip, which replay nothing: refused, as
    --html is, rather than silently dropped (a --try that never ran reads as no answer)."""
    if not (info or strip):
        return
    given = [name for name, value in (("--try", tries), ("--factory", factory),
                                      ("--factory-kwargs", factory_kwargs is not None),
                                      ("--device", device), ("--json", strip and as_json))
             if value]
    if given:
        mode = "--strip" if strip else "--info"  # (--strip takes precedence)
        raise click.UsageError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} "
                               f"for a replay, and {mode} replays nothing: run them "
                               "separately")


def _check_html_dir(html_path: Path) -> None:
    """A page whose directory is missing (or a file) is said before the replay, which can
    take minutes, not after it."""
    parent = html_path.parent
    if not parent.is_dir():
        why = "is a file, not a directory" if parent.exists() else "does not exist"
        raise ReplayError(f"cannot write the HTML report to {html_path} ({parent} {why}); "
                          "pass an --html path in an existing directory")


def _emit(text: str) -> None:
    """The report on stdout; a stdout that cannot take it (a full disk, a closed pipe) is
    that one line, not a 'replay failed' about the replay."""
    try:
        click.echo(text)
        sys.stdout.flush()
    except OSError as e:
        _fail(f"cannot write the report to stdout ({e.strerror or e}); redirect it to a "
              "file or device with room")


if __name__ == "__main__":  # (python -m replay.cli: as the nanreplay script)
    main()

"""The ``kvpool`` command: one subcommand per module, loaded only when used.

Each subcommand lives in the module that owns its job and exposes
``HELP: str``, ``add_arguments(parser)`` and ``run(args) -> int``. This file only
dispatches and turns a :class:`~kvpool.errors.KVPoolError` into one line on stderr
(exit 2) instead of a traceback, so a user mistake never prints a stack. A reader that
closes the pipe early (``kvpool plan kv llama-3-70b | head -1``) ends any subcommand
quietly with status 141, as a shell reports a process killed by SIGPIPE.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import signal
import sys

from kvpool.errors import ErrorCode, KVPoolError, UserError

# subcommand -> module that implements it (imports point down: cli is the top layer)
COMMANDS: dict[str, str] = {
    "master": "kvpool.master.cli",
    "node": "kvpool.node.cli",
    "serve": "kvpool.node.serve",
    "demo": "kvpool.engine.demo",
    "generate": "kvpool.engine.cli",
    "plan": "kvpool.plan.cli",
    "bench": "kvpool.bench.cli",
    "model": "kvpool.engine.model_cli",
}


def _load(name: str):
    try:
        return importlib.import_module(COMMANDS[name])
    except ModuleNotFoundError as exc:  # a subcommand whose optional deps are absent
        if exc.name and exc.name.startswith("kvpool"):
            raise
        return exc


def build_parser(names: list[str] | None = None) -> argparse.ArgumentParser:
    """Build the top-level parser; ``names`` limits which subcommands are loaded."""
    parser = argparse.ArgumentParser(
        prog="kvpool",
        description="kvpool: a distributed, tiered KV-cache store for LLM serving.",
    )
    from kvpool import __version__

    parser.add_argument("--version", action="version", version=f"kvpool {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in names or list(COMMANDS):
        mod = _load(name)
        if isinstance(mod, ModuleNotFoundError):
            p = sub.add_parser(name, help=f"(unavailable: missing package {mod.name})")
            p.set_defaults(_missing=mod.name)
            continue
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run, _parser=p)
    return parser


EXIT_BROKEN_PIPE = 128 + 13  # 128 + SIGPIPE


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvpool`` console script. Returns the exit status
    (0 ok, 2 error, 130 interrupted, 141 stdout closed by its reader)."""
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # so a closed pipe shows here, not at interpreter exit
    except BrokenPipeError:
        # Python's documented recipe (library/signal, "Note on SIGPIPE"): point stdout at
        # devnull so the final flush at exit cannot raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):  # stdout is not a real file (tests capture it)
            pass
        finally:
            os.close(devnull)
        return EXIT_BROKEN_PIPE


_NEGATIVE_WITH_UNIT = re.compile(r"-\d.*[^\d.]")  # "-5MiB": argparse takes it for an option


def _negative_values_joined(argv: list[str]) -> list[str]:
    """``argv`` with ``--flag -5MiB`` written as ``--flag=-5MiB``. argparse reads a
    token that starts with '-' as an option unless it is a plain number, so the user
    was told "--segment-size: expected one argument" rather than what is wrong with
    the value. No option of kvpool looks like "-5MiB", so joining misreads nothing."""
    out: list[str] = []
    for i, token in enumerate(argv):
        if token == "--":  # the rest are positional arguments, as written
            return out + argv[i:]
        if (out and out[-1].startswith("--") and "=" not in out[-1]
                and _NEGATIVE_WITH_UNIT.fullmatch(token)):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def _main(argv: list[str] | None) -> int:
    argv = _negative_values_joined(sys.argv[1:] if argv is None else argv)
    # Load only the named subcommand when there is one: `kvpool master` must not
    # import torch just to build the help of `kvpool demo`.
    chosen = [a for a in argv[:1] if a in COMMANDS]
    parser = build_parser(chosen or None)
    args, unknown = parser.parse_known_args(argv)
    if getattr(args, "_missing", None):  # its flags are unknown: the package is the news
        print(f"kvpool {args.command}: needs the package {args._missing!r}; "
              "install with: pip install -e '.[model]'", file=sys.stderr)
        return 2
    if unknown:  # the subcommand's usage, not the top-level one, goes with the error
        getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KVPoolError as exc:
        # A store error carries a code worth showing; a user mistake or a failed
        # launch reads better as the plain sentence.
        plain = isinstance(exc, UserError) or exc.code == ErrorCode.INTERNAL_ERROR
        suffix = "" if plain else f" ({exc.code.name})"
        print(f"kvpool {args.command}: error: {exc}{suffix}", file=sys.stderr)
        return 2
    except (Exception, KeyboardInterrupt) as exc:
        if not _interrupted(exc):
            raise
        return _report_interrupt(args.command)


def _interrupted(exc: BaseException) -> bool:
    """True when ``exc`` was caused by a Ctrl-C: some libraries turn a KeyboardInterrupt
    raised inside their lazy imports into an ImportError whose cause is the interrupt."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def _report_interrupt(command: str) -> int:
    # a second Ctrl-C while the process winds down (threads joined at exit, a library's
    # atexit) would end in a traceback: the first one already decided
    _ignore_sigint()
    print(f"kvpool {command}: interrupted", file=sys.stderr)
    return 130


def _ignore_sigint() -> None:
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread (main() called from a thread)
        pass


if __name__ == "__main__":
    sys.exit(main())

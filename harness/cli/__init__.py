"""The `fragbench` command: one module per verb, each registering its flags and a short handler over the
modules that hold the logic. Bad input exits 2 with one line on stderr, never a traceback."""

from __future__ import annotations

import contextlib
import os
import sys

from engines.procs import exit_on_sigterm
from harness.cli import (
    ab,
    allocator,
    bench,
    check,
    compare,
    generate,
    history,
    load,
    memory_gate,
    model,
    plan,
    report,
    rules,
    serve,
    simulate,
    workload,
)
from harness.cli.args import MeasuredNothing, Parser, UsageError
from harness.cli.examples import with_examples

VERBS = (model, plan, generate, serve, workload, load, bench, report, compare, history, simulate, check, rules,
         allocator, memory_gate, ab)


def version() -> str:
    """The installed package's version (pyproject.toml's, as pip recorded it)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("fragbench")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed: pip install -e .)"


def build_parser() -> Parser:
    p = Parser(prog="fragbench", description="Where does the KV-cache memory go?")
    p.add_argument("--version", action="version", version=f"fragbench {version()}")
    sub = p.add_subparsers(dest="verb", required=True, parser_class=Parser)
    for verb in VERBS:
        verb.register(sub)
    with_examples(p)  # every verb's --help ends with commands to copy; its flags' metavars carry units
    return p


def closed_pipe() -> int:
    """The reader went away (`fragbench model list | head -1`): it has what it wanted. Quiet, exit 141 as a shell
    tool killed by SIGPIPE; stdout pointed at /dev/null so that the interpreter's last flush says nothing either."""
    with contextlib.suppress(OSError, ValueError):  # a stdout with no file behind it (a test's) has nothing to flush
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 141


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()  # every verb unwinds on SIGTERM, stopping the processes it started
    try:
        args = build_parser().parse_args(argv)
        code = args.func(args)
        sys.stdout.flush()  # here, not at exit: a reader gone (`| head`) is caught below, not a shutdown warning
        return code
    except BrokenPipeError:
        return closed_pipe()
    except UsageError as e:
        print(f"fragbench: error: {e}", file=sys.stderr)
        return 2
    except MeasuredNothing as e:
        print(f"fragbench: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130

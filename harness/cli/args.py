"""What every verb's flags share: the one-line usage error, argument types, and the translation of a domain
module's own error (a missing model, an unknown workload) into that one line."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from engines.shapes import ModelNotFound, load_shape
from harness.units import parse_size


class UsageError(Exception):
    """Bad flags, files or values: one line, exit 2."""


class MeasuredNothing(Exception):
    """A run that measured nothing (no engine started, every request failed): one line, exit 1."""


class DefaultsFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default, unless the help says it (a size or a rule reads better in words)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.required or action.default is argparse.SUPPRESS \
                or "default" in text.lower():
            return text
        if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
            return f"{text} (default: off)" if action.default is False else f"{text} (default: on)"
        if action.default is None or action.default == []:
            return f"{text} (default: none)"
        return f"{text} (default: %(default)s)"


# argparse reads a value after a flag as the flag's only when it does not look like another flag: its own test of a
# negative number takes -1 and -.5 but not -1e3, -inf or -16MiB, which it then reports as "expected one argument".
# Anything that starts with a minus and a digit, a point or inf/nan is a value here, so that the flag's own type
# says what is wrong with it (no flag of fragbench looks like a negative number, which argparse needs for this).
NEGATIVE_VALUE = re.compile(r"^-(\d|\.\d|inf|nan)", re.IGNORECASE)


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = NEGATIVE_VALUE

    def error(self, message: str) -> None:  # argparse prints usage on top; one line is what we promise
        raise UsageError(message)


@contextmanager
def usage_errors(*errors: type[Exception]) -> Iterator[None]:
    """A domain module's refusal (its own exception type) as the CLI's one line."""
    try:
        yield
    except errors as e:
        raise UsageError(str(e)) from None


def size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def int_at_least(text: str, least: int = 1) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}: {text!r}")
    return value


positive_int = int_at_least  # a count of things: at least 1


def number_in(text: str, ok, says: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {says}: {text!r}")
    return value


def positive_float(text: str) -> float:
    return number_in(text, lambda v: 0 < v < float("inf"), "a finite number above 0")


def nonneg_float(text: str) -> float:
    return number_in(text, lambda v: 0 <= v < float("inf"), "a finite number, 0 or more")


def above_one(text: str) -> float:
    return number_in(text, lambda v: 1 < v < float("inf"), "a finite number above 1")


def port_arg(text: str) -> int:
    """A TCP port: 0 (the system picks a free one) to 65535."""
    value = int_at_least(text, 0)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 (any free one) to 65535, not {text}")
    return value


def fraction_arg(text: str) -> float:
    return number_in(text, lambda v: 0 < v <= 1, "in (0, 1]")


def rate_list(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rates takes comma-separated numbers, not {text!r}") from None
    if not rates or any(not 0 < r < float("inf") for r in rates):
        raise argparse.ArgumentTypeError(f"--rates needs one or more positive finite rates, not {text!r}")
    return sorted(set(rates))


def http_url(flag: str, text: str) -> str:
    from urllib.parse import urlparse

    url = urlparse(text)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise UsageError(f"{flag} must be an http URL, not {text!r}")
    return text


def model_dir(path: str, why: str = "no config.json") -> Path:
    if not (Path(path) / "config.json").is_file():
        raise UsageError(f"--model {path!r} is not a model directory ({why})")
    return Path(path)


def run_dir(path: str) -> Path:
    if not (Path(path) / "run.json").is_file():
        raise UsageError(f"{path} is not a run directory (no run.json)")
    return Path(path)


def shape_of(model: str):
    with usage_errors(ModelNotFound):
        return load_shape(model)


def spec_of(name: str):
    # imported when a verb calls this: `fragbench --help` does not load yaml or the workload specs
    from workloads.spec import SpecError, load_spec

    with usage_errors(SpecError):
        return load_spec(name)


def workload_checked(name: str):
    """The workload's spec, its trace file (if it replays one) read and checked: what the checks before a run
    need, in one line where they fail. Its requests are not drawn: simulate's parent drew a Mooncake replay's
    12,031 prompts only to read the spec, 4.8 s of a 30 s run, and every job drew its own again."""
    # imported when a verb calls this: `fragbench --help` does not load numpy
    from workloads.generate import trace_rows
    from workloads.traces import TraceError

    spec = spec_of(name)
    if spec.trace is not None:
        with usage_errors(TraceError):
            trace_rows(spec)
    return spec


def trace_of(name: str, seed: int, max_seq_len: int, vocab_size: int):
    # imported when a verb calls this: `fragbench --help` does not load numpy
    from workloads.generate import trace
    from workloads.traces import TraceError

    spec = spec_of(name)
    with usage_errors(TraceError):
        return trace(spec, seed, max_seq_len, vocab_size)


def device_of(requested: str) -> str:
    # imported when a verb calls this: `fragbench --help` does not load the arena
    from engines.memory.arena import resolve_device

    with usage_errors(ValueError):
        return resolve_device(requested)


def add_api_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api", choices=["completions", "chat"], default="completions",
                        help="the endpoint the load speaks: /v1/completions, or /v1/chat/completions (each prompt "
                             "one user message)")

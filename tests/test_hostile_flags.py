"""Every flag of every verb, fed a value it must refuse (issue 88): one line on stderr, exit 2, no traceback.

The verbs and flags are read from the argparse parsers themselves (`harness.cli.build_parser`), so a new flag is
walked as soon as it is registered. What each gets, by what the parser knows of it:
- every flag that takes a value: no value (the flag last on the line);
- a flag that takes none (--json): a value (`--json=x`);
- a flag with choices: a word that is none of them;
- a flag with a type: values its type must refuse (HOSTILE, by type; a type this file does not know fails the walk
  until it is named here, with what it refuses): numbers out of range, words, paths where nothing can be written.
Free text (a URL, a workload's name, a file read) is refused by the verb after parsing, in its own words: those
flags get the missing value alone, and the refusals of their values are tested verb by verb (test_cli_refusals,
test_bad_input, test_user_paths). Positional arguments are not walked (a run's folder, a results folder: the verb's
checks, tested there).

Parse only: each verb's handler is swapped for one that fails the test, so a value the parser took would be
reported, never run (no server started, no load sent). In-process; a few seconds. FRAGBENCH_FUZZ_EXAMPLES raises
the number of drawn values (default 60 over all flags, beside the one fixed value of each kind every flag gets)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import harness.cli
from engines.shapes import preset_names
from harness.cli import build_parser, main
from harness.cli.args import (
    above_one,
    fraction_arg,
    nonneg_float,
    port_arg,
    positive_float,
    positive_int,
    rate_list,
    size_arg,
)
from harness.cli.bounds import nonneg_int, vocab_size_arg
from harness.cli.engine_flags import alloc_conf_arg, served_model
from harness.cli.generate import prompt_ids_arg
from harness.cli.history import magnitude_arg, pvalue_arg
from harness.cli.kv_budget import kv_budget_arg, kv_budget_list
from harness.cli.run_folder import run_id_arg
from harness.cli.seeds import SEED_MAX, seed_arg
from harness.cli.serve import slow_factor
from harness.cli.user_paths import file_out, folder_out

EXAMPLES = int(os.environ.get("FRAGBENCH_FUZZ_EXAMPLES", "60"))
ZERO_ARG = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction,
            argparse._AppendConstAction, argparse._CountAction)
SKIPPED = (argparse._HelpAction, argparse._VersionAction)  # they print and exit 0, as asked

# words no number, size, inf or nan is spelled with (no a, e, f, i, n, t, y), nor a unit alone that a size takes
WORDS = st.text(alphabet="cdhjopqrsuvwxz", min_size=1, max_size=12)
NEGATIVE = st.one_of(st.integers(max_value=-1).map(str),
                     st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=False).map(repr))
NUMBER = st.one_of(WORDS, NEGATIVE)  # refused by every numeric type here: none takes a word or a negative value
# the hostile values of each type, and (first) the fixed one every flag of that type is walked with
HOSTILE: dict = {
    positive_int: (NUMBER | st.just("0") | st.just("1.5"), "-1"),
    positive_float: (NUMBER | st.just("0") | st.just("inf") | st.just("nan"), "-1"),
    nonneg_float: (NUMBER | st.just("inf") | st.just("nan"), "-0.5"),
    nonneg_int: (NUMBER | st.just("2.5"), "-1"),
    fraction_arg: (NUMBER | st.just("0") | st.floats(1.0001, 1e9).map(repr), "1.5"),
    above_one: (NUMBER | st.floats(-1e9, 1.0).map(repr), "1"),
    pvalue_arg: (NUMBER | st.just("0") | st.just("1"), "1.5"),
    magnitude_arg: (NUMBER | st.just("inf"), "-0.05"),
    slow_factor: (NUMBER | st.floats(0, 0.999).map(repr), "0.5"),
    port_arg: (NUMBER | st.integers(65536, 10**9).map(str), "70000"),
    seed_arg: (NUMBER | st.integers(SEED_MAX + 1, 2**80).map(str) | st.just("1.5"), "-1"),
    vocab_size_arg: (NUMBER | st.integers(2**31, 2**80).map(str), str(2**31)),
    int: (WORDS | st.just("1.5"), "ten"),  # a plain int: any whole number may be legal, so words and fractions
    rate_list: (NUMBER | st.just("0") | st.just(",") | st.just("1,-2"), "-1"),
    prompt_ids_arg: (WORDS | st.just(",") | st.just("1,x"), "a,b"),
    size_arg: (NUMBER | st.just("-16MiB") | st.just("MiB"), "-16MiB"),
    kv_budget_arg: (NUMBER | st.just("-16MiB") | st.just("0MiB"), "-16MiB"),
    kv_budget_list: (NUMBER | st.just("16MiB,-1"), "16MiB,x"),
    alloc_conf_arg: (WORDS.map(lambda w: f"{w}:1") | st.just("expandable_segments:maybe")
                     | st.just("max_split_size_mb:-1"), "garbage"),
    run_id_arg: (WORDS.map(lambda w: f"../{w}") | WORDS.map(lambda w: f".{w}") | WORDS.map(lambda w: f"a/{w}"),
                 "../escape"),
    # a preset whose weights were never built here (the walk runs in an empty folder): the build command, in a line
    served_model: (st.sampled_from(preset_names()), preset_names()[0]),
}
PATHS = (file_out, folder_out)  # walked with a path under a file: no file and no folder can be made there
FREE = (None, str, Path)  # free text: the missing value alone (above)


def verbs(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """Every verb's own parser (`workload trace`, `model build`), with its words."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for sub in subs:
        for name, child in sub.choices.items():
            yield from verbs(child, (*path, name))


def flags(parser: argparse.ArgumentParser):
    return [a for a in parser._actions if a.option_strings and not isinstance(a, SKIPPED)]


PARSER = build_parser()
FLAGS = [(path, action) for path, sub in verbs(PARSER) for action in flags(sub)]


def refused_here(_args) -> int:
    raise AssertionError("the parser took a value it must refuse (the verb was not run)")


for _, _sub in verbs(PARSER):
    _sub.set_defaults(func=refused_here)


def fixed_values(action: argparse.Action, afile: Path) -> list[str | None]:
    """The values every flag is walked with; None: the flag with no value."""
    if isinstance(action, ZERO_ARG):
        return ["x"]
    values: list[str | None] = [None] if action.nargs in (None, 1) else []
    if action.choices is not None:
        values.append("no-such-choice")
    elif action.type in PATHS:
        values.append(str(afile / "x"))
    elif action.type in HOSTILE:
        values.append(HOSTILE[action.type][1])
    return values


def walkable(action: argparse.Action) -> bool:
    """Whether values are drawn for the flag: all but free text's."""
    return isinstance(action, ZERO_ARG) or action.choices is not None or action.type in PATHS or action.type in HOSTILE


def drawn(action: argparse.Action, afile: Path):
    if isinstance(action, ZERO_ARG):
        return WORDS
    if action.choices is not None:
        return WORDS.filter(lambda w: w not in action.choices)
    if action.type in PATHS:
        return WORDS.map(lambda w: str(afile / w))
    return HOSTILE[action.type][0]


def argv(path: tuple[str, ...], action: argparse.Action, value: str | None) -> list[str]:
    flag = action.option_strings[-1]
    if value is None:
        return [*path, flag]
    return [*path, f"{flag}={value}"]  # joined: a value that starts with '-' is the flag's, never read as a flag


def one_line_refusal(capsys, line: list[str], flag: str) -> str | None:
    """What is wrong with the CLI's answer to `line` (None: one line naming `flag`, exit 2, no traceback)."""
    try:
        code = main(line)
    except SystemExit as e:  # argparse's own exit: never expected, Parser turns its errors into one line
        return f"{line}: SystemExit {e.code}"
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    if code != 2 or len(lines) != 1 or "Traceback" in err:
        return f"{line}: exit {code}, stderr {err!r}"
    if flag not in lines[0]:
        return f"{line}: the line does not name {flag}: {lines[0]!r}"
    return None


@pytest.fixture
def walk_here(tmp_path, monkeypatch) -> Path:
    """An empty folder to stand in (no models/ built, nothing to overwrite), a file in it, and the walked parser."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(harness.cli, "build_parser", lambda: PARSER)
    (tmp_path / "afile").write_text("kept")
    return tmp_path / "afile"


def test_every_flag_has_a_hostile_value_or_is_free_text():
    """A flag of a type this walk does not know fails here: name what its type refuses in HOSTILE."""
    unknown = sorted({f"{' '.join(p)} {a.option_strings[-1]}: {a.type!r}" for p, a in FLAGS
                      if a.choices is None and not isinstance(a, ZERO_ARG)
                      and a.type not in HOSTILE and a.type not in PATHS and a.type not in FREE})
    assert not unknown, unknown
    assert len(FLAGS) > 150 and {p for p, _ in FLAGS} >= {("bench",), ("workload", "trace"), ("simulate",)}


def test_every_flag_refuses_its_fixed_hostile_values_in_one_line(walk_here, capsys):
    wrong = []
    for path, action in FLAGS:
        for value in fixed_values(action, walk_here):
            if why := one_line_refusal(capsys, argv(path, action, value), action.option_strings[-1]):
                wrong.append(why)
    assert not wrong, "\n".join(wrong)
    assert walk_here.read_text() == "kept" and sorted(p.name for p in walk_here.parent.iterdir()) == ["afile"]


def test_drawn_hostile_values_are_refused_in_one_line(walk_here, capsys):
    walked = [(p, a) for p, a in FLAGS if walkable(a)]

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much])
    @given(data=st.data())
    def walk(data):
        path, action = data.draw(st.sampled_from(walked), label="flag")
        value = data.draw(drawn(action, walk_here), label="value")
        assert (why := one_line_refusal(capsys, argv(path, action, value), action.option_strings[-1])) is None, why

    walk()
    assert walk_here.read_text() == "kept" and sorted(p.name for p in walk_here.parent.iterdir()) == ["afile"]

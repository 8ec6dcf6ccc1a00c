"""The README's CLI synopses name every flag each verb takes (issue 81 found `ab` and `plan` missing some): a flag
added to a verb and not to its synopsis fails here."""

import argparse
import re

from harness.cli import build_parser
from tests.conftest import ROOT


def synopses() -> dict[str, str]:
    """The README's CLI block, cut at each `fragbench VERB` line: verb -> its lines."""
    text = (ROOT / "README.md").read_text()
    cli = text[text.index("## CLI"):]
    cli = cli[cli.index("```") + 3:]
    cli = cli[:cli.index("```")]
    out: dict[str, str] = {}
    verb = None
    for line in cli.splitlines():
        if m := re.match(r"fragbench (\S+)", line):
            verb = m.group(1)
        if verb:
            out[verb] = out.get(verb, "") + line + "\n"
    return out


def flags(parser: argparse.ArgumentParser) -> set[str]:
    """Every long flag of a parser and of its sub-verbs (`model build`, `allocator replay`)."""
    found = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= flags(sub)
        found |= {s for s in action.option_strings if s.startswith("--") and s != "--help"}
    return found


def test_every_verbs_synopsis_names_every_flag_it_takes():
    verbs = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    written = synopses()
    missing = {verb: sorted(f for f in flags(p) if not re.search(re.escape(f) + r"(?![a-z-])", written.get(verb, "")))
               for verb, p in verbs.items()}
    assert not {v: m for v, m in missing.items() if m}, missing

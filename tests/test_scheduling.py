"""make test's dealing of the suite to its workers (tests/scheduling.py): every session-scoped fixture the tests
define is either built on one worker (its users' files dealt out together) or named as cheap enough to build on
each, and the files named for a build are exactly those whose tests use it. What the tests use is read from
pytest's own collection of the whole suite: this session's where it collected every test file (kept before -k or
-m deselect any), else one in a process of its own: the answer does not depend on which tests this session runs
(alone, with -k, or on one worker of several)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.helpers import scaled
from tests.scheduling import (
    APART,
    GROUP_OF,
    PER_WORKER,
    SECONDS,
    SECONDS_PER_TEST,
    SHARED_BUILDS,
    SLOW_S,
    WHOLE_SUITE,
    group_of,
    longest,
)

# A pytest plugin for the collecting process: each collected test's rows (tests/scheduling.collection_rows),
# written where FRAGBENCH_FIXTURE_USERS says.
PLUGIN = '''
import json, os

from tests.scheduling import collection_rows


def pytest_collection_finish(session):
    with open(os.environ["FRAGBENCH_FIXTURE_USERS"], "w") as f:
        json.dump(collection_rows(session.items), f)
'''


def session_fixtures(folder: Path) -> dict[str, str]:
    """Every fixture defined with scope="session" in the test files (conftest too): name -> the file."""
    out = {}
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for deco in node.decorator_list:
                if isinstance(deco, ast.Call) and ast.unparse(deco.func) in ("pytest.fixture", "fixture") and any(
                        k.arg == "scope" and isinstance(k.value, ast.Constant) and k.value.value == "session"
                        for k in deco.keywords):
                    out[node.name] = path.name
    return out


@pytest.fixture(scope="module")
def collected(request, tmp_path_factory) -> list[tuple[str, str, list[str], list[str], bool]]:
    """Each test of the whole suite, as pytest collects it: (file, test, its fixtures, those scoped to its
    module, whether it is marked slow). This session's collection where it was the whole suite's (make test's and
    make test-all's, on each worker: conftest keeps it before any deselection, make test's `-m 'not slow'`
    included), else a collection in a process of its own."""
    whole = request.config.stash.get(WHOLE_SUITE, None)
    if whole is not None:
        return [(file, name, list(fixtures), list(module), slow) for file, name, fixtures, module, slow in whole]
    folder = tmp_path_factory.mktemp("collect")
    (folder / "fixture_users_plugin.py").write_text(PLUGIN)
    out = folder / "users.json"
    env = dict(os.environ, FRAGBENCH_FIXTURE_USERS=str(out),
               PYTHONPATH=os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "-p", "no:xdist", "-p", "fixture_users_plugin", str(ROOT / "tests")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=scaled(600))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    return [tuple(row) for row in json.loads(out.read_text())]


def test_a_whole_suites_collection_is_kept_and_a_partial_one_is_not(request, collected):
    whole = request.config.stash.get(WHOLE_SUITE, None)
    files = {file for file, *_ in collected}
    assert files == {p.name for p in (ROOT / "tests").glob("test_*.py")}
    assert whole is None or len(whole) == len(collected)  # kept before -k: every test, this one's file or not


@pytest.fixture(scope="module")
def users(collected) -> dict[str, set[str]]:
    """fixture -> the test files whose collected tests use it, from a collection of the whole suite."""
    found: dict[str, set[str]] = {}
    for file, _, fixtures, *_ in collected:
        for name in fixtures:
            found.setdefault(name, set()).add(file)
    return found


def test_every_session_fixture_is_built_once_or_named_cheap_enough_to_build_on_each_worker():
    defined = session_fixtures(ROOT / "tests")
    assert {"swept", "servers", "tiny_model"} <= set(defined), defined  # the reading finds the ones known
    assert set(SHARED_BUILDS) | set(PER_WORKER) == set(defined), (
        "a session fixture is in SHARED_BUILDS or PER_WORKER (tests/scheduling.py), and only those: "
        f"{sorted(set(defined) ^ (set(SHARED_BUILDS) | set(PER_WORKER)))}")
    assert not set(SHARED_BUILDS) & set(PER_WORKER)


def test_the_files_that_share_a_session_build_are_dealt_out_together(users):
    """The files named for a build are exactly its users in the whole suite, and each file is in one unit."""
    for fixture, named in SHARED_BUILDS.items():
        assert users.get(fixture, set()) == set(named), (fixture, sorted(users.get(fixture, set()) ^ set(named)))
    every = [name for named in SHARED_BUILDS.values() for name in named]
    assert len(every) == len(set(every)), f"a file in two builds' units: {sorted(every)}"
    for fixture, named in SHARED_BUILDS.items():
        assert {group_of(f"tests/{name}::test_x[a::b]") for name in named} == {fixture}
    assert group_of("tests/test_knee.py::t") == "tests/test_knee.py"


def test_a_test_dealt_out_apart_from_its_file_needs_nothing_built_there(collected):
    """An APART test uses no shared build (else the build is made twice) and no fixture of its module (else that is
    built twice), and is its own unit with its parameters together."""
    for test in sorted(APART):
        file, name = test.split("::")
        rows = [(fixtures, module) for f, n, fixtures, module, _ in collected if (f, n) == (file, name)]
        assert rows, f"{test}: no such test"
        for fixtures, module in rows:
            assert not set(fixtures) & set(SHARED_BUILDS) and not module, (test, fixtures, module)
        assert group_of(f"tests/{test}[a::b]") == group_of(f"tests/{test}") == f"tests/{test}"
    assert group_of("tests/test_verdict.py::test_other") == "swept"


def test_a_test_marked_slow_is_of_a_unit_measured_long_and_shares_no_build_with_make_tests(collected):
    """make test leaves out the tests marked `slow` (make test-all runs them with the rest): each is of a unit
    measured over SLOW_S (SECONDS), and a build (a session's in SHARED_BUILDS, a fixture of a module) is used by
    slow tests alone or by none, so that what the mark leaves out of make test is the build itself, not a few of
    its readers while make test still makes it."""
    marked = [(file, name) for file, name, *_, slow in collected if slow]
    assert ("test_setup.py", "test_make_wheels_fills_a_folder_that_make_setup_installs_from_with_the_network_off") \
        in marked  # the reading finds the marks known
    for file, name in marked:
        unit = group_of(f"tests/{file}::{name}").rsplit("/", 1)[-1]
        assert SECONDS.get(unit, 0) > SLOW_S, f"{file}::{name} is marked slow, but its unit {unit} is not measured " \
                                              f"over {SLOW_S} s (tests/scheduling.py's SECONDS)"
    flags: dict[str, set[bool]] = {}
    for file, _, fixtures, module, slow in collected:
        for build in [*(set(fixtures) & set(SHARED_BUILDS)), *(f"{file}::{m}" for m in module)]:
            flags.setdefault(build, set()).add(slow)
    assert not [build for build, marks in flags.items() if len(marks) > 1], \
        f"builds used by slow tests and by others: {sorted(b for b, m in flags.items() if len(m) > 1)}"


def test_every_unit_measured_long_is_one_the_suite_has(collected):
    files = {file for file, *_ in collected}
    for unit in SECONDS:
        assert unit in SHARED_BUILDS or unit in APART or (unit in files and unit not in GROUP_OF), unit


def test_the_longest_unit_is_dealt_out_first_measured_or_by_its_count_of_tests():
    slow, seconds = max(SECONDS.items(), key=lambda kv: kv[1])
    many = int(seconds / SECONDS_PER_TEST) + 1  # a unit of more tests than the slowest's seconds would take
    unit = slow if slow in SHARED_BUILDS else f"tests/{slow}"
    assert longest({"tests/test_a.py": dict.fromkeys(range(many - 2)), unit: {"t": False}}) == unit
    assert longest({unit: {"t": False}, "tests/test_b.py": dict.fromkeys(range(many))}) == "tests/test_b.py"
    assert longest({"tests/test_a.py": {1: 0, 2: 0}, "tests/test_b.py": {1: 0, 2: 0}}) == "tests/test_a.py"


def test_the_session_fixtures_read_off_a_file(tmp_path):
    (tmp_path / "test_t.py").write_text('''
import pytest

@pytest.fixture(scope="session")
def built(tmp_path_factory): ...

@pytest.fixture(scope="module")
def mine(): ...

@pytest.fixture
def each(): ...
''')
    assert session_fixtures(tmp_path) == {"built": "test_t.py"}
    assert session_fixtures(ROOT / "tests")["tiny_model"] == "conftest.py"

"""make test's dealing of the suite to its workers (tests/scheduling.py): every session-scoped fixture the tests
define is either built on one worker (its users' files dealt out together) or named as cheap enough to build on
each, and the files named for a build are exactly those whose tests use it. What the tests use is read from
pytest's own collection of the whole suite, in a process of its own: the answer does not depend on which tests
this session collected (run alone, with -k, or on one worker of several)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.scheduling import PER_WORKER, SHARED_BUILDS, group_of

# A pytest plugin for the collecting process: each collected test's file and the fixtures it uses (its closure:
# those its fixtures use too), written where FRAGBENCH_FIXTURE_USERS says.
PLUGIN = '''
import json, os


def pytest_collection_finish(session):
    with open(os.environ["FRAGBENCH_FIXTURE_USERS"], "w") as f:
        json.dump([[item.path.name, sorted(item.fixturenames)] for item in session.items], f)
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
def users(tmp_path_factory) -> dict[str, set[str]]:
    """fixture -> the test files whose collected tests use it, from a collection of the whole suite."""
    folder = tmp_path_factory.mktemp("collect")
    (folder / "fixture_users_plugin.py").write_text(PLUGIN)
    out = folder / "users.json"
    env = dict(os.environ, FRAGBENCH_FIXTURE_USERS=str(out),
               PYTHONPATH=os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "-p", "no:xdist", "-p", "fixture_users_plugin", str(ROOT / "tests")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    found: dict[str, set[str]] = {}
    for file, fixtures in json.loads(out.read_text()):
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

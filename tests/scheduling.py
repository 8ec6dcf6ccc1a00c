"""How `make test` deals the suite out to pytest-xdist's workers: a file at a time (as `--dist loadfile`), except
that the files sharing one session-scoped build are dealt out together, so that the build is made once.

A session fixture is built once per worker: with loadfile alone, the session's sweep (conftest.swept, two minutes)
was built on both workers, and each worker started its own server per engine. xdist's own `--dist loadgroup` would
do this from `xdist_group` marks, but xdist 3.8 cannot name a group's tests under pytest 9.2 (the nodeid suffix it
adds is lost), so the groups are named here, by file, and `tests/test_scheduling.py` checks them against the
fixtures the tests of the whole suite use, as pytest collects them."""

from __future__ import annotations

from xdist.scheduler import LoadFileScheduling

# fixture -> the test files whose tests use it (directly or through another fixture)
SHARED_BUILDS: dict[str, tuple[str, ...]] = {
    "swept": ("test_capacity.py", "test_fragmentation.py", "test_twin.py", "test_verdict.py"),
    "servers": ("test_bad_input.py", "test_check.py", "test_openai_api.py", "test_reliability.py", "test_server.py"),
}
# session fixtures built on each worker that uses them, and why that is cheap enough (tests/test_scheduling.py
# checks that every session fixture of the tests is here or in SHARED_BUILDS)
PER_WORKER: dict[str, str] = {
    "tiny_model": "seconds (19 s measured on the shared 2-core machine), 18 MiB of seeded weights: each worker's "
                  "are the same, and the worker without the shared builds needs them for its own tests",
}
GROUP_OF = {name: fixture for fixture, names in SHARED_BUILDS.items() for name in names}


def group_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its shared build's name, or else its file."""
    path = nodeid.split("::", 1)[0]
    return GROUP_OF.get(path.rsplit("/", 1)[-1], path)


class SharedBuildScheduling(LoadFileScheduling):
    """loadfile, with a shared build's files as one unit of work. (xdist deals the units out by test count,
    largest first: a shared build's unit, several files' tests, goes out among the first.)"""

    def _split_scope(self, nodeid: str) -> str:
        return group_of(nodeid)

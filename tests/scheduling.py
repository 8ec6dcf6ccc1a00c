"""How `make test` and `make test-all` deal the suite out to pytest-xdist's workers: a file at a time (as `--dist
loadfile`), except that the files sharing one session-scoped build are dealt out together, so that the build is
made once, and that a long test that needs nothing built for its file (APART) is dealt out alone, to run beside
it. The units measured long go out first, the longest first.

A session fixture is built once per worker: with loadfile alone, the session's sweep (conftest.swept, two minutes)
was built on both workers, and each worker started its own server per engine. xdist's own `--dist loadgroup` would
do this from `xdist_group` marks, but xdist 3.8 cannot name a group's tests under pytest 9.2 (the nodeid suffix it
adds is lost), so the groups are named here, by file, and `tests/test_scheduling.py` checks them against the
fixtures the tests of the whole suite use, as pytest collects them."""

from __future__ import annotations

import pytest
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

# Tests that use neither a shared build nor a module fixture (tests/test_scheduling.py checks both), each long
# enough to be a unit of its own: in their file's unit they ran after one another on one worker, where now the other
# worker takes its share of them. Most are of the shared builds' units, the suite's longest two (the sweep's 657 s
# and the servers' 588 s measured on the loaded machine, 324 s and 179 s of them these tests').
APART: frozenset[str] = frozenset({
    "test_verdict.py::test_the_consoles_last_decision_line_is_summary_jsons_headline",  # a 110 s bench and more
    "test_capacity.py::test_a_bench_killed_during_a_sweep_reports_the_points_it_finished",  # a sweep, killed
    "test_capacity.py::test_simulated_sweep_reproduces_the_papers_ratios",  # Llama-2-13B's sweep simulated
    "test_capacity.py::test_a_sweep_in_parallel_gives_the_same_json_as_in_series",  # two simulated sweeps
    "test_reliability.py::test_sigkilled_engine_is_restarted_and_its_requests_are_crashed",  # a start, a bench, killed
    "test_bad_input.py::test_bench_restarts_an_engine_that_failed_and_records_the_crash",  # a bench that fails
    "test_bad_input.py::test_sigterm_to_bench_mid_run_leaves_no_child",  # a bench, stopped
    "test_reliability.py::test_api_key_is_required_when_set",  # a server of its own
    "test_bad_input.py::test_a_budget_off_the_allocator_granule_starts_and_serves",  # a server of its own
    "test_check.py::test_closed_port_exits_2_with_one_line",  # check's start-up, against nothing
    "test_bench.py::test_kill_9_mid_run_leaves_a_partial_run_that_reports",  # a bench, killed
    "test_bench.py::test_compare_gates_the_sustained_rate_on_its_intervals_and_not_the_pooled_figures",  # 4 compares
    "test_bench.py::test_compare_does_not_gate_a_sustained_rate_that_is_a_bound",  # 2 compares
    # a folder of wheels filled from the registry, then a set-up from it offline: the network and the disk more than
    # the cores, so it starts early beside the benches rather than last in its file's unit
    "test_setup.py::test_make_wheels_fills_a_folder_that_make_setup_installs_from_with_the_network_off",
    # make test-all's (marked slow), apart from their files' tests of seconds, which make test runs
    "test_targets.py::test_a_target_is_one_more_engine_of_the_run",  # a bench sweep beside a --target
    "test_registry.py::test_a_throwaway_policy_added_through_the_table_alone_is_served_and_swept",  # a bench sweep
})

# The units measured long (seconds, whole unit, `pytest --durations=0` on the shared 2-core machine; those of
# test_gpu_dryrun, test_simulate, test_ab, test_workloads, test_cli_refusals, test_kneefit, test_knee_study and
# test_engines from a suite run under a load of 11 on the 2 cores, 3,632 s of pytest, divided by 3.6, its ratio to
# the 1,000 s of make test's pytest on the shared machine: dealing needs only their order), dealt out
# before the rest, the longest first: xdist deals units out by their count of tests, and a long unit of few tests
# went last, one worker running it while the other had nothing left. A unit not named here counts
# SECONDS_PER_TEST a test. Keys: a shared build's fixture, a file, or an APART test.
SECONDS: dict[str, float] = {
    "swept": 310,  # the sweep (conftest.swept), the twin's simulation, the rest reads it
    "servers": 410,  # a server per engine (two sets), check's measurements on them, requests, fuzzed bodies
    "test_verdict.py::test_the_consoles_last_decision_line_is_summary_jsons_headline": 153,
    "test_capacity.py::test_simulated_sweep_reproduces_the_papers_ratios": 88,
    "test_capacity.py::test_a_bench_killed_during_a_sweep_reports_the_points_it_finished": 64,
    "test_capacity.py::test_a_sweep_in_parallel_gives_the_same_json_as_in_series": 19,
    "test_reliability.py::test_sigkilled_engine_is_restarted_and_its_requests_are_crashed": 75,
    "test_bad_input.py::test_bench_restarts_an_engine_that_failed_and_records_the_crash": 35,
    "test_bad_input.py::test_sigterm_to_bench_mid_run_leaves_no_child": 26,
    "test_reliability.py::test_api_key_is_required_when_set": 16,
    "test_bad_input.py::test_a_budget_off_the_allocator_granule_starts_and_serves": 14,
    "test_check.py::test_closed_port_exits_2_with_one_line": 13,
    "test_bench.py": 170,  # its bench of three engines (the module's run), read by four tests
    "test_bench.py::test_kill_9_mid_run_leaves_a_partial_run_that_reports": 51,
    "test_bench.py::test_compare_gates_the_sustained_rate_on_its_intervals_and_not_the_pooled_figures": 36,
    "test_bench.py::test_compare_does_not_gate_a_sustained_rate_that_is_a_bound": 34,
    "test_prometheus_e2e.py": 97,  # one test: Prometheus scraping two churning servers until the alert fires
    "test_distributed_load.py": 81,  # a Locust master and two workers against a server
    "test_knee_study.py": 136,  # the knee study's runs
    "test_simulate_grid.py": 217,  # grids serial, in a pool, resumed, on a local Ray and on a two-node cluster
    "test_targets.py": 25,  # metrics pages, refusals, a target that stops answering
    "test_targets.py::test_a_target_is_one_more_engine_of_the_run": 140,  # of the file's 161 s
    "test_allocator_results.py": 155,  # a bench on the caching allocator (the module's run, 129 s)
    "test_registry.py": 20,  # a throwaway peer's server, the table's lists
    "test_registry.py::test_a_throwaway_policy_added_through_the_table_alone_is_served_and_swept": 121,
    "test_engines.py": 157,  # each engine's tokens against transformers' generate, parallel samples
    "test_integrity.py": 80,  # a churn with a block freed early, and one without
    "test_operating.py": 16,
    "test_gpu_dryrun.py": 240,  # every engine on fake CUDA, the 70B shapes' forwards on the CPU
    "test_simulate.py": 153,  # the simulator's recorded JSONs, the paper's figure
    "test_ab.py": 122,  # fragbench ab's builds and pairs
    "test_workloads.py": 114,  # presets' traces, mooncake's hashes, a cancel storm against a server
    "test_cli_refusals.py": 74,
    "test_kneefit.py": 61,
    "test_setup.py": 15,  # make -n, a dozen times
    # 127 to 155 s in the last five suites with bytecode; without, 182 s in a suite on a machine loaded by other
    # work (where the other units took 1.3 to 2 times their figures here), 67 to 126 s alone (190 s with bytecode)
    "test_setup.py::test_make_wheels_fills_a_folder_that_make_setup_installs_from_with_the_network_off": 130,
}
SECONDS_PER_TEST = 0.5
# make test leaves out the tests marked `slow` (make test-all runs them with the rest; the Makefile says why): a
# test may carry the mark only where its unit is measured over SLOW_S here, and the build it makes or reads (a
# folder of wheels and a set-up from it, a bench sweep, a whole bench) is made by no test left in make test
# (tests/test_scheduling.py checks both). SLOW_S: a sixth of make test's budget (600 s on 3 workers); a unit over
# it made of tests of seconds each (the servers', the Ray grids') stays in make test.
SLOW_S = 100


# this session's collection_rows where it collected the whole suite (tests/conftest.py keeps them)
WHOLE_SUITE = pytest.StashKey[list]()


def collection_rows(items) -> list[tuple[str, str, list[str], list[str], bool]]:
    """What tests/test_scheduling.py checks the units against, for each collected test: its file, its name (without
    parameters), the fixtures it uses (its closure: those its fixtures use too), those of them scoped to its
    module, and whether it is marked `slow` (make test-all's alone)."""
    def module_scoped(item) -> list[str]:
        return sorted(name for name, defs in item._fixtureinfo.name2fixturedefs.items() if defs[-1].scope == "module")

    return [(item.path.name, item.originalname, sorted(item.fixturenames), module_scoped(item),
             item.get_closest_marker("slow") is not None) for item in items]


def group_of(nodeid: str) -> str:
    """The unit of work a test belongs to: an APART test's own (its parameters together), its shared build's
    name, or else its file."""
    path, _, name = nodeid.partition("::")
    file = path.rsplit("/", 1)[-1]
    test = f"{file}::{name.split('[', 1)[0]}"
    if test in APART:
        return f"{path}::{name.split('[', 1)[0]}"
    return GROUP_OF.get(file, path)


def expected_s(unit: str, tests: int) -> float:
    """How long a unit runs: as measured (SECONDS), or its tests at SECONDS_PER_TEST each."""
    return SECONDS.get(unit.rsplit("/", 1)[-1], tests * SECONDS_PER_TEST)


def longest(queue: dict[str, dict]) -> str:
    """The unit of the queue (unit -> its tests) expected to run longest; on a tie the first in the queue (xdist's
    order: most tests first)."""
    return max(queue, key=lambda unit: expected_s(unit, len(queue[unit])))


class SharedBuildScheduling(LoadFileScheduling):
    """loadfile, with a shared build's files as one unit of work and each APART test as one, dealt out longest
    first (expected_s)."""

    def _split_scope(self, nodeid: str) -> str:
        return group_of(nodeid)

    def _assign_work_unit(self, node) -> None:
        self.workqueue.move_to_end(longest(self.workqueue), last=False)  # xdist deals out the queue's first
        super()._assign_work_unit(node)

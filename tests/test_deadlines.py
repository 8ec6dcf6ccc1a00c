"""The suite's bounds follow the machine (tests/helpers.slowness, tests/conftest.scale_timeouts): a busy or slower
machine gets longer to reach the same events, never a shorter bound than the developers' quiet one, and a hang is
still failed (the factor has a ceiling)."""

from __future__ import annotations

import pytest

import harness.run.speed_probes as speed_probes
from tests.conftest import BUILD_S
from tests.helpers import REFERENCE_INTERPRETER_S, SLOWNESS_MAX, measured_slowness, scaled, slowness


@pytest.mark.parametrize(("loop_s", "factor"), [(3 * REFERENCE_INTERPRETER_S, 3.0),  # three times slower: x3
                                                  (REFERENCE_INTERPRETER_S / 2, 1.0),  # faster: never shorter
                                                  (1000 * REFERENCE_INTERPRETER_S, SLOWNESS_MAX)])  # a ceiling
def test_slowness_is_the_interpreter_probe_over_the_developers_machine(monkeypatch, loop_s, factor):
    monkeypatch.delenv("FRAGBENCH_TEST_SLOWNESS", raising=False)
    monkeypatch.setattr(speed_probes, "interpreter_once", lambda: loop_s)
    assert measured_slowness() == pytest.approx(factor)


def test_the_median_reading_counts_not_the_fastest(monkeypatch):
    """A busy machine's loop is slow most of the time and fast now and then: the bound follows the usual reading."""
    readings = iter([REFERENCE_INTERPRETER_S] * 2 + [4 * REFERENCE_INTERPRETER_S] * 7)
    monkeypatch.delenv("FRAGBENCH_TEST_SLOWNESS", raising=False)
    monkeypatch.setattr(speed_probes, "interpreter_once", lambda: next(readings))
    assert measured_slowness() == pytest.approx(4.0)


def test_a_slowness_set_in_the_environment_is_taken_within_the_bounds(monkeypatch):
    monkeypatch.setattr(speed_probes, "interpreter_once", lambda: pytest.fail("measured where it was set"))
    for value, factor in (("2.5", 2.5), ("0.1", 1.0), ("1e6", SLOWNESS_MAX)):
        monkeypatch.setenv("FRAGBENCH_TEST_SLOWNESS", value)
        assert measured_slowness() == factor


def configured_timeout(config) -> float:
    given = config.getoption("timeout", None)
    return float(given if given is not None else config.getini("timeout"))


def timeout_is(request, extra_s: float = 0.0) -> None:
    """The test's pytest-timeout bound is the configured one plus `extra_s`, times the machine's slowness; none where
    the bounds are switched off (--timeout=0, a debugging session)."""
    mark, configured = request.node.get_closest_marker("timeout"), configured_timeout(request.config)
    if configured == 0:
        assert mark is None
    else:
        assert mark is not None and mark.args[0] == pytest.approx((configured + extra_s) * slowness())


def test_a_tests_timeout_is_the_configured_bound_scaled_to_the_machine(request):
    timeout_is(request)
    assert scaled(10) == pytest.approx(10 * slowness()) and scaled(10) >= 10


@pytest.fixture(scope="module")
def build() -> str:
    return "a module's build: the first test that uses it pays for it inside its own timeout"


def test_a_test_using_a_module_build_has_the_builds_bound_too(request, build):
    timeout_is(request, BUILD_S)


@pytest.mark.timeout(42)
def test_a_tests_own_timeout_mark_is_scaled_too(request):
    assert request.node.get_closest_marker("timeout").args[0] == pytest.approx(42 * slowness())

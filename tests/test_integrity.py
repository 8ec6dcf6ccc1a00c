"""The KV-integrity check: probes against their idle answers, a near tie told from a wrong token, and a
planted fault (a paged engine that frees a live block early) found under churn while a sound engine shows none."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest

from harness.analysis.integrity import IdleFigures, Served, compare, integrity, sentence, tolerance_of
from harness.analysis.summary_records import Integrity as Judged
from harness.run.integrity_probes import IntegrityProbes
from harness.run.loadargs import LoadArgs, run_loadgen
from harness.run.servers import start_server
from harness.run.stats_poller import fetch_stats
from tests.helpers import scaled

IDLE = Served(["a", "b", "c"], [-0.5, -1.0, -2.0], [{"a": -0.5, "x": -3.0}, {"b": -1.0, "y": -1.004},
                                                  {"c": -2.0, "z": -4.0}])


def test_a_logprob_past_the_tolerance_diverges_where_it_moved():
    got = Served(["a", "b", "c"], [-0.5, -1.0, -2.5], [])
    c = compare(IDLE, got, 1e-2)
    assert c.diverged_at == 2 and "logprob" in c.why and c.max_abs_logprob_diff == pytest.approx(0.5)
    assert compare(IDLE, Served(["a", "b", "c"], [-0.5, -1.001, -2.0], []), 1e-2).diverged_at is None


def test_a_flip_between_tied_tokens_is_a_tie_and_a_flip_past_the_margin_diverges():
    tie = compare(IDLE, Served(["a", "y", "q"], [-0.5, -1.004, -9.0], []), 1e-2)
    assert tie.diverged_at is None and tie.tie_at == 1 and tie.compared == 1
    wrong = compare(IDLE, Served(["x", "b", "c"], [-3.0, -1.0, -2.0], []), 1e-2)
    assert wrong.diverged_at == 0 and "idle margin 2.5" in wrong.why


def test_an_answer_the_engine_cut_short_is_an_early_end_and_a_short_one_it_called_complete_diverges():
    """An OOM rejection (finish_reason "oom") serves fewer tokens by design: a failure to serve, counted apart,
    its tokens up to there compared; an answer that ends early and calls itself complete is wrong."""
    oom = compare(IDLE, Served(["a"], [-0.5], [], finish_reason="oom"), 1e-2)
    assert oom.diverged_at is None and oom.ended == "oom" and oom.compared == 1
    bad = compare(IDLE, Served(["a", "b"], [-0.5, -1.0], [], finish_reason="length"), 1e-2)
    assert bad.diverged_at == 2 and "2 tokens where alone it made 3" in bad.why
    rows = [{"probe": "p1", "kind": "short", "compared": 1, "max_abs_logprob_diff": 0.0, "ended": "oom"}]
    result = integrity(IdleFigures(tolerance=1e-2), rows)
    assert result["diverged"] == 0 and result["ended_early"] == 1
    assert "1 ended early" in sentence(Judged.model_validate(result))


def test_the_tolerance_follows_the_precision():
    assert tolerance_of("float32") == 1e-3 and tolerance_of("torch.bfloat16") == tolerance_of("float16") == 0.25


def test_the_summary_names_each_divergence():
    rows = [{"probe": "p1", "kind": "short", "compared": 3, "max_abs_logprob_diff": 0.0},
            {"probe": "p2", "kind": "long", "compared": 2, "max_abs_logprob_diff": 0.7, "diverged_at": 1,
             "why": "logprob -2 where alone it was -1.3", "preempted_total_during": 2, "running": 5, "waiting": 1},
            {"probe": "p3", "kind": "short", "error": "HTTP 503"}]
    r = integrity(IdleFigures(tolerance=1e-2, idle_max_abs_logprob_diff=0.0), rows)
    assert (r["probes"], r["diverged"], r["failed"], r["max_abs_logprob_diff"]) == (2, 1, 1, 0.7)
    line = sentence(Judged.model_validate(r))
    assert "p2 (long) at output token 1" in line and "2 preemptions" in line


def tail(log) -> str:
    return log.read_text()[-1500:] if log.exists() else "(no log)"


def churned(url: str, out) -> tuple[dict, list[dict]]:
    """Probes served alone, then into a saturating churn of the mixed workload; the check's result and its rows.
    The probes start once the churn runs (a sequence besides theirs in the engine): the load generator takes
    seconds to start on a busy machine, and probes sent before it would meet an idle engine, whose freed block
    nobody takes. The load generator runs in a thread: what it returned or raised is checked, and a load that
    ends, or never reaches the engine, before a request of it runs fails here (never probes of an idle engine)."""
    check = IntegrityProbes(url, 512, "float32", state=lambda: fetch_stats(url), gap_s=0.0)
    check.idle()
    assert len(check.reference) == len(check.probes)
    # the probes run one after another for as long as the churn does: 10 s on the developers' quiet machine, scaled
    # to this one, so that a slower machine still serves the probes the test counts (a probe under churn takes the
    # machine's time)
    load = LoadArgs(target=url, workload="mixed-churn", out=out, duration_s=scaled(10), max_seq_len=512, rate=6.0,
                    grace_s=5)
    log, outcome = out.with_suffix(".log"), {}

    def generate() -> None:
        try:
            with open(log, "w") as f:
                outcome["exit"] = run_loadgen(load, stdout=f, stderr=subprocess.STDOUT)
        except Exception as e:  # reported by the test, not lost with the thread
            outcome["raised"] = repr(e)

    loader = threading.Thread(target=generate, daemon=True)
    loader.start()
    bound_s = scaled(120)  # a bound on the start (the machine's), failed loudly: the test waits for the churn itself
    deadline = time.monotonic() + bound_s
    while not getattr(fetch_stats(url), "running", None):
        assert loader.is_alive(), f"the load ended before a request of it ran: {outcome}\n{tail(log)}"
        assert time.monotonic() < deadline, f"no request of the load running after {bound_s:.0f} s\n{tail(log)}"
        time.sleep(0.1)
    with check:
        loader.join()
    assert outcome == {"exit": 0}, f"the load generator: {outcome}\n{tail(log)}"
    return check.result(), check.rows


@pytest.mark.parametrize("fault", [True, False])
def test_a_block_freed_early_is_found_under_churn_and_a_sound_pool_shows_none(tiny_model, tmp_path, fault):
    extra = ["--max-seq-len", "512", *(["--inject-kv-fault", "early-free"] if fault else [])]
    with start_server("paged", str(tiny_model), "4MiB", tmp_path / "s.log", extra=extra) as srv:
        result, rows = churned(srv.url, tmp_path / "load")
    assert result["probes"] >= 4, result
    if fault:
        assert result["diverged"] > 0, result
        d = result["divergences"][0]
        assert d["probe"] and d["diverged_at"] is not None and d["why"] and d["doing"]
    else:
        assert result["diverged"] == 0 and result["max_abs_logprob_diff"] <= 1e-3, result
        # it ran through the churn: a probe preempted (only other sequences crowding the pool do that; a prefix
        # hit does not tell, the idle servings cached the probes' own prompts), others in the engine at its end
        assert result["preempted_probes"] > 0, rows
        assert any(r.get("running", 0) + r.get("waiting", 0) > 0 for r in rows if "compared" in r), rows

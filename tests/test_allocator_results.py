"""The caching allocator's figures in a run's results: samples columns, summary.json's engines.<e>.allocator,
OOM events by layer (harness/analysis/allocator_summary.py, harness/run/stats_poller.py)."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pandas as pd
import pytest

from engines.api.stats import StatsPayload
from engines.memory.arena import OutOfMemory
from engines.memory.caching_memory import CachingMemory, size_class
from engines.memory.snapshot import read_snapshot
from harness.analysis.allocator_summary import COLUMNS, allocator_block, counter_total
from harness.analysis.summary_records import Summary
from harness.results import SAMPLE_COLUMNS
from harness.run.stats_poller import allocator_fields
from harness.views.allocator_section import layer_cell, oom_layers, reserved_unallocated
from tests.conftest import run_cli

MiB = 2**20
CONTRACT = {"allocated_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes", "segments", "alloc_retries"}


def samples(rows: list[tuple[float, int, int, int]], cap: int = 16 * MiB) -> pd.DataFrame:
    """(t_s, allocated, reserved, retries) rows, the other figures derived."""
    return pd.DataFrame([{"engine": "e", "t_s": t, "kv_capacity_bytes": cap, "alloc_allocated_bytes": a,
                          "alloc_reserved_bytes": r, "alloc_active_bytes": a, "alloc_inactive_split_bytes": r - a,
                          "alloc_segments": r // (2 * MiB), "alloc_retries": n} for t, a, r, n in rows])


def test_every_block_figure_has_its_samples_column():
    assert set(COLUMNS) == CONTRACT
    assert set(COLUMNS.values()) <= set(SAMPLE_COLUMNS)


def test_the_sampler_reads_the_stats_allocator_block_and_leaves_it_null_without_one():
    stats = StatsPayload.model_validate({"allocator": {"allocated_bytes": 1, "reserved_bytes": 2, "active_bytes": 3,
                                                       "inactive_split_bytes": 4, "segments": 5, "alloc_retries": 6}})
    assert allocator_fields(stats.allocator) == {
        "alloc_allocated_bytes": 1, "alloc_reserved_bytes": 2, "alloc_active_bytes": 3, "alloc_inactive_split_bytes": 4,
        "alloc_segments": 5, "alloc_retries": 6, "alloc_small_requests": None, "alloc_large_requests": None,
        "alloc_huge_requests": None}
    assert set(allocator_fields(StatsPayload.model_validate({"allocator": None}).allocator).values()) == {None}
    assert set(allocator_fields(StatsPayload().allocator).values()) == {None}


def test_the_block_takes_the_last_sample_the_peaks_and_the_reserved_unallocated_share():
    smp = samples([(0.2, 4 * MiB, 8 * MiB, 0), (0.1, 0, 0, 0), (0.3, 0, 8 * MiB, 1)])  # out of order on purpose
    block = allocator_block(smp)
    assert CONTRACT <= set(block)
    assert (block["allocated_bytes"], block["reserved_bytes"]) == (0, 8 * MiB)  # allocated fell, reserved stayed
    assert block["segments"] == 4 and block["alloc_retries"] == 1
    peaks = (block["peak_allocated_bytes"], block["peak_reserved_bytes"], block["peak_segments"])
    assert peaks == (4 * MiB, 8 * MiB, 4)
    assert block["reserved_unallocated_bytes"] == block["peak_reserved_unallocated_bytes"] == 8 * MiB
    assert block["reserved_unallocated_share"] == pytest.approx((0 + 4 / 16 + 8 / 16) / 3)
    churn = smp[smp.t_s >= 0.2]
    assert allocator_block(smp, churn)["reserved_unallocated_share"] == pytest.approx((4 / 16 + 8 / 16) / 2)


def test_requests_fall_in_pytorchs_size_classes_and_the_block_counts_them():
    assert [size_class(n) for n in (512, MiB, MiB + 1, 10 * MiB - 512, 10 * MiB, 200 * MiB)] == [
        "small", "small", "large", "large", "huge", "huge"]
    memory = CachingMemory(64 * MiB, backing_device=None)
    for nbytes in (1000, MiB, 3 * MiB, 12 * MiB):
        memory.allocate(nbytes)
    with pytest.raises(OutOfMemory):
        memory.allocate(60 * MiB)  # a request that fails is one of its class too
    figures = memory.stats().allocator
    assert (figures.small_requests, figures.large_requests, figures.huge_requests) == (2, 1, 2)
    smp = samples([(0.1, 0, 0, 0), (0.2, 0, 0, 0)]).assign(alloc_small_requests=[2, 5], alloc_large_requests=[0, 1],
                                                            alloc_huge_requests=[0, 0])
    assert allocator_block(smp)["size_classes"] == {"small": 5, "large": 1, "huge": 0}
    assert allocator_block(samples([(0.1, 0, 0, 0)]))["size_classes"] is None  # a run that did not count them


def test_retries_count_across_a_restarted_server():
    assert counter_total(pd.Series([0, 2, 5, 1, 3])) == 8  # 5 before the restart, then 3
    smp = samples([(0.1, 0, 0, 2), (0.2, 0, 0, 5), (0.3, 0, 0, 0), (0.4, 0, 0, 1)])
    assert allocator_block(smp)["alloc_retries"] == 6


def test_no_block_where_no_caching_allocator_held_the_kv():
    arena = samples([(0.1, 0, 0, 0)])
    for col in COLUMNS.values():
        arena[col] = None
    assert allocator_block(arena) is None
    assert allocator_block(pd.DataFrame()) is None
    assert allocator_block(arena.drop(columns=list(COLUMNS.values()))) is None


def test_the_report_lines_appear_only_where_an_allocator_held_the_kv():
    block = allocator_block(samples([(0.1, 4 * MiB, 8 * MiB, 0), (0.2, 0, 8 * MiB, 2)]))
    html = reserved_unallocated(Summary.model_validate(
        {"engines": {"static": {"allocator": block}, "paged": {"allocator": None}}}))
    assert "Reserved by the allocator, unallocated" in html and "37.5 %" in html and ">paged<" not in html
    assert reserved_unallocated(Summary.model_validate({"engines": {"paged": {"allocator": None}, "old": {}}})) == ""
    ooms = pd.DataFrame([{"engine": "s", "layer": "allocator", "cached_free_bytes": 3 * MiB,
                          "device_free_bytes": 10 * MiB}, {"engine": "s", "layer": "policy", "cached_free_bytes": 0,
                                                            "device_free_bytes": 0}])
    table = oom_layers(ooms)
    assert table.count("<tr>") == 3 and "allocator (" in table and "policy (" in table
    assert layer_cell(next(ooms.itertuples())) == "allocator: 3.0 MiB cached free, 10.0 MiB free under the cap"
    arena = ooms.assign(layer=None, cached_free_bytes=None, device_free_bytes=None)
    assert oom_layers(arena) == "" and layer_cell(next(arena.itertuples())) == "n/a"


def test_the_caching_memory_keeps_its_state_at_the_first_oom_and_the_server_writes_it_as_pytorchs_pickle(tmp_path):
    from engines.api.server import EngineThread

    memory = CachingMemory(30 * MiB, backing_device=None)
    first = memory.allocate(8 * MiB, "a")
    memory.allocate(8 * MiB, "b")
    memory.free(first)
    with pytest.raises(OutOfMemory):
        memory.allocate(9 * MiB, "c")  # 12 MiB cached free, 10 MiB under the cap: no 20 MiB segment fits
    memory.allocate(2 * MiB, "d")  # after the OOM: the snapshot keeps the state at it
    path = tmp_path / "caching_snapshot-static.pickle"
    engine = SimpleNamespace(memory=memory, sink=None, poll=None)
    EngineThread(engine, lambda crash: None, lambda message: None, oom_snapshot=path).save_oom_snapshot()
    snap = read_snapshot(path)
    [segment] = snap["segments"]
    assert segment["total_size"] == 20 * MiB and segment["allocated_size"] == 8 * MiB
    assert [b["state"] for b in segment["blocks"]] == ["inactive", "active_allocated", "inactive"]
    out = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "stats", str(path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-1000:]
    assert "segments: 1" in out.stdout and "total_reserved: 20.0MiB" in out.stdout


def test_a_pickle_naming_a_class_is_no_snapshot(tmp_path):
    import pickle

    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps(SimpleNamespace(segments=[])))
    with pytest.raises(ValueError, match="not a memory snapshot"):
        read_snapshot(path)


@pytest.fixture(scope="module")
def caching_run(tiny_model, tmp_path_factory):
    """A short bench of a contiguous engine under --memory caching at 16 MiB: every 1-10 MiB request needs a
    20 MiB segment that the cap cannot hold, so its OOMs are the allocator's. It compares another setting too
    (tests/test_alloc_settings.py: one run for both files): power-of-two rounding, which serves at 16 MiB
    (expandable segments map 20 MiB pages, which a 16 MiB cap cannot hold: the server refuses them)."""
    out = tmp_path_factory.mktemp("caching")
    r = run_cli("bench", "--engines", "static-oracle,paged", "--memory", "caching", "--model", str(tiny_model),
                "--duration", "5", "--grace", "2", "--kv-budget", "16MiB", "--out", str(out), "--reports", str(out),
                "--run-id", "c", "--compare-alloc-conf", "roundup_power2_divisions:4", timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return out / "c"


@pytest.mark.slow  # reads the module's bench on the caching allocator: make test-all
def test_a_caching_bench_records_the_allocator_in_samples_summary_and_oom_events(caching_run):
    smp = pd.read_parquet(caching_run / "samples.parquet")
    smp = smp[smp.engine == "static-oracle"]
    assert smp.alloc_reserved_bytes.notna().all() and (smp.alloc_reserved_bytes >= smp.alloc_allocated_bytes).all()
    assert (smp.alloc_reserved_bytes > smp.alloc_allocated_bytes).any()  # where PyTorch's would differ, they do
    block = json.loads((caching_run / "summary.json").read_text())["engines"]["static-oracle"]["allocator"]
    assert CONTRACT <= set(block)
    assert block["reserved_bytes"] == int(smp.sort_values("t_s").alloc_reserved_bytes.iloc[-1])
    assert block["peak_reserved_bytes"] <= 16 * MiB
    ev = pd.read_parquet(caching_run / "events.parquet")
    ooms = ev[(ev.kind == "oom") & (ev.engine == "static-oracle")]
    assert len(ooms) and set(ooms.layer) <= {"policy", "allocator"} and "allocator" in set(ooms.layer)
    assert ooms.cached_free_bytes.notna().all() and ooms.device_free_bytes.notna().all()
    assert block["alloc_retries"] >= 1
    # at 4 KiB a token the tiny model's buffers are small and large: a real model's are huge (the simulator's test)
    assert block["size_classes"]["small"] > 0 and block["size_classes"]["large"] > 0
    html = (caching_run.parent / "c.html").read_text()
    assert "Reserved by the allocator, unallocated" in html and "By engine and layer" in html
    assert "emulated caching allocator at its first OOM" in html
    snap = read_snapshot(caching_run / "caching_snapshot-static-oracle.pickle")
    # its first OOM came with the allocator empty or nearly: a 1-10 MiB request asks for a 20 MiB segment
    assert sum(s["total_size"] for s in snap["segments"]) <= 16 * MiB


@pytest.mark.slow  # reads the module's bench on the caching allocator: make test-all
def test_a_compared_setting_is_a_run_of_its_own_and_the_summary_reads_its_figures_back(caching_run):
    summary = json.loads((caching_run / "summary.json").read_text())
    first, other = summary["alloc_settings"]
    assert (first["alloc_conf"], first["run"], other["alloc_conf"]) == ("default", None, "roundup_power2_divisions:4")
    assert set(first["engines"]) == set(other["engines"]) == {"static-oracle"}  # paged's one pool is not compared
    sub = json.loads((caching_run / other["run"] / "summary.json").read_text())
    assert set(sub["engines"]) == {"static-oracle"} and other["status"] == sub["status"] == "complete"
    assert other["engines"]["static-oracle"]["served"]
    mine = sub["engines"]["static-oracle"]["allocator"]
    for key in ("reserved_unallocated_share", "oom_policy", "oom_allocator", "alloc_retries", "peak_reserved_bytes"):
        assert other["engines"]["static-oracle"][key] == mine[key], key
    own = summary["engines"]["static-oracle"]["allocator"]
    ev = pd.read_parquet(caching_run / "events.parquet")
    ooms = ev[(ev.kind == "oom") & (ev.engine == "static-oracle")]
    by_layer = ooms.layer.value_counts()
    assert (own["oom_policy"], own["oom_allocator"]) == (by_layer.get("policy", 0), by_layer.get("allocator", 0))
    assert summary["size_classes_rule"]["matches"] is False  # the tiny model's buffers are not a real model's
    html = (caching_run.parent / "c.html").read_text()
    assert "Allocator settings side by side" in html and "Size classes: this run's model" in html


def llama3_8b_on_h100(memory: str, policies: list[str], alloc_conf: str | None = None) -> dict:
    from engines.shapes import load_shape
    from harness.gpus import gpu_preset
    from harness.plan import make_plan
    from harness.sim.simulator import run_simulation
    from workloads.spec import load_spec

    shape, gpu = load_shape("llama-3-8b"), gpu_preset("h100-80gb")
    plan = make_plan(shape, gpu.memory_bytes, "float16", max_seq_len=4096)
    return run_simulation(shape, gpu, plan, load_spec("paper"), policies, 16, None, 150, memory=memory,
                          alloc_conf=alloc_conf).out


def test_the_simulator_runs_a_contiguous_policy_on_the_caching_allocator_at_llama_3_8b_shape():
    out = llama3_8b_on_h100("caching", ["static-oracle", "paged"])
    assert (out["memory"], out["alloc_conf"]) == ("caching", "default")
    oracle, paged = out["policies"]["static-oracle"], out["policies"]["paged"]
    a = oracle["allocator"]
    # 128 KiB a token: every sequence's buffer is a large-pool block over 10 MiB, its segment of its own size; a
    # freed one is cached and split for the next, so PyTorch holds more than the live buffers
    assert a["peak_reserved_bytes"] > a["peak_allocated_bytes"] > 0
    assert a["reserved_unallocated_share"] > 0
    assert a["allocated_bytes"] == 0 < a["reserved_bytes"]  # every request done: the allocator keeps its segments
    assert oracle["placement"] == "caching" and oracle["requests_completed"] == 150
    assert abs(sum(v for k, v in oracle.items() if k.endswith("_share")) - 1) < 1e-6
    # the paged pool is one allocation: reserved is allocated, the whole run
    assert paged["allocator"]["peak_reserved_bytes"] == paged["allocator"]["peak_allocated_bytes"]
    assert paged["allocator"]["reserved_unallocated_share"] == 0
    # 128 KiB a token: a buffer of 80 tokens or more is huge (over 10 MiB, a segment of its own), none is small
    classes = a["size_classes"]
    assert sum(classes.values()) == 150 and classes["small"] == 0 and classes["huge"] > 0.9 * 150
    assert llama3_8b_on_h100("arena", ["static-oracle"])["policies"]["static-oracle"]["allocator"] is None


def test_simulate_refuses_an_alloc_conf_without_the_caching_memory_and_a_bad_one():
    base = ("simulate", "--model", "llama-3-8b", "--gpu", "h100-80gb", "--workload", "paper", "--policy",
            "static-oracle", "--requests", "20")
    r = run_cli(*base, "--alloc-conf", "expandable_segments:True")
    assert r.returncode == 2 and "needs --memory caching" in r.stderr
    r = run_cli(*base, "--memory", "caching", "--alloc-conf", "max_split_size_mb:5")
    assert r.returncode == 2 and "max_split_size_mb:5" in r.stderr
    r = run_cli(*base, "--memory", "caching", "--alloc-conf", "expandable_segments:True", "--jobs", "1")
    assert r.returncode == 0, r.stderr[-1000:]
    assert "static-oracle: caching allocator (expandable_segments:True)" in r.stdout

"""`fragbench simulate --memory caching` with several --alloc-conf: the same simulation once per allocator setting,
put side by side (harness/sim/alloc_settings_sim.py, harness/views/alloc_settings_sim_page.py)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from harness.analysis.summary_records import CapacityBlock, PolicyFigures, SimulationOut
from harness.sim.alloc_settings_sim import SettingsRefused, check_settings, sentences, side_by_side, sustained_rate
from harness.views.alloc_settings_sim_page import settings_text, slug
from tests.conftest import run_cli

SETTINGS = ("default", "expandable_segments:True")
# Llama-3-8B on an H100 at --gpu-util 0.2115: the weights and the engine's headroom leave a 1.09 GiB KV budget,
# four 2048-token sequences of 128 KiB a token; naive admission (--no-preflight) asks for memory without checking
# it first, so every refusal is an OOM with its layer.
BASE = ("simulate", "--model", "llama-3-8b", "--gpu", "h100-80gb", "--workload", "paper", "--policy",
        "static-max,growth", "--requests", "150", "--gpu-util", "0.2115", "--no-preflight", "--memory", "caching",
        "--jobs", "1")


def settings_args(*confs: str) -> tuple[str, ...]:
    return tuple(arg for conf in confs for arg in ("--alloc-conf", conf))


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """Both settings, as JSON, with a report page each; and the pages' directory."""
    pages = tmp_path_factory.mktemp("pages")
    r = run_cli(*BASE, *settings_args(*SETTINGS), "--json", "--report", str(pages / "sim.html"), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout), r.stderr, pages


def test_several_settings_print_each_output_and_the_rows_side_by_side(both):
    out, stderr, pages = both
    assert list(out) == ["alloc_confs", "side_by_side"]
    assert [o["alloc_conf"] for o in out["alloc_confs"]] == list(SETTINGS)
    for o in out["alloc_confs"]:  # each setting's whole usual output: same seed, workload, policies
        assert (o["seed"], o["workload"], o["memory"], list(o["policies"])) == (0, "paper", "caching",
                                                                             ["static-max", "growth"])
        assert all(o["policies"][p]["allocator"]["alloc_conf"] == o["alloc_conf"] for p in o["policies"])
    rows = out["side_by_side"]
    assert [(r["policy"], r["alloc_conf"]) for r in rows] == [(p, c) for p in ("static-max", "growth")
                                                              for c in SETTINGS]
    for r in rows:
        assert set(r) == {"policy", "alloc_conf", "sustained_rps", "sustained_from", "reserved_unallocated_share",
                          "oom_policy", "oom_allocator"}
        res = next(o for o in out["alloc_confs"] if o["alloc_conf"] == r["alloc_conf"])["policies"][r["policy"]]
        assert r["sustained_from"] == "completed"  # no sweep: what the run completed per simulated second
        assert r["sustained_rps"] == res["requests_completed"] / res["simulated_s"]
        assert r["oom_policy"] + r["oom_allocator"] == res["oom_total"]
    # one page per setting, the setting's slug before the suffix, named on stderr (stdout is the JSON alone)
    for conf in SETTINGS:
        page = pages / f"sim-{slug(conf)}.html"
        assert page.is_file() and str(page) in stderr
        assert f"caching allocator ({conf})" in page.read_text()


def test_expandable_segments_help_torch_cat_growth_and_not_a_max_length_reservation(both):
    """What the allocator's rules predict, per layer.

    static-max reserves max_seq_len (2048 tokens, 256 MiB) per sequence at admission. Its OOMs are the policy's:
    the live reservations plus the new one pass the budget, so the policy refuses before PyTorch's allocator is
    asked. expandable_segments changes how the allocator maps what it is asked for, not what the policy asks, so
    the policy-layer OOMs and the rate are the same under both settings; and the reservation's unused tail is
    allocated memory (internal fragmentation), which no allocator setting can hand back.

    growth re-allocates a sequence's buffer as it fills (torch.cat): each time a slightly larger huge block while
    the old one is still live. By default each such block is a segment of its own size or a split of a cached one;
    the freed, smaller ones stay cached inside segments that still hold live buffers, so once the cap is reached a
    request can fail although cached free plus never-reserved bytes would hold it: an allocator-layer OOM. Under
    expandable_segments one segment per pool maps 20 MiB pages at the lowest address where free and unmapped space
    hold the request and unmaps empty pages before the last retry, so stranded free bytes coalesce and go back:
    fewer allocator-layer OOMs, more requests completed."""
    rows = {(r["policy"], r["alloc_conf"]): r for r in both[0]["side_by_side"]}
    default, expandable = SETTINGS
    smax, smax_x = rows["static-max", default], rows["static-max", expandable]
    assert smax["oom_policy"] > 0 and smax_x["oom_policy"] == smax["oom_policy"]
    assert smax["oom_allocator"] == smax_x["oom_allocator"] == 0
    assert smax_x["sustained_rps"] == smax["sustained_rps"]
    internal = [o["policies"]["static-max"]["internal_fragmentation_share"] for o in both[0]["alloc_confs"]]
    assert internal[0] == internal[1] > 0.3
    growth, growth_x = rows["growth", default], rows["growth", expandable]
    assert growth["oom_allocator"] > growth_x["oom_allocator"] and growth["oom_policy"] == growth_x["oom_policy"] == 0
    assert growth_x["sustained_rps"] > growth["sustained_rps"]


def test_the_text_puts_each_setting_under_its_heading_then_the_table_and_a_sentence_per_policy(both):
    outs = [SimulationOut.model_validate(out) for out in both[0]["alloc_confs"]]
    rows = side_by_side(outs)
    text = settings_text(outs, rows)
    assert text.index("== --alloc-conf default ==") < text.index("== --alloc-conf expandable_segments:True ==") \
        < text.index("== side by side: 2 allocator settings")
    table = text[text.index("== side by side"):]
    assert "default" in table.splitlines()[1] and "expandable_segments:True" in table.splitlines()[1]
    said = sentences(rows)
    assert [s.split(",")[0] for s in said] == ["static-max", "growth"] and all(s in text for s in said)
    assert "no difference in sustained rate, policy-layer OOMs, allocator-layer OOMs" in said[0]
    assert "allocator-layer OOMs" in said[1].split("no difference")[0]  # growth's changed
    first = rows[2]  # growth under default, and a setting that changed none of its figures
    assert sentences([first, replace(first, alloc_conf="expandable_segments:True")]) == [
        "growth, against default: expandable_segments:True: no difference."]


def test_one_alloc_conf_prints_the_usual_output_unchanged(both):
    r = run_cli(*BASE, "--alloc-conf", "expandable_segments:True", "--json", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    single = json.loads(r.stdout)
    assert "alloc_confs" not in single and list(single)[:3] == ["model", "gpu", "dtype"]
    entry = both[0]["alloc_confs"][1]
    assert set(single) == set(entry)
    for o in (single, entry):  # the wall clock is the one figure a rerun changes
        for res in o["policies"].values():
            res.pop("wall_s")
    assert single == entry


def test_the_sustained_rate_is_the_sweeps_where_one_ran():
    res = PolicyFigures(requests_completed=10, simulated_s=4.0)
    assert sustained_rate(CapacityBlock(sustained_rps=1.5), res) == (1.5, "sweep")
    assert sustained_rate(None, res) == (2.5, "completed")
    assert sustained_rate(None, res.model_copy(update={"simulated_s": 0.0})) == (None, "completed")


def test_one_setting_spelled_twice_is_refused():
    check_settings(["default", "expandable_segments:True"])
    with pytest.raises(SettingsRefused, match="'expandable_segments: True' is the same setting"):
        check_settings(["expandable_segments:True", "expandable_segments: True"])


@pytest.mark.parametrize("extra, says", [
    (("--memory", "arena", *settings_args(*SETTINGS)), "needs --memory caching"),
    (settings_args("default", "max_split_size_mb:5"), "max_split_size_mb:5"),
    (settings_args("default", ""), "is the same setting as 'default'"),
])
def test_several_settings_refused_in_one_line(extra, says):
    base = tuple(a for a in BASE if a not in ("--memory", "caching"))
    memory = () if "--memory" in extra else ("--memory", "caching")
    r = run_cli(*base, *memory, *extra)
    assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr

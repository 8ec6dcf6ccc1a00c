"""The allocator's settings side by side (bench --compare-alloc-conf, make bench ALLOC_CONFS=...), and the rule that
picks MEMORY=caching's CPU model by PyTorch's size classes. The bench end to end is test_allocator_results's
caching run (one run for both files, to keep the suite short)."""

import re

from harness.analysis.alloc_settings_summary import compared_engines, setting_id
from harness.analysis.size_classes import REFERENCE, TOLERANCE, cpu_presets, distance, rule_pick, shares
from harness.analysis.summary_records import AllocSetting, Summary
from harness.views.alloc_settings_section import engine_sentence, settings_section
from tests.conftest import ROOT, run_cli


def mixed_churn_lengths() -> list[int]:
    from workloads.generate import trace
    from workloads.spec import load_spec

    return [min(2048, len(r.prompt_ids) + r.max_tokens) for r in trace(load_spec("mixed-churn"), 0, 2048).requests]


def test_the_rule_picks_the_cheapest_cpu_preset_in_llama_3_8bs_classes_and_the_makefile_runs_it():
    from engines.shapes import load_shape

    lengths = mixed_churn_lengths()
    ref = shares(load_shape(REFERENCE[0]), REFERENCE[1], lengths, 2048)
    tiny = shares(load_shape("tiny-llama"), "float32", lengths, 2048)
    # at 4 KiB a token the tiny model's per-request buffers are small and large; Llama-3-8B's (128 KiB) huge
    assert distance(tiny, ref) > TOLERANCE
    picked = rule_pick(lengths, 2048)
    assert picked == "tiny-llama-8b-kv" and cpu_presets().index(picked) > cpu_presets().index("tiny-llama")
    assert re.search(rf"^CACHING_PRESET := {picked}$", (ROOT / "Makefile").read_text(), re.M)
    assert re.search(r"^KV_BUDGET \?= \$\(if \$\(filter caching,\$\(MEMORY\)\),512MiB,",
                     (ROOT / "Makefile").read_text(), re.M)  # 2 max-length sequences: 2 x 2048 x 128 KiB


def test_only_engines_whose_kv_the_allocator_places_piece_by_piece_are_compared():
    assert compared_engines(["hf", "static-max", "static-oracle", "paged", "hf-cb", "vllm"]) == \
        ["hf", "static-max", "static-oracle"]
    assert setting_id(1, "expandable_segments:True,max_split_size_mb:128") == \
        "1-expandable_segments_True_max_split_size_mb_128"


def figures(rps, ci, share, policy, allocator):
    return {"sustained_rps": rps, "sustained_rps_ci": ci, "sustained_where": "within", "bound": "memory",
            "reserved_unallocated_share": share, "peak_reserved_bytes": 2**29, "peak_allocated_bytes": 2**28,
            "alloc_retries": 1, "oom_policy": policy, "oom_allocator": allocator,
            "size_classes": {"small": 0, "large": 1, "huge": 9}}


def settings(a: dict, b: dict, status: str = "complete") -> list[AllocSetting]:
    return [AllocSetting.model_validate(s) for s in (
        {"alloc_conf": "default", "run": None, "status": "complete", "engines": {"static-max": a}},
        {"alloc_conf": "expandable_segments:True", "run": "alloc_confs/1-x", "status": status,
         "engines": {"static-max": b}})]


def test_overlapping_intervals_are_no_measurable_difference_and_policy_ooms_are_said_to_be_beyond_any_setting():
    line = engine_sentence("static-max", settings(figures(1.0, [0.8, 1.2], 0.2, 5, 0),
                                                  figures(1.1, [0.9, 1.3], 0.21, 4, 0)))
    assert "no measurable difference in sustained rate" in line
    assert "Every OOM under every setting (9) was the policy's" in line


def test_disjoint_intervals_are_a_difference_and_allocator_ooms_are_not_blamed_on_the_policy():
    line = engine_sentence("static-max", settings(figures(1.0, [0.8, 1.2], 0.5, 0, 7),
                                                  figures(2.0, [1.6, 2.4], 0.2, 0, 1)))
    assert "sustained rate higher" in line and "allocator-layer OOMs 7 -> 1" in line and "policy's" not in line


def test_the_section_is_absent_without_settings_and_names_a_setting_whose_run_did_not_finish():
    assert settings_section(Summary()) == ""
    html = settings_section(Summary(alloc_settings=settings(figures(1.0, [0.8, 1.2], 0.2, 5, 0),
                                                           figures(None, None, None, 0, 0), status="partial")))
    assert "Allocator settings side by side" in html and "(partial run)" in html and "n/a (no knee measured)" in html


def test_a_compared_setting_needs_the_caching_memory_an_engine_it_can_place_and_a_valid_conf(tiny_model, tmp_path):
    base = ["bench", "--model", str(tiny_model), "--out", str(tmp_path), "--kv-budget", "16MiB"]
    for flags, says in ((["--engines", "static-oracle", "--compare-alloc-conf", "expandable_segments:True"],
                         "needs --memory caching"),
                        (["--engines", "paged", "--memory", "caching", "--compare-alloc-conf", "default"],
                         "no engine of --engines"),
                        (["--engines", "hf", "--memory", "caching", "--compare-alloc-conf",
                          "expandable_segments:Maybe"], "expandable_segments")):
        r = run_cli(*base, *flags, timeout=120)
        assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not any(tmp_path.iterdir())


def test_an_engine_that_refused_a_setting_is_said_not_to_have_served_under_it():
    refused = {**figures(None, None, None, None, None), "served": False}
    line = engine_sentence("static-max", settings(figures(1.0, [0.8, 1.2], 0.2, 0, 3), refused))
    assert "did not serve under this setting" in line and "no measurable difference" not in line
    html = settings_section(Summary(alloc_settings=settings(figures(1.0, [0.8, 1.2], 0.2, 0, 3), refused)))
    assert "did not serve (its server refused the setting" in html

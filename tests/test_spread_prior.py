"""Each engine's stream-spread prior from its twin (harness/sim/spread_prior.py): fresh streams offered to the
twin around its own knee, judged as decision turns, fitted by the knee fit's own model; the block run.json and
summary.json's headline carry."""

from __future__ import annotations

import numpy as np

from harness.analysis.capacity import SLO
from harness.analysis.stream_priors import SpreadPrior
from harness.sim import spread_prior
from harness.sim.stepfit import FittedStepModel
from harness.sim.twin import TwinEngine

CONFIG = {"policy": "paged", "placement": "best-fit", "block_size": 16, "preflight": True, "prefix_caching": False,
          "max_num_seqs": 64, "max_num_batched_tokens": 2048, "on_oom": "reject", "kv_budget_bytes": 16 << 20,
          "kv_bytes_per_token": 4096, "max_seq_len": 2048, "row_pad_bytes": 0}
# paged's step model as a recorded run fitted it (tiny-llama, 16MiB, mixed-churn, this 2-core machine): its twin's
# knee lay at 5.6 req/s
STEPS = FittedStepModel({"fixed_s": 0.00142, "per_decode_s": 0.00056, "per_prefill_s": 0.0, "per_token_s": 8.14e-5,
                         "per_context_token_s": 4.74e-7}, None, 0, "test")


def test_the_twin_gives_a_prior_from_its_own_streams_around_its_own_knee():
    twin = TwinEngine("paged", CONFIG, STEPS, False)
    # the machine's knee told as 8 req/s: the twin's own search finds its own, and the streams are offered there
    out = spread_prior.twin_priors({"paged": twin}, {"paged": 8.0}, SLO(), 16 << 20, "mixed-churn", 0, 2048,
                                   judged=20, streams=10, n_jobs=1)
    p = out.engines["paged"]
    assert out.correlation is None  # one engine: no pair to correlate
    assert isinstance(p.prior, SpreadPrior) and p.points == 10
    assert 3.0 < p.twin_knee_rps < 8.0
    assert p.prior.centre >= spread_prior.FLOOR and p.spread_ci[0] <= p.prior.centre <= max(p.spread_ci[1], 0.03)
    assert p.gain_ci[0] <= p.prior.gain <= p.gain_ci[1]
    block = spread_prior.prior_block(out, 1.5, 10, 20)
    assert block["source"] == "twin" and block["engines"]["paged"]["centre"] == round(p.prior.centre, 4)
    assert SpreadPrior.of(block["engines"]["paged"]).centre == round(p.prior.centre, 4)


def test_a_twin_point_judges_its_requests_in_arrival_order_and_reads_their_offered_load():
    twin = TwinEngine("paged", CONFIG, STEPS, False)
    jobs = [spread_prior.PriorJob(twin, f"{spread_prior.KEY}{i}", 4.0, 20, SLO(), 16 << 20, "mixed-churn", 0, 2048,
                                  1000.0) for i in range(3)]
    pts = [spread_prior.twin_point(j) for j in jobs]
    assert all(len(p.met) == 20 and p.offered_rps == 4.0 for p in pts)
    loads = [p.log_load for p in pts]
    assert len(set(loads)) == 3 and all(np.isfinite(loads))  # each stream its own load
    assert spread_prior.twin_point(jobs[0]).log_load == loads[0]  # one stream, one load


def test_bench_computes_the_prior_once_for_the_headline_pair_and_run_json_records_it(tmp_path, monkeypatch):
    """Before the decision: the headline's two engines' twins (as the run's steps fit them) give their priors, which
    run.json records at once, and every fit from then on (the decision's, the summary's) reads them there."""
    from types import SimpleNamespace

    import pandas as pd

    from harness.analysis.design import Design
    from harness.analysis.run_fits import correlations, spread_priors
    from harness.run import bench as bench_mod
    from harness.run.config import BenchConfig
    from harness.run.console import Console
    from harness.run.record import RunWriter

    cfg = BenchConfig(engines=["paged", "static-oracle"], model="m", kv_budget="16MiB", out_dir=tmp_path,
                      workload="mixed-churn", duration_s=1, run_id="r", sweep=True)
    twin = TwinEngine("paged", CONFIG, STEPS, False)
    monkeypatch.setattr(bench_mod, "run_steps", lambda d: pd.DataFrame())
    other = TwinEngine("static-oracle", CONFIG, STEPS, False)
    monkeypatch.setattr(bench_mod, "twins_of", lambda meta, steps, shared: {"paged": twin, "hf": twin,
                                                                            "static-oracle": other})
    monkeypatch.setattr(bench_mod, "timed_priors",
                        lambda *a, **k: spread_prior.timed_priors(*a, streams=6, n_jobs=1, **k))
    est = {"paged": SimpleNamespace(rps=5.0), "static-oracle": SimpleNamespace(rps=3.0)}
    verdict = SimpleNamespace(headline=SimpleNamespace(engine="paged", against="static-oracle"),
                              fit=SimpleNamespace(estimates=est))
    b = bench_mod.Bench.__new__(bench_mod.Bench)
    b.cfg, b.dir, b.console = cfg, tmp_path, Console(None)
    b.record = RunWriter.start(cfg, tmp_path)
    b.design = Design.of(900, 1.5, 0.9)
    b.searching = SimpleNamespace(verdict=lambda: verdict)
    b.spread_prior()
    meta = b.record.typed()
    assert meta.spread_prior["source"] == "twin"
    assert set(meta.spread_prior["engines"]) == {"paged", "static-oracle"}  # hf: not the headline's pair
    assert meta.spread_prior["judged"] == b.design.min_judged
    assert set(spread_priors(meta)) == {"paged", "static-oracle"}
    c = meta.spread_prior["correlation"]  # the pair's, on the streams both twins judged; the fit uses its bound
    assert c["engines"] == ["paged", "static-oracle"] and c["streams"] == 6 and c["used"] == c["lower"]
    assert correlations(meta) == {("paged", "static-oracle"): c["used"]}
    import json
    assert json.loads((tmp_path / "run.json").read_text())["spread_prior"] == meta.spread_prior


def test_the_report_says_where_each_spread_prior_came_from():
    from harness.analysis.summary_records import HeadlineBlock
    from harness.views.capacity_section import prior_words
    h = HeadlineBlock(engine="paged", against="static-oracle", ratio=1.5, ratio_ci=[1.2, 1.8],
                      spread_prior={"source": "twin", "engines": {"paged": {"centre": 0.12, "gain": 0.5}}})
    assert "from the twin" in prior_words(h) and "paged 0.120 (gain 0.50)" in prior_words(h)
    assert "half-t" in prior_words(HeadlineBlock(engine="paged", against="hf", ratio=1.5, ratio_ci=[1.2, 1.8]))
    assert h.written()["spread_prior"]["source"] == "twin"

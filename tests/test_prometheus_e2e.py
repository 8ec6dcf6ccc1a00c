"""A real Prometheus (Debian's package) scrapes two churning servers, a static-oracle one and a paged one, at
the same load, with `fragbench rules --family fragbench` loaded (the defaults' thresholds and expressions, shorter
windows): the fragmentation alert fires on the static-oracle server within 60 s of churn (scaled to the machine),
and no alert of the fragmentation kind (by name, or by its cause="fragmentation" label) is ever pending on the paged
one, read from Prometheus' own ALERTS series over the whole run, not only at its end. Both pages carry the contract's
metrics."""

from __future__ import annotations

import asyncio
import json
import random
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from contextlib import ExitStack

import aiohttp
import pytest
import yaml

from engines.procs import free_port, spawn, stop
from harness.monitoring.families import FAILURES, FRAGMENTATION
from harness.run.servers import start_server
from tests.conftest import run_cli
from tests.helpers import scaled

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(PROMETHEUS is None or shutil.which("promtool") is None,
                                reason="prometheus absent (apt-get install prometheus)")
ENGINES = ("static-oracle", "paged")
# 60 s of churn on the developers' quiet machine, scaled to this one: the alert reads a rate of fragmentation OOMs,
# and a slower machine serves (and fails) fewer requests a second
FIRE_WITHIN_S = scaled(60.0)
WINDOW, HOLD = "10s", "5s"  # short, for the test; production keeps the defaults (5m, 2m)
CONTRACT = ("fragbench:time_to_first_token_seconds_bucket", "fragbench:e2e_request_latency_seconds_bucket",
            "fragbench:request_prompt_tokens_bucket", "fragbench:request_generation_tokens_bucket",
            "fragbench:kv_live_tokens", 'fragbench:kv_failed_allocation_bytes_total{cause="fragmentation"}')


async def client(session: aiohttp.ClientSession, url: str, seed: int, stop_at: list[float]) -> None:
    """One user sending mixed-length requests back to back: the churn."""
    rng = random.Random(seed)
    while time.monotonic() < stop_at[0]:
        body = {"prompt": [rng.randint(3, 4000) for _ in range(rng.randint(8, 100))],
                "max_tokens": rng.randint(16, 160), "temperature": 0, "ignore_eos": True}
        try:
            async with session.post(f"{url}/v1/completions", json=body) as r:
                await r.read()
        except aiohttp.ClientError:
            pass


async def alert_states(session: aiohttp.ClientSession, prom: str) -> dict[str, str]:
    """engine -> the fragmentation alert's state there (pending or firing), from Prometheus' /api/v1/alerts."""
    try:
        async with session.get(f"{prom}/api/v1/alerts") as r:
            alerts = (await r.json())["data"]["alerts"]
    except (aiohttp.ClientError, ValueError, KeyError):
        return {}
    return {a["labels"].get("engine"): a["state"] for a in alerts if a["labels"].get("alertname") == FRAGMENTATION}


async def churn_and_watch(urls: dict[str, str], prom: str) -> tuple[float | None, float, float]:
    """Churn both servers until the static-oracle alert fires (or the deadline), then one more window and hold
    so that paged has as long again to fire. Returns when it fired (s after the churn began), and when the churn
    began and ended (Prometheus' clock: the same machine's)."""
    start = time.monotonic()
    began = time.time()
    stop_at = [start + FIRE_WITHIN_S]
    fired_s = None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        users = [asyncio.create_task(client(session, url, 10 * i + j, stop_at))
                 for i, url in enumerate(urls.values()) for j in range(10)]
        while time.monotonic() < stop_at[0]:
            await asyncio.sleep(1.0)
            states = await alert_states(session, prom)
            if fired_s is None and states.get("static-oracle") == "firing":
                fired_s = time.monotonic() - start
                stop_at[0] = time.monotonic() + 15.0  # window + hold: paged gets as long again
        for user in users:  # a client that goes away aborts its request: nothing is left to wait for
            user.cancel()
        await asyncio.gather(*users, return_exceptions=True)
    await asyncio.sleep(3.0)  # the last evaluation's ALERTS sample is written
    return fired_s, began, time.time()


def query_range(prom: str, query: str, began: float, ended: float) -> list[dict]:
    """Every series of `query` at 1 s steps over [began, ended] (each with its labels and values)."""
    url = (f"{prom}/api/v1/query_range?query={urllib.parse.quote(query)}&start={began:.3f}&end={ended:.3f}"
           "&step=1s")
    return json.loads(urllib.request.urlopen(url, timeout=30).read())["data"]["result"]


def fragmentation_kind(labels: dict) -> bool:
    return labels.get("alertname") == FRAGMENTATION or labels.get("cause") == "fragmentation"


def prometheus_config(tmp_path, urls: dict[str, str]) -> str:
    targets = [{"targets": [url.removeprefix("http://")], "labels": {"engine": engine}} for engine, url in urls.items()]
    cfg = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": ["rules.yml"],
           "scrape_configs": [{"job_name": "fragbench", "static_configs": targets}]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    return str(tmp_path / "prometheus.yml")


def test_the_fragmentation_alert_fires_on_static_oracle_and_never_on_paged(tiny_model, tmp_path):
    r = run_cli("rules", "--family", "fragbench", "--window", WINDOW, "--for", HOLD, "--out",
                str(tmp_path / "rules.yml"), timeout=60)
    assert r.returncode == 0, r.stderr
    with ExitStack() as stack:
        # one after the other from this thread: a server dies with the thread that started it (PDEATHSIG)
        urls = {e: stack.enter_context(start_server(e, str(tiny_model), "4MiB", tmp_path / f"{e}.log",
                                                    extra=["--max-seq-len", "512"])).url for e in ENGINES}
        port = free_port()
        log = stack.enter_context(open(tmp_path / "prometheus.log", "wb"))
        prom = spawn([PROMETHEUS, f"--config.file={prometheus_config(tmp_path, urls)}",
                      f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                     stdout=log, stderr=subprocess.STDOUT)
        stack.callback(stop, prom)
        prom_url = f"http://127.0.0.1:{port}"
        fired_s, began, ended = asyncio.run(churn_and_watch(urls, prom_url))
        alerts = query_range(prom_url, "ALERTS", began, ended)  # every state of every alert over the run
        untokened = {s["metric"].get("engine"): max(float(v) for _, v in s["values"])
                     for s in query_range(prom_url, "fragbench:kv_untokened_ratio", began, ended)}
        pages = {e: urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode() for e, url in urls.items()}
    seen = sorted({(s["metric"].get("engine"), s["metric"]["alertname"], s["metric"]["alertstate"]) for s in alerts})
    why = (f"static-oracle fired after {fired_s} s; alerts over the run: {seen}; most KV held by no token: "
           f"{untokened}; prometheus log: "
           f"{(tmp_path / 'prometheus.log').read_text()[-800:]}")
    assert fired_s is not None and fired_s <= FIRE_WITHIN_S, why
    on_paged = [s for s in alerts if s["metric"].get("engine") == "paged" and fragmentation_kind(s["metric"])]
    assert not on_paged, why  # never pending, at any evaluation of the run
    assert any(s["metric"].get("engine") == "static-oracle" and s["metric"]["alertname"] == FAILURES
               for s in alerts), why
    for engine, page in pages.items():
        for name in CONTRACT:
            assert name in page, f"{engine}'s /metrics lacks {name}"
        finished = re.search(r"^fragbench:e2e_request_latency_seconds_count (\S+)", page, re.M)
        assert finished and float(finished.group(1)) > 0, engine
    print(why)

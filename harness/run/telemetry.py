"""What a server that fragbench did not start says about its memory: its Prometheus metrics, read into the
samples' columns. One table of metric names per server family (fragbench's own, vLLM, SGLang, TGI); a
figure a family does not export stays None (unknown), never 0.

Where the names come from: vLLM's `vllm:` metrics (docs.vllm.ai, "Production Metrics"; its v1 engine
names, `vllm:gpu_cache_usage_perc` before them); SGLang's `sglang:` metrics with `--enable-metrics`
(docs.sglang.io, "Production Metrics"); TGI's `tgi_` metrics (huggingface.co/docs/text-generation-inference,
"Metrics"); fragbench's own `fragbench:` names (docs/architecture.md, "Metrics").
"""

from __future__ import annotations

from dataclasses import dataclass

from engines.procs import metric_values
from harness.fetch import text_or_none

# sample column -> what it means, for the report's line on what a target could and could not show
SEEN = {"kv_cache_usage_perc": "KV usage", "running": "running requests", "waiting": "waiting requests",
        "preempted_total": "preemptions", "prefix_cache_hit_tokens": "prefix-cache hits",
        "token_states_bytes": "live-token bytes"}


@dataclass(frozen=True)
class Family:
    """One server's metric names by sample column; the first name present of each tuple is used."""

    name: str
    columns: dict[str, tuple[str, ...]]
    usage_scale: float = 1.0  # the usage gauge's unit: 1 for 0-1

    def detects(self, metrics: dict[str, float]) -> bool:
        return any(n in metrics for names in self.columns.values() for n in names)

    def row(self, metrics: dict[str, float]) -> dict:
        out = {}
        for column, names in self.columns.items():
            value = next((metrics[n] for n in names if n in metrics), None)
            out[column] = value
        if out.get("kv_cache_usage_perc") is not None:
            out["kv_cache_usage_perc"] /= self.usage_scale
        return out

    def sees(self) -> list[str]:
        return [words for column, words in SEEN.items() if column in self.columns]

    def cannot_see(self) -> list[str]:
        return [words for column, words in SEEN.items() if column not in self.columns]


FAMILIES = (
    Family("fragbench", {
        "kv_cache_usage_perc": ("fragbench:kv_cache_usage_perc",),
        "running": ("fragbench:num_requests_running",), "waiting": ("fragbench:num_requests_waiting",),
        "preempted_total": ("fragbench:num_preemptions_total",),
        "prefix_cache_hit_tokens": ("fragbench:prefix_cache_hits_total",),
        "prefix_cache_query_tokens": ("fragbench:prefix_cache_queries_total",),
        "kv_capacity_bytes": ("fragbench:kv_capacity_bytes",),
        "token_states_bytes": ("fragbench:kv_token_states_bytes",),
        "allocated_bytes": ("fragbench:kv_allocated_bytes",), "free_bytes": ("fragbench:kv_free_bytes",),
        "largest_free_bytes": ("fragbench:kv_largest_free_bytes",)}),
    Family("vllm", {
        "kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        "running": ("vllm:num_requests_running",), "waiting": ("vllm:num_requests_waiting",),
        "preempted_total": ("vllm:num_preemptions_total", "vllm:num_preemptions"),
        "prefix_cache_hit_tokens": ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits"),
        "prefix_cache_query_tokens": ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_queries")}),
    Family("sglang", {
        "kv_cache_usage_perc": ("sglang:token_usage",), "running": ("sglang:num_running_reqs",),
        "waiting": ("sglang:num_queue_reqs",), "live_tokens": ("sglang:num_used_tokens",),
        "prefix_cache_hit_rate": ("sglang:cache_hit_rate",)}),
    Family("tgi", {"running": ("tgi_batch_current_size",), "waiting": ("tgi_queue_size",)}),
)


def family_named(name: str) -> Family:
    return next(f for f in FAMILIES if f.name == name)


class NoTelemetry(ValueError):
    """A metrics page without any family fragbench reads: one line, exit 2."""


def scrape(url: str, timeout_s: float = 5.0) -> dict[str, float] | None:
    """Every metric of a Prometheus page summed over its labels; None when it does not answer or parse."""
    text = text_or_none(url, timeout_s)
    try:
        return metric_values(text) if text is not None else None
    except ValueError:
        return None


def detect(metrics: dict[str, float] | None) -> Family | None:
    return next((f for f in FAMILIES if f.detects(metrics or {})), None)


@dataclass
class Telemetry:
    """A target's metrics page, read at the bench's sampling rate into a /stats-shaped row."""

    url: str
    family: Family

    @classmethod
    def of(cls, url: str) -> Telemetry:
        metrics = scrape(url)
        if metrics is None:
            raise NoTelemetry(f"metrics URL {url} does not answer with a Prometheus page")
        family = detect(metrics)
        if family is None:
            known = ", ".join(f.name for f in FAMILIES)
            raise NoTelemetry(f"metrics URL {url} has none of the metric families fragbench reads ({known})")
        return cls(url, family)

    def stats(self) -> dict | None:
        metrics = scrape(self.url)
        return None if metrics is None else {**self.family.row(metrics), "source": f"{self.family.name} metrics"}

    def describe(self) -> dict:
        return {"metrics_url": self.url, "family": self.family.name, "sees": self.family.sees(),
                "cannot_see": [*self.family.cannot_see(), "the Figure-2 split (no block map or reservation bytes)"]}

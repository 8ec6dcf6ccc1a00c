"""Servers fragbench did not start (`bench --target NAME=URL`): checked before any load is sent, then run
as one more engine of the bench. fragbench never starts, stops or restarts a target; it watches whether it
answers, and reads its memory from its metrics (harness/run/telemetry.py). A target may be on another machine
(any http or https URL): the network's round trip to it is measured before the run and recorded beside it, so that
a reader can tell the network's share of its latencies from the server's."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from urllib.parse import urlparse

from engines.api.stats import StatsPayload
from engines.memory.nvml import fullest_gpu
from harness.analysis.records import RecordedTarget
from harness.fetch import HTTPError, answers, bearer, request, round_trip_s
from harness.run.telemetry import NoTelemetry, Telemetry, family_named

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
LOOPBACK = {"127.0.0.1", "localhost", "::1"}  # this machine: NVML sees a loopback target's GPU


class TargetRefused(ValueError):
    """A target that cannot be benched, said in one line before any load is sent."""


@dataclass
class Target:
    """A running server by name: where it answers, where its metrics are, the model id it serves."""

    name: str
    url: str
    telemetry: Telemetry | None  # None: no metrics page fragbench can read (check's rate question needs none)
    model: str
    api_key: str | None = None
    network_rtt_s: float | None = None  # measured when it was opened (round_trip_s)
    proc = None  # not ours: no process to watch, kill or restart
    log_path = None

    def alive(self, timeout_s: float = 5.0) -> bool:
        return answers(f"{self.url}/v1/models", bearer(self.api_key), timeout_s)  # an error status is an answer

    def stats(self) -> StatsPayload | None:
        """Its metrics as a /stats record (the fields its family exports; the rest absent)."""
        stats = self.telemetry.stats() if self.telemetry else {"source": "no metrics"}
        if stats is not None and urlparse(self.url).hostname in LOOPBACK and (gpu := fullest_gpu()) is not None:
            stats["device_used_bytes"] = gpu[1].used  # on this machine: NVML sees its GPU, the fullest one
        return StatsPayload.model_validate(stats) if stats is not None else None

    def stop(self) -> None:
        """Nothing: the target outlives the bench."""

    def describe(self) -> RecordedTarget:
        seen = self.telemetry.describe() if self.telemetry else {
            "metrics_url": None, "family": None, "sees": [], "cannot_see": ["any memory figure (no metrics read)"]}
        return RecordedTarget(url=self.url, model=self.model, **seen, network_rtt_s=self.network_rtt_s)

    @classmethod
    def restore(cls, name: str, described: RecordedTarget, api_key: str | None) -> Target:
        """The target `describe` wrote (into a bench's configuration), without checking it again."""
        family = described.family
        telemetry = Telemetry(described.metrics_url, family_named(family)) if family else None
        return cls(name, described.url, telemetry, described.model, api_key, described.network_rtt_s)


def parse_pairs(pairs: list[str], flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        name, sep, url = pair.partition("=")
        if not sep or not NAME.match(name) or not url:
            raise TargetRefused(f"{flag} takes NAME=URL (a name of letters, digits, '.', '_' or '-'), not {pair!r}")
        if name in out:
            raise TargetRefused(f"{flag}: two targets named {name!r}")
        out[name] = url.rstrip("/")
    return out


def check_url(url: str, flag: str) -> None:
    """An http or https URL with a host, on this machine or another (a server in a cluster, as guidellm and
    `vllm bench serve` are pointed at)."""
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise TargetRefused(f"{flag}: {url!r} is not an http:// or https:// URL")
    try:
        parsed.port  # noqa: B018 -- urllib checks the port when it is read: a bad one raises here, in one line
    except ValueError:
        raise TargetRefused(f"{flag}: {url!r} has no valid port") from None


def model_id(url: str, api_key: str | None) -> str:
    """The first model /v1/models lists: what every request names. Unreachable and not-OpenAI are refused."""
    try:
        body = request(f"{url}/v1/models", headers=bearer(api_key), timeout_s=10)
    except HTTPError as e:
        raise TargetRefused(f"target {url}: /v1/models answered HTTP {e.code}: not an OpenAI-compatible server"
                            + (" (or --api-key is wrong)" if e.code in (401, 403) else "")) from None
    except OSError as e:
        raise TargetRefused(f"target {url} does not answer ({getattr(e, 'reason', e)})") from None
    try:
        data = json.loads(body)["data"]
        return str(data[0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise TargetRefused(f"target {url}: /v1/models is not an OpenAI model list: not an OpenAI-compatible "
                            "server") from None


def open_targets(pairs: list[str], metrics_pairs: list[str], taken: list[str],
                 api_key: str | None = None) -> dict[str, Target]:
    """Every --target checked: its name free, its URL answering as an OpenAI server, its metrics page readable by
    one of the known families; the network's round trip to it measured."""
    urls = parse_pairs(pairs, "--target")
    metrics = parse_pairs(metrics_pairs, "--metrics-url")
    for name in urls:
        if name in taken:
            raise TargetRefused(f"--target {name}: the name is one of --engines; name the target apart")
    for name in metrics:
        if name not in urls:
            raise TargetRefused(f"--metrics-url {name}: no --target of that name")
    out = {}
    for name, url in urls.items():
        check_url(url, "--target")
        metrics_url = metrics.get(name, f"{url}/metrics")
        check_url(metrics_url, "--metrics-url")
        model = model_id(url, api_key)
        try:
            telemetry = Telemetry.of(metrics_url)
        except NoTelemetry as e:
            raise TargetRefused(f"target {name}: {e}") from None
        out[name] = Target(name, url, telemetry, model, api_key, round_trip_s(url, bearer(api_key)))
    return out

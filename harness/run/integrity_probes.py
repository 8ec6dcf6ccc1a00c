"""KV integrity under churn, measured: does the cache give back what was put in it? A paged engine that frees
a block too early, shares a prefix wrongly or restores a preempted sequence badly still streams tokens at
full speed; only its numbers are wrong. Probe requests with fixed prompts (greedy, logprobs) are served alone
on the idle server first, twice (the second time a prefix cache serves them from itself), then sent one at a
time into a running load (preemptions, cancellations, prefix sharing, fragmentation); each answer is judged
against its idle one by harness/analysis/integrity.py. The engine's counters, read as each probe starts and
ends, say what it was doing."""

from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from engines.api.stats import StatsPayload
from harness.analysis.integrity import IdleFigures, Served, compare, integrity, tolerance_of
from harness.analysis.summary_records import Integrity

ALTERNATIVES = 2  # the chosen token's and one more: a near tie is told from a wrong token by the idle margin
WORDS = ("the of and to in is was he for it with as his on be at by had are from or this that you one they "
         "have memory block cache page token").split()
COUNTERS = ("preempted_total", "prefix_cache_hit_tokens", "oom_total")


@dataclass(frozen=True)
class Probe:
    name: str
    kind: str  # short | shared-prefix | long | long-output: which part of the cache it leans on
    prompt: str
    max_tokens: int


def text(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def probes(max_seq_len: int) -> list[Probe]:
    """Fixed prompts (a word is a token or two): two short, two sharing a long head (the second one's head is
    a prefix-cache hit wherever the cache shares), one long prompt, and one long answer (the newest and longest
    sequence is the one preemption takes)."""
    head = text(max(16, max_seq_len // 16), seed=1)
    long_words = max(32, min(600, max_seq_len // 4))
    return [
        Probe("p1-short", "short", text(12, seed=2), 16),
        Probe("p2-shared-a", "shared-prefix", head + " " + text(8, seed=3), 16),
        Probe("p3-shared-b", "shared-prefix", head + " " + text(8, seed=4), 16),
        Probe("p4-long", "long", text(long_words, seed=5), 16),
        Probe("p5-long-output", "long-output", text(24, seed=6), min(96, max_seq_len // 8)),
        Probe("p6-short", "short", text(20, seed=7), 24),
    ]


def ask(target: str, probe: Probe, api: str = "completions", model: str | None = None,
        api_key: str | None = None, timeout_s: float = 300,
        opened: Callable[[http.client.HTTPConnection], None] = lambda conn: None) -> Served:
    """The probe served once: greedy, to its full length (ignore_eos), with its tokens' logprobs. `opened`
    gets the connection, so that another thread can cut a probe short (the server then aborts it)."""
    base = {"max_tokens": probe.max_tokens, "temperature": 0, "ignore_eos": True, **({"model": model} if model else {})}
    if api == "chat":
        body = {**base, "messages": [{"role": "user", "content": probe.prompt}], "logprobs": True,
                "top_logprobs": ALTERNATIVES}
    else:
        body = {**base, "prompt": probe.prompt, "logprobs": ALTERNATIVES}
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    url = urlsplit(target)
    path = url.path.rstrip("/") + ("/v1/chat/completions" if api == "chat" else "/v1/completions")
    conn = (http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection)(
        url.hostname, url.port, timeout=timeout_s)
    try:
        opened(conn)
        conn.request("POST", path, json.dumps(body), headers)
        r = conn.getresponse()
        data = r.read()
        if r.status >= 400:
            return Served(error=f"HTTP {r.status}: {data[:200].decode(errors='replace')}")
        choice = json.loads(data)["choices"][0]
    except (OSError, http.client.HTTPException, ValueError, KeyError, IndexError) as e:
        return Served(error=f"{type(e).__name__}: {e}"[:200])
    finally:
        conn.close()
    lp = choice.get("logprobs") or {}
    if api == "chat":
        content = lp.get("content") or []
        return Served([c["token"] for c in content], [c["logprob"] for c in content],
                      [{t["token"]: t["logprob"] for t in c.get("top_logprobs") or []} for c in content],
                      finish_reason=choice.get("finish_reason"))
    return Served(list(lp.get("tokens") or []), [float(x) for x in lp.get("token_logprobs") or []],
                  [dict(t or {}) for t in lp.get("top_logprobs") or []], finish_reason=choice.get("finish_reason"))


def during(before: StatsPayload | None, after: StatsPayload | None) -> dict:
    """The engine's counters over one probe: their rise, and its queue at the end (the probe row's fields)."""
    if not before or not after:
        return {}
    out = {f"{k}_during": after.figure(k) - before.figure(k) for k in COUNTERS
           if isinstance(after.figure(k), int | float) and isinstance(before.figure(k), int | float)}
    out.update({k: after.figure(k) for k in ("running", "waiting") if after.figure(k) is not None})
    if after.steps is not None:
        out["engine_step"] = after.steps
    return out


class IntegrityProbes:
    """The check against one server: `idle()` on the idle server, then `with check:` around its load."""

    def __init__(self, target: str, max_seq_len: int, dtype: str | None = None, api: str = "completions",
                 model: str | None = None, api_key: str | None = None,
                 state: Callable[[], StatsPayload | None] = lambda: None,
                 on_row: Callable[[dict], None] = lambda row: None, gap_s: float = 0.2):
        self.target, self.api, self.model, self.api_key = target, api, model, api_key
        self.probes = probes(max_seq_len)
        self.tolerance = tolerance_of(dtype)
        self.state = state  # the engine's counters now (/stats or its metrics), or None
        self.on_row = on_row  # each probe's row as it comes back (a journal: a killed run keeps them)
        self.gap_s = gap_s  # between one probe's end and the next one's start
        self.reference: dict[str, Served] = {}
        self.idle_diff: float | None = None  # the largest |logprob difference| between the two idle servings
        self.rows: list[dict] = []
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.conn: http.client.HTTPConnection | None = None  # the probe in flight's
        self.started_s = time.time()

    def ask(self, probe: Probe) -> Served:
        return ask(self.target, probe, self.api, self.model, self.api_key, opened=self._opened)

    def _opened(self, conn: http.client.HTTPConnection) -> None:
        self.conn = conn

    def idle(self) -> IdleFigures:
        """Each probe alone, twice: the first answer is the reference, the second says how repeatable it is."""
        for probe in self.probes:
            first = self.ask(probe)
            if first.error is None and first.tokens:
                self.reference[probe.name] = first
                again = compare(first, self.ask(probe), self.tolerance)
                self.idle_diff = max(self.idle_diff or 0.0, again.max_abs_logprob_diff)
        return self.idle_figures()

    def idle_figures(self) -> IdleFigures:
        return IdleFigures(tolerance=self.tolerance, idle_max_abs_logprob_diff=self.idle_diff,
                           reference_probes=len(self.reference), of_probes=len(self.probes),
                           probe_set=[{"name": p.name, "kind": p.kind, "max_tokens": p.max_tokens,
                                       "prompt_words": len(p.prompt.split())} for p in self.probes])

    def __enter__(self) -> IntegrityProbes:
        self.stop.clear()
        self.thread = threading.Thread(target=self._loop, name="integrity-probes", daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        """The load is over: the probe in flight is cut (it would load what comes next), and not judged."""
        self.stop.set()
        sock = self.conn.sock if self.conn is not None else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self.thread is not None:
            self.thread.join(timeout=30)

    def _loop(self) -> None:
        names = [p for p in self.probes if p.name in self.reference]
        i = 0
        while names and not self.stop.wait(self.gap_s):
            self.probe_once(names[i % len(names)])
            i += 1

    def probe_once(self, probe: Probe) -> dict:
        before, t = self.state(), time.time()
        got = self.ask(probe)
        if self.stop.is_set() and got.error is not None:
            return {}  # cut short when the load ended
        row = {"probe": probe.name, "kind": probe.kind, "t_s": round(t - self.started_s, 3),
               "s": round(time.time() - t, 3), **during(before, self.state())}
        if got.error is not None:
            row["error"] = got.error
        else:
            c = compare(self.reference[probe.name], got, self.tolerance)
            row.update(compared=c.compared, max_abs_logprob_diff=c.max_abs_logprob_diff, tie_at=c.tie_at)
            if c.ended is not None:
                row["ended"] = c.ended
            if c.diverged_at is not None:
                row.update(diverged_at=c.diverged_at, why=c.why)
        self.rows.append(row)
        self.on_row(row)
        return row

    def result(self) -> dict:
        """engines.<name>.integrity as summary.json and check write it."""
        return integrity(self.idle_figures(), self.rows)

    def judged(self) -> Integrity:
        """The same, as the record the report's and check's sentence reads."""
        return Integrity.model_validate(self.result())

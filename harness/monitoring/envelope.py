"""The capacity envelope `fragbench check` measures and `fragbench rules --from-check` reads: the most live
tokens the server held under the churn before its first OOM or preemption."""

from __future__ import annotations

LIVE_TOKENS = {"fragbench": "fragbench:kv_live_tokens", "sglang": "sglang:num_used_tokens"}


def envelope(family: str | None, samples: list[dict]) -> dict | None:
    """From check's metric samples (each with `raw`, the page summed over labels, `t_s` and `preemptions`);
    None where the server exports no live-token count (vLLM)."""
    live = LIVE_TOKENS.get(family or "")
    rows = [s for s in samples if live and s["raw"].get(live) is not None]
    if not rows:
        return None

    # s: a metric sample of check's (harness/check/measures.Metrics.samples), not /stats: typed with those samples
    def trouble(s: dict) -> tuple[float, float]:  # OOMs (fragbench counts them) and preemptions so far
        return s["raw"].get("fragbench:oom_total", 0.0), s["preemptions"] or 0.0

    start, held, until = trouble(rows[0]), [], "the end of the churn (no OOM or preemption)"
    for s in rows:
        ooms, preemptions = trouble(s)
        if ooms > start[0] or preemptions > start[1]:
            until = f"the first {'OOM' if ooms > start[0] else 'preemption'}, at t={s['t_s']:.1f} s"
            break
        held.append(s["raw"][live])
    return {"live_tokens": int(max(held, default=0)), "until": until}

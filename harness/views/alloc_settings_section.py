"""The report's side-by-side of the caching allocator's settings (bench --compare-alloc-conf, summary.json's
`alloc_settings`): per engine and setting the sustained rate, the share reserved but unallocated and the OOMs by
layer, then one sentence per engine that says what a setting changed against the run's own, and why where the
figures tell it (OOMs all the policy's: no allocator setting can remove them)."""

from __future__ import annotations

from harness.analysis.alloc_settings_summary import figure_change
from harness.analysis.steady import overlap
from harness.analysis.summary_records import AllocSetting, SettingFigures, Summary
from harness.views.allocator_section import classes
from harness.views.html import ESC, fmt, mib, section, table

HOW = ("The engines whose KV the caching allocator places piece by piece (hf's torch.cat buffers, a static "
       "engine's buffer per request) under each PYTORCH_CUDA_ALLOC_CONF setting: the run's own first, every other "
       "a run of its own in the folder named, with the time the run gave the same engines (--time x its engines / "
       "the run's engines), the same requests and budget. Sustained rates with their 90 % intervals (each "
       "setting's own bootstrap); intervals that overlap are no measurable difference. Reserved, unallocated: the "
       "mean share of the KV budget the allocator held from the device but allocated to nothing over the steady "
       "churn. OOMs by layer: the policy's (the live KV and the request pass the cap: no allocator setting helps) "
       "or the allocator's (cached and never-reserved bytes would hold it; no block does).")


def settings_section(summary: Summary) -> str:
    """The section, or "" where the run compared no settings."""
    settings = summary.alloc_settings
    if not settings:
        return ""
    engines = list(settings[0].engines)
    rows = [[e, s.alloc_conf + ("" if s.status == "complete" else f" ({s.status} run)"), *cells(s.engines[e]),
             s.run or "this run"] for e in engines for s in settings]
    said = "".join(f"<li>{ESC(line)}</li>" for e in engines if (line := engine_sentence(e, settings)))
    body = (table(["engine", "setting", "sustained rate (req/s) [90 % CI]", "reserved, unallocated",
                   "OOMs policy / allocator", "peak reserved", "alloc retries", "requests small / large / huge",
                   "run"], rows) + (f"<ul class='verdict'>{said}</ul>" if said else ""))
    return section("alloc-settings", "Allocator settings side by side", HOW, body)


def cells(f: SettingFigures) -> list[str]:
    if not f.served:
        return ["did not serve (its server refused the setting: its log in the run's folder)"] + ["n/a"] * 5
    return [rate(f), fmt(f.reserved_unallocated_share, "%"), layers(f), mib(f.peak_reserved_bytes),
            fmt(f.alloc_retries), classes(f.size_classes)]


def rate(f: SettingFigures) -> str:
    if f.sustained_rps is None:
        return "n/a (no knee measured)"
    ci = f.sustained_rps_ci
    return f"{f.sustained_rps:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")


def layers(f: SettingFigures) -> str:
    return f"{fmt(f.oom_policy)} / {fmt(f.oom_allocator)}"


def engine_sentence(engine: str, settings: list[AllocSetting]) -> str:
    """What each other setting changed for one engine against the first, from the figures alone."""
    base = settings[0].engines[engine]
    parts = [f"{s.alloc_conf}: " + "; ".join(changes(base, s.engines[engine])) for s in settings[1:]
             if s.status != "absent"]
    if not parts:
        return ""
    return f"{engine} against {settings[0].alloc_conf}: " + ". ".join(parts) + why(engine, settings) + "."


def changes(base: SettingFigures, other: SettingFigures) -> list[str]:
    if not other.served:
        return ["it did not serve under this setting (its server refused it at start: the log says why)"]
    out = [rate_change(base, other)]
    a, b = base.reserved_unallocated_share, other.reserved_unallocated_share
    if a is not None and b is not None:
        out.append(figure_change("reserved, unallocated", fmt(a, "%"), fmt(b, "%")))
    out.append(figure_change("allocator-layer OOMs", fmt(base.oom_allocator), fmt(other.oom_allocator)))
    return out


def rate_change(base: SettingFigures, other: SettingFigures) -> str:
    before, after = base.sustained_rps_ci, other.sustained_rps_ci
    if base.sustained_rps is None or other.sustained_rps is None or not before or not after:
        return "sustained rate not compared (no interval)"
    if overlap(before, after):
        return f"no measurable difference in sustained rate ({rate(base)} vs {rate(other)}: the intervals overlap)"
    return figure_change(f"sustained rate {'higher' if after[0] > before[1] else 'lower'},", rate(base), rate(other))


def why(engine: str, settings: list[AllocSetting]) -> str:
    """Where every setting's OOMs were the policy's, the reason no setting could help."""
    figs = [s.engines[engine] for s in settings if s.status != "absent"]
    policy = sum(f.oom_policy or 0 for f in figs)
    if policy and not any(f.oom_allocator for f in figs):
        return (f". Every OOM under every setting ({policy}) was the policy's: the live KV and the request passed "
                "the cap, which no allocator setting changes")
    return ""


def size_rule(summary: Summary) -> str:
    """The size-class rule under --memory caching: this run's model against the reference on the run's requests,
    and which CPU preset the rule picks; "" for another memory."""
    r = summary.size_classes_rule
    if not r:
        return ""
    rows = [[pattern, " / ".join(fmt(s[c], "%") for c in ("small", "large", "huge")),
             " / ".join(fmt(r.reference_shares[pattern][c], "%") for c in ("small", "large", "huge"))]
            for pattern, s in r.shares.items()]
    verdict = ("they match: the emulator meets the sizes a GPU's allocator would" if r.matches else
               "they do not match: on a GPU the allocator would see other sizes, so read this run's allocator "
               "figures as the tiny model's, not a real model's")
    pick = r.rule_picks or "none of the CPU presets"
    return ("<h3>Size classes: this run's model against a real one</h3><p class='how'>"
            + ESC(f"PyTorch's allocator sorts a request by absolute size (small <= 1 MiB, large under 10 MiB, huge), "
                  f"so its figures are a real model's only where the KV allocations fall in a real model's classes. "
                  f"On this run's requests, {r.model} ({r.kv_bytes_per_token / 1024:g} KiB of KV a token) "
                  f"against {r.reference}: largest gap in a class's share {fmt(r.distance, '%')}; {verdict}. "
                  f"The rule: on the CPU, --memory caching runs the CPU preset with the fewest KV bytes a token whose "
                  f"shares are within {fmt(r.tolerance, '%')} of the reference's in every class and pattern; on "
                  f"these requests it picks {pick} (make bench MEMORY=caching's default model).")
            + "</p>" + table(["allocation", "this model: small / large / huge", "reference: small / large / huge"],
                             rows))

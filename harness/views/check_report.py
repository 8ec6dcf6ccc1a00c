"""What `fragbench check` says: its verdict first, then each question with its status, answer and evidence, as
text on the console and as the page `--report` writes."""

from __future__ import annotations

from pathlib import Path

from harness.analysis.gate_verdict import check_verdict
from harness.views.html import STYLE, section, table

# `result`: check's --json object as check builds it (harness/check sits beside views/, on the same level, so views
# cannot import a record of its; tests/test_architecture.py VIEW_DICTS names this one)
STATUSES = ("FAIL", "WARN", "UNKNOWN", "PASS")  # a question's, worst first; the verdict: gate_verdict.check_verdict


def verdict_line(result: dict) -> str:
    """The overall verdict in one line (harness/analysis/gate_verdict.check_verdict: a WARN passes, an UNKNOWN leaves it
    INCONCLUSIVE), and how many questions got each status."""
    counts = {st: sum(q["status"] == st for q in result["questions"]) for st in STATUSES}
    verdict = check_verdict(q["status"] for q in result["questions"])
    tally = ", ".join(f"{n} {st}" for st, n in counts.items() if n)
    return (f"check: {verdict} ({tally}) for {result['target']}, metrics: {result['metrics_found']}"
            + ("; exit 1: a question FAILed" if counts["FAIL"] else ""))


def answer_words(v) -> str:
    """An answer as words, not a Python repr: a mapping's keys keep their units (`server_tokens 4,096`), a number
    is printed plainly, nothing known is 'unknown'."""
    if v is None:
        return "unknown"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, dict):
        return ", ".join(f"{k} {answer_words(x)}" for k, x in v.items()) or "none"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(answer_words(x) for x in v) + "]"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def check_text(result: dict) -> str:
    """The console's check: the verdict, then each question, its answer and its evidence."""
    lines = [verdict_line(result)]
    for q in result["questions"]:
        lines += [f"{q['id']}. [{q['status']}] {q['question']}", f"   answer: {answer_words(q['answer'])}",
                  f"   {q['evidence']}"]
    return "\n".join(lines)


def render_check(result: dict, out: Path) -> Path:
    rows = [[q["id"], q["question"], q["status"], answer_words(q["answer"]), q["evidence"]]
            for q in result["questions"]]
    body = section("verdict", "Pre-deployment check", verdict_line(result) + ".",
                   table(["#", "question", "status", "answer", "evidence"], rows))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>fragbench check</title>"
                   f"<style>{STYLE}</style></head><body><h1>fragbench check</h1>{body}</body></html>")
    return out

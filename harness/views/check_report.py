"""The page `fragbench check --report` writes: each question with its status, answer and evidence."""

from __future__ import annotations

import json
from pathlib import Path

from harness.views.html import STYLE, section, table


# `result`: check's --json object as check builds it (harness/check sits beside views/, on the same level, so views
# cannot import a record of its; tests/test_architecture.py VIEW_DICTS names this one)
def render_check(result: dict, out: Path) -> Path:
    rows = [[q["id"], q["question"], q["status"], json.dumps(q["answer"]), q["evidence"]] for q in result["questions"]]
    body = section("verdict", "Pre-deployment check",
                   f"Target {result['target']}; metrics found: {result['metrics_found']}.",
                   table(["#", "question", "status", "answer", "evidence"], rows))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>fragbench check</title>"
                   f"<style>{STYLE}</style></head><body><h1>fragbench check</h1>{body}</body></html>")
    return out

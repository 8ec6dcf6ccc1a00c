"""The report says each thing once: the answer and what bound each engine in short lines at the top, how each figure
was measured folded under it (<details>), no paragraph of the verdict repeated in the capacity section.
The fixture is summary.json of a recorded `make bench` (be5c217, /work/shared/runs/rival-hf), its twin and its
points' intervals left out."""

import html
import json
import re
from pathlib import Path

import pandas as pd

from harness.analysis.records import RunRecord
from harness.analysis.summary_records import Summary
from harness.views.capacity_section import capacity_section, evidence_sentence, headline_sentence, method_words
from harness.views.html import LONG_HOW, section
from harness.views.verdict import verdict

FIXTURE = Path(__file__).parent / "fixtures" / "runs" / "rival-hf-summary.json"


def page() -> tuple[Summary, str]:
    summary = Summary.model_validate(json.loads(FIXTURE.read_text()))
    meta = RunRecord.of({"config": {"kv_budget": "16MiB", "slo_ttft_s": 2.0}})
    events = pd.DataFrame({"engine": [], "kind": []})
    return summary, verdict(summary, meta, events) + capacity_section(summary)


def text_of(fragment: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", fragment))


def folded(fragment: str) -> str:
    """What <details> hold: the methods, closed until asked for."""
    return " ".join(re.findall(r"<details.*?</details>", fragment, flags=re.S))


def test_each_sentence_is_said_once_and_the_method_is_folded_under_its_figure():
    summary, doc = page()
    text = text_of(doc)
    head = headline_sentence(summary)
    assert text.count(head) == 1  # was in the verdict and again atop the capacity section
    evidence = evidence_sentence(summary)
    assert text.count(evidence) == 1 and evidence in text_of(folded(doc))  # the 14-line paragraph, folded
    assert method_words(summary, None) in text_of(folded(doc))
    assert "How this was measured" in doc and "How these figures were measured" in doc
    top = doc[:doc.index("id='verdict-table'")]
    assert "Each knee is fitted" not in top and "<details" not in top


def test_the_verdict_is_short_lines_one_per_engine_for_what_bound_it():
    summary, doc = page()
    verdict_part = doc[doc.index("<ul class='verdict'>"):doc.index("id='verdict-table'")]
    # each innermost item (a bound line sits in a list of its own under its lead)
    items = [text_of(li) for li in re.findall(r"<li>((?:(?!<li>).)*?)</li>", verdict_part, flags=re.S)]
    bound = [x for x in items if re.match(r"(paged|static-oracle|static-max|hf): (memory|compute|failures) \(", x)]
    assert len(bound) == 4 and bound[0].startswith("paged: memory")  # highest sustained rate first
    assert max(len(x) for x in items) < 400, max(items, key=len)  # no paragraph among them
    assert "What bound each engine at its knee" in text_of(verdict_part)


def test_a_long_section_method_keeps_its_first_sentence_and_folds_the_rest():
    how = "What the figure shows. " + "How it was measured, at length. " * 20
    assert len(how) > LONG_HOW
    out = section("x", "X", how, "<div id='figure'></div>")
    assert out.index("What the figure shows.") < out.index("id='figure'") < out.index("<details")
    assert "How it was measured, at length." in folded(out)
    short = section("y", "Y", "One line.", "")
    assert "<details" not in short and "One line." in short

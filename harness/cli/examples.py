"""What every verb's `--help` ends with: one or two commands a user can copy, and units on the flags' metavars
(SECONDS, BYTES, REQ_PER_S). Applied to the whole parser once it is built (harness/cli/__init__.py), so a verb's
module keeps its flags and a new flag gets its unit by its name."""

from __future__ import annotations

import argparse
import textwrap

from harness.cli.args import DefaultsFormatter

EXAMPLES = {
    "model list": ["fragbench model list"],
    "model build": ["fragbench model build --preset tiny-llama --out models/tiny-llama"],
    "plan": ["fragbench plan --model llama-3-8b --gpu h100-80gb",
             "fragbench plan --model models/tiny-llama --gpu-mem 24GiB --max-seq-len 4096"],
    "generate": ["fragbench generate --engine paged --model models/tiny-llama --prompt 'Hello' --max-tokens 16"],
    "serve": ["fragbench serve --engine paged --model models/tiny-llama --kv-budget 128MiB --port 8000"],
    "workload list": ["fragbench workload list"],
    "workload show": ["fragbench workload show mixed-churn"],
    "workload trace": ["fragbench workload trace mixed-churn --seed 0 --out trace.jsonl"],
    "load": ["fragbench load --target http://localhost:8000 --workload chat-short --duration 30 --out results/load"],
    "bench": ["fragbench bench --engines static-oracle,paged --duration 10",
              "fragbench bench --engines static-oracle,paged --sweep --time 600 --run-id knee"],
    "report": ["fragbench report results/RUN_ID", "fragbench report results/RUN_ID --format csv --out tables/"],
    "compare": ["fragbench compare results/BASE results/NEW --threshold 10"],
    "history": ["fragbench history results --out reports/history.html"],
    "simulate": ["fragbench simulate --model llama-3-8b --gpu h100-80gb --policy paged --workload mixed-churn",
                 "fragbench simulate --model llama-3-8b --gpu h100-80gb --policy paged,static-max --report sim.html"],
    "check": ["fragbench check --target http://localhost:8000 --model llama-3-8b --gpu h100-80gb"],
    "rules": ["fragbench rules --family vllm > rules.yml"],
    "allocator replay": ["fragbench allocator replay snapshot.pickle --capacity 80GiB"],
    "memory-gate": ["fragbench memory-gate HEAD~1 HEAD"],
    "ab": ["fragbench ab HEAD~1 --engines paged --time 600"],
}
SECONDS = {"duration", "grace", "warmup", "kill_after", "slo_ttft", "slo_tpot", "point_duration", "search_time",
           "knee_tolerance", "calibrate_duration", "connect_timeout", "capacity_time", "time", "knee_time"}
UNITS = {**dict.fromkeys(SECONDS, "SECONDS"), "kv_budget": "BYTES", "gpu_mem": "BYTES", "capacity": "BYTES",
         "reserved_growth": "BYTES", "rates": "REQ_PER_S,...", "churn_rps": "REQ_PER_S",
         "preemptions_per_s": "PER_S", "max_seq_len": "TOKENS", "block_size": "TOKENS", "envelope_tokens": "TOKENS",
         "max_tokens": "TOKENS", "threshold": "PERCENT", "hbm_bw": "BYTES_PER_S", "peak_flops": "FLOP_PER_S",
         "gpu_util": "FRACTION", "slo_attainment": "FRACTION", "envelope_share": "FRACTION", "free_below": "FRACTION",
         "untokened_above": "FRACTION", "kv_full": "FRACTION", "top_p": "FRACTION", "seed": "INT",
         "threads": "N", "workers": "N", "points": "N", "jobs": "N", "requests": "N", "max_num_seqs": "N",
         "max_batch": "N", "n": "N", "expect_workers": "N", "point_requests": "N", "fragmentation_ooms": "N",
         "precision": "RATIO", "port": "PORT", "out": "PATH", "reports": "DIR", "model": "PRESET_OR_DIR",
         "workload": "NAME_OR_SPEC", "target": "URL", "metrics_url": "URL", "window": "DURATION"}


class ExamplesFormatter(argparse.RawDescriptionHelpFormatter, DefaultsFormatter):
    """The epilog as written (its examples one a line); every flag's default as DefaultsFormatter says it."""


def epilog(verb: str, before: str | None) -> str:
    said = textwrap.fill(before, 100) + "\n\n" if before else ""
    return said + "examples:\n" + "\n".join(f"  {x}" for x in EXAMPLES[verb])


def with_examples(parser: argparse.ArgumentParser, verb: str = "") -> None:
    """Each verb's parser (and each of a verb's own verbs) gets its examples and its flags their units."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                with_examples(sub, f"{verb} {name}".strip())
        elif action.option_strings and action.nargs != 0 and action.metavar is None and action.dest in UNITS:
            action.metavar = "DIR" if (verb, action.dest) == ("ab", "model") else UNITS[action.dest]
    if verb in EXAMPLES:
        parser.epilog = epilog(verb, parser.epilog)
        parser.formatter_class = ExamplesFormatter

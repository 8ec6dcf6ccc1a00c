"""--kv-budget and --kv-budgets, defined once for every verb that takes a KV budget (bench, serve, generate):
each a KvBudget, its bytes and the label the user wrote, parsed here at the edge and carried typed after."""

from __future__ import annotations

import argparse

from harness.units import KvBudget


def kv_budget_arg(text: str) -> KvBudget:
    """A KV budget as typed (16MiB, 2GiB, 16777216): its bytes and the label the user wrote, parsed here once."""
    try:
        return KvBudget.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def kv_budget_list(text: str) -> list[KvBudget]:
    """Comma-separated budgets, de-duplicated by bytes (16MiB,16777216 is one budget, the first label kept);
    [] for an empty list, which the verb refuses in its own words."""
    parts = text.split(",")
    if not any(part.strip() for part in parts):
        return []
    return list(dict.fromkeys(kv_budget_arg(part) for part in parts))


def add_kv_budget(parser: argparse.ArgumentParser, default: str, help: str) -> None:
    """The one --kv-budget: a KvBudget (kv_budget_arg) every verb that takes a budget reads; `help` says what
    the bytes are for, and the default follows it in words."""
    parser.add_argument("--kv-budget", type=kv_budget_arg, default=KvBudget.parse(default),
                        help=f"{help}, e.g. {default}, 2GiB (default: {default})")


def add_kv_budgets(parser: argparse.ArgumentParser, help: str) -> None:
    """--kv-budgets B1,B2,...: several of --kv-budget's, by bytes (kv_budget_list); None when not given."""
    parser.add_argument("--kv-budgets", type=kv_budget_list, metavar="B1,B2,...", help=help)

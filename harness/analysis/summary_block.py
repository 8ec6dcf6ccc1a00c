"""The base of every block of summary.json (harness/analysis/summary_records.py): a typed record that keeps its
keys in the order they were given, so the file keeps its bytes."""

from __future__ import annotations

from typing import Any

from pydantic import PrivateAttr, SerializerFunctionWrapHandler, model_serializer, model_validator

from harness.analysis.records import Record as JsonRecord


class SummaryBlock(JsonRecord):
    """A block of summary.json: analysis builds it, `written()` gives it back in the order its keys were given
    (at construction, then as set), so the one writer (summary.write_summary) writes the bytes the dicts did."""

    _order: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _keep_order(cls, data: Any, handler) -> Any:
        made = handler(data)
        if isinstance(data, dict) and isinstance(made, SummaryBlock):
            made._order = tuple(data)
        return made

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if not name.startswith("_") and name not in self._order:
            self._order = (*self._order, name)

    @model_serializer(mode="wrap")
    def _in_order(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)
        rank = {k: i for i, k in enumerate(self._order)}
        return dict(sorted(out.items(), key=lambda kv: rank.get(kv[0], len(rank))))

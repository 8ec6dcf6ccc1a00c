"""A JSON object read into a typed record, once, at the boundary where its text arrives (an engine's /stats, run.json,
summary.json): the fields its readers use are typed, what none of them reads rides along (`extra="allow"`), and
the record writes back exactly what it was given. One base for every such record, the server's and the harness's:
harness/analysis/records.py's run.json and summary.json records and engines/api/stats.py's /stats payload."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

Num = int | float  # a figure as its JSON carried it: the union keeps 3 an int and 3.0 a float (pages and journals
# format and write the two apart)


class Record(BaseModel):
    """A JSON object with the fields its readers use typed, the rest kept as they came."""

    model_config = ConfigDict(extra="allow")

    def has(self, name: str) -> bool:
        """Whether the JSON carried this key (a field read as None may be absent or null; a few readers tell)."""
        return name in self.model_fields_set or name in (self.__pydantic_extra__ or {})

    def written(self) -> dict[str, Any]:
        """The object as its JSON had it: no defaults added, absent keys stay absent and nulls stay null."""
        return self.model_dump(exclude_unset=True)

    def figure(self, name: str) -> Any:
        """A figure by its JSON key, None where the JSON lacks it (no default): for the tables and columns that
        copy figures by name."""
        return getattr(self, name) if self.has(name) else None

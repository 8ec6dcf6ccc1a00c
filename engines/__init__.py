"""What serves the traffic: device memory, KV-cache policies, the model runner, schedulers and engines."""

from engines.registry import IN_HOUSE, Kind, names

# The engines by name, read from their one table (engines/registry.py; torch-free, so the CLI can list them
# before it imports anything heavy): `static` is `static-max`, whose --reserve flag picks another reservation.
# ENGINES: served by fragbench's own server; SCHEDULED: fragbench's scheduler over a KV policy; SERVED: what
# `serve` and `bench` start, the in-house engines and the peers. Read from the table when asked, not at import:
# an entry added at start-up (tests/test_registry.py adds a throwaway policy so) is in every list.
_LISTS = {"ENGINES": IN_HOUSE, "SCHEDULED": (Kind.SCHEDULED,), "SERVED": ()}


def __getattr__(name: str) -> tuple[str, ...]:
    if name in _LISTS:
        return names(*_LISTS[name])
    raise AttributeError(f"module 'engines' has no attribute {name!r}")


class UnknownName(ValueError):
    """A name (of an engine, a policy) that is not among those known."""


def pick(text: str, known: tuple[str, ...], flag: str, kind: str) -> list[str]:
    """The names of a comma-separated list, each checked against `known`; `flag` and `kind` word the refusal."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise UnknownName(f"{flag}: unknown {', '.join(unknown) or '(none given)'}; {kind}: {', '.join(known)}")
    return names

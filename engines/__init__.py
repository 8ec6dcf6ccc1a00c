"""What serves the traffic: device memory, KV-cache policies, the model runner, schedulers and engines."""

# The in-house engines by name (torch-free, so the CLI can list them before it imports anything heavy):
# `static` is `static-max`, whose --reserve flag still picks another reservation.
ENGINES = ("hf", "hf-cb", "static", "static-max", "static-pow2", "static-oracle", "growth", "paged")
SCHEDULED = ("static", "static-max", "static-pow2", "static-oracle", "growth", "paged")  # fragbench's scheduler
SERVED = (*ENGINES, "vllm")  # what `serve` and `bench` start: the in-house engines and the vLLM peer


class UnknownName(ValueError):
    """A name (of an engine, a policy) that is not among those known."""


def pick(text: str, known: tuple[str, ...], flag: str, kind: str) -> list[str]:
    """The names of a comma-separated list, each checked against `known`; `flag` and `kind` word the refusal."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise UnknownName(f"{flag}: unknown {', '.join(unknown) or '(none given)'}; {kind}: {', '.join(known)}")
    return names

"""Workload specs (YAML): classes of requests, length distributions, arrivals, churn. Validated strictly:
an unknown key or an impossible value is rejected with its name."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from workloads.traces import ATTRIBUTION, TraceError, detect_format, resolve


class SpecError(ValueError):
    """A spec that cannot be used; the message names the field or file."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LengthDist(Strict):
    dist: Literal["fixed", "uniform", "normal", "lognormal", "empirical"]
    value: int | None = Field(None, ge=1)  # fixed
    low: int | None = Field(None, ge=1)  # uniform
    high: int | None = Field(None, ge=1)
    mean: float | None = Field(None, gt=0)  # normal, lognormal (the mean of the lengths)
    std: float | None = Field(None, ge=0)  # normal
    sigma: float | None = Field(None, ge=0)  # lognormal shape
    trace: str | None = None  # empirical: a trace file...
    column: Literal["input", "output"] | None = None  # ...and which of its lengths
    min: int = Field(1, ge=1)
    max: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _complete(self) -> LengthDist:
        need = {"fixed": ["value"], "uniform": ["low", "high"], "normal": ["mean", "std"],
                "lognormal": ["mean", "sigma"], "empirical": ["trace", "column"]}[self.dist]
        missing = [k for k in need if getattr(self, k) is None]
        if missing:
            raise ValueError(f"a {self.dist} distribution needs {', '.join(missing)}")
        if self.dist == "uniform" and self.low > self.high:
            raise ValueError("low must not exceed high")
        return self


class Cancel(Strict):
    probability: float = Field(ge=0, le=1)
    after_tokens: LengthDist | None = None  # the client closes after k streamed tokens...
    after_s: float | None = Field(None, gt=0)  # ...or after t seconds

    @model_validator(mode="after")
    def _one_trigger(self) -> Cancel:
        if (self.after_tokens is None) == (self.after_s is None):
            raise ValueError("cancel needs exactly one of after_tokens, after_s")
        return self


class SharedPrefix(Strict):
    tokens: int = Field(ge=1)  # system prompt length before scaling
    share: float = Field(ge=0, le=1)  # fraction of the class's requests that carry one
    groups: int = Field(1, ge=1)  # distinct system prompts


class SlowReaders(Strict):
    share: float = Field(ge=0, le=1)
    read_delay_s: float = Field(ge=0)  # per token read


class RequestClass(Strict):
    name: str = Field(min_length=1)
    weight: float = Field(gt=0)
    prompt: LengthDist
    output: LengthDist
    stream: float = Field(1.0, ge=0, le=1)  # share of streaming requests
    slow_readers: SlowReaders | None = None
    cancel: Cancel | None = None
    shared_prefix: SharedPrefix | None = None
    n: int = Field(1, ge=1, le=16)
    temperature: float = Field(0.0, ge=0, le=2)


class Arrival(Strict):
    process: Literal["poisson", "gamma", "closed", "trace"]
    rate: float | None = Field(None, gt=0)  # requests per second (poisson, gamma)
    cv: float | None = Field(None, gt=0)  # gamma: coefficient of variation of inter-arrival times
    concurrency: int | None = Field(None, ge=1)  # closed loop
    time_scale: float = Field(1.0, gt=0)  # trace: multiply the trace's own gaps

    @model_validator(mode="after")
    def _complete(self) -> Arrival:
        need = {"poisson": ["rate"], "gamma": ["rate", "cv"], "closed": ["concurrency"], "trace": []}[self.process]
        missing = [k for k in need if getattr(self, k) is None]
        if missing:
            raise ValueError(f"arrival process {self.process} needs {', '.join(missing)}")
        return self


class TraceSource(Strict):
    path: str
    format: Literal["azure", "mooncake"] | None = None
    start_s: float = Field(0, ge=0)  # skip the trace's first seconds


class Scale(Strict):
    reference_max_seq_len: int = Field(ge=1)  # the context the lengths were drawn for
    rate: float = Field(1.0, gt=0)  # multiply arrival rates (and divide trace gaps)


class WorkloadSpec(Strict):
    name: str
    description: str = ""
    attribution: str = ""
    num_requests: int = Field(200, ge=1)
    max_seq_len: int | None = Field(None, ge=2)  # the context the workload is defined for, when it fixes one
    arrival: Arrival
    classes: list[RequestClass] = Field(default_factory=list)
    trace: TraceSource | None = None  # replay a real trace: its lengths and, with process trace, its times
    scale: Scale | None = None
    stream: float = Field(1.0, ge=0, le=1)  # trace replay: share of streaming requests
    cancel: Cancel | None = None  # trace replay

    @model_validator(mode="after")
    def _source(self) -> WorkloadSpec:
        if not self.classes and self.trace is None:
            raise ValueError("a workload needs classes or a trace")
        if self.arrival.process == "trace" and self.trace is None:
            raise ValueError("arrival process trace needs a trace")
        return self


def preset_names() -> list[str]:
    files = resources.files("workloads").joinpath("presets").iterdir()
    return sorted(f.name.removesuffix(".yaml") for f in files if f.name.endswith(".yaml"))


def _from_dict(data, origin: str, text: str | None = None) -> WorkloadSpec:
    """The spec validated; a refusal names the origin, the line (where the text is at hand) and the field."""
    try:
        return WorkloadSpec.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "spec"
        line = _line_of(text, first["loc"]) if text is not None else None
        at = f" line {line}:" if line else ""
        raise SpecError(f"{origin}:{at} {where}: {first['msg']}") from None


def _line_of(text: str, loc: tuple) -> int | None:
    """The line (1-based) of the field at `loc` in a YAML or JSON text: the deepest key or item of loc found (a
    missing field: the mapping that lacks it)."""
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    line = node.start_mark.line + 1 if node is not None else None
    for key in loc:
        if isinstance(node, yaml.MappingNode):
            node = next((v for k, v in node.value if getattr(k, "value", None) == str(key)), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
        else:
            node = None
        if node is None:
            break
        line = node.start_mark.line + 1
    return line


def _parsed(path: Path, name: str) -> tuple[object, str]:
    """A spec file's data and text: YAML (.yaml, .yml) or JSON (.json); a syntax error in one line, with its line."""
    text = path.read_text()
    if path.suffix == ".json":
        try:
            return json.loads(text), text
        except json.JSONDecodeError as e:
            raise SpecError(f"{name}: line {e.lineno}: not valid JSON: {e.msg}") from None
    try:
        return yaml.safe_load(text), text
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" line {mark.line + 1}:" if mark is not None else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise SpecError(f"{name}:{at} not valid YAML: {what}") from None


SPEC_SUFFIXES = (".yaml", ".yml", ".json")


def _anchored(data, folder: Path):
    """A spec file's relative trace paths (its `trace.path`, an empirical length's `trace`) made absolute against the
    spec's own folder where the file is there: the load generator, which reads the spec again, runs in another
    folder than the user's. Any other path is left as written (the working directory, then the trace folders)."""
    def anchor(holder: dict, key: str) -> None:
        value = holder.get(key)
        if isinstance(value, str) and not Path(value).is_absolute() and (folder / value).is_file():
            holder[key] = str((folder / value).resolve())

    if not isinstance(data, dict):
        return data
    if isinstance(data.get("trace"), dict):
        anchor(data["trace"], "path")
    classes = data.get("classes")
    for cls in classes if isinstance(classes, list) else []:  # another type: the schema names it, line and field
        for part in ("prompt", "output"):
            if isinstance(cls, dict) and isinstance(cls.get(part), dict):
                anchor(cls[part], "trace")
    return data


def load_spec(name: str) -> WorkloadSpec:
    """A preset name, a spec file (YAML, or the same fields as JSON), or a trace file (Azure CSV or Mooncake JSONL,
    either maybe gzipped)."""
    if name in preset_names():
        text = resources.files("workloads").joinpath("presets", f"{name}.yaml").read_text()
        return _from_dict(yaml.safe_load(text), f"preset {name}", text)
    path = Path(name)
    if path.suffix in (".csv", ".jsonl") or path.name.endswith((".csv.gz", ".jsonl.gz")):
        return trace_spec(path)
    if path.suffix in SPEC_SUFFIXES:
        if not path.is_file():
            raise SpecError(f"workload spec not found: {name}")
        data, text = _parsed(path, name)
        return _from_dict(_anchored(data, path.parent), name, text)
    if path.exists():
        raise SpecError(f"workload {name}: a spec is a .yaml, .yml or .json file, a trace a .csv or .jsonl (or .gz); "
                        f"this file is neither")
    raise SpecError(f"unknown workload {name!r}: not a preset ({', '.join(preset_names())}), "
                    "a .yaml or .json spec or a .csv/.jsonl trace")


def trace_spec(path: Path) -> WorkloadSpec:
    """A bare trace file: replay its times and lengths, lengths scaled from an 8k context."""
    try:
        fmt = detect_format(resolve(str(path)))
    except TraceError as e:
        raise SpecError(str(e)) from None
    return WorkloadSpec(
        name=path.name.split(".")[0],
        description=f"replay of {path.name}",
        attribution=ATTRIBUTION[fmt],
        arrival=Arrival(process="trace"),
        trace=TraceSource(path=str(path), format=fmt),
        scale=Scale(reference_max_seq_len=8192),
    )

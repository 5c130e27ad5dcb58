"""Parse one Prometheus text exposition into the server's signals, summed over labels.

prometheus_client's parser reads the text; the families a server kind needs
(wattserve.attach.names) are reduced to plain numbers: gauges and counters summed over
their label sets (vLLM's `engine`/`model_name`, SGLang's `model_name`/ranks), KV use as
the largest of its label sets (a fraction: a sum would exceed 1), histograms as their
cumulative bucket counts summed per bound. A family that is absent or of another type is
named in `missing`, never an exception. This module must not fetch anything nor keep state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from wattserve.attach.names import MetricNames


class ExpositionError(ValueError):
    """The text is not a Prometheus exposition."""


@dataclass(frozen=True)
class Histogram:
    """Cumulative counts per upper bound (ascending, the last is +inf), their sum and count."""

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]
    sum: float
    count: float


@dataclass(frozen=True)
class ServerSample:
    """The server's signals at one scrape. None: the family was missing (see `missing`)."""

    running: float | None = None
    waiting: float | None = None
    ttft: Histogram | None = None
    itl: Histogram | None = None
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    kv_usage: float | None = None
    missing: tuple[str, ...] = field(default_factory=tuple)  # family names not found

    @property
    def complete(self) -> bool:
        return not self.missing


def families(text: str) -> dict[str, tuple[str, list]]:
    """Family name -> (type, samples) of an exposition. Raises ExpositionError."""
    out: dict[str, tuple[str, list]] = {}
    try:
        for fam in text_string_to_metric_families(text):
            out[fam.name] = (fam.type, list(fam.samples))
    except (ValueError, TypeError, IndexError) as e:
        raise ExpositionError(f"not a Prometheus exposition: {e}") from None
    return out


def _summed(samples: list, name: str) -> float | None:
    values = [s.value for s in samples if s.name == name and math.isfinite(s.value)]
    return sum(values) if values else None


def _largest(samples: list, name: str) -> float | None:
    values = [s.value for s in samples if s.name == name and math.isfinite(s.value)]
    return max(values) if values else None


def _histogram(samples: list, family: str) -> Histogram | None:
    per_bound: dict[float, float] = {}
    for s in samples:
        if s.name == f"{family}_bucket" and "le" in s.labels:
            bound = float(s.labels["le"])
            per_bound[bound] = per_bound.get(bound, 0.0) + s.value
    total = _summed(samples, f"{family}_sum")
    count = _summed(samples, f"{family}_count")
    if not per_bound or math.inf not in per_bound or total is None or count is None:
        return None
    bounds = tuple(sorted(per_bound))
    return Histogram(bounds, tuple(per_bound[b] for b in bounds), total, count)


def only_families(text: str, wanted: tuple[str, ...]) -> str:
    """The exposition's lines that belong to the wanted families (a sample's name is the
    family's plus _total/_bucket/...): vLLM's whole exposition is ~80 KB a scrape, and the
    parser is pure Python."""
    out = []
    for line in text.splitlines():
        name = line.split(" ", 3)[2] if line.startswith("# ") and line.count(" ") >= 2 else line
        if name.startswith(wanted):
            out.append(line)
    return "\n".join(out) + "\n"


def read_sample(text: str, names: MetricNames) -> ServerSample:
    """The signals `names` lists, from one exposition. Raises ExpositionError."""
    fams = families(only_families(text, tuple(names.required().values())))
    missing: list[str] = []

    def of_type(family: str, *types: str) -> list | None:
        found = fams.get(family)
        if found is None or found[0] not in types:
            missing.append(family)
            return None
        return found[1]

    def gauge(family: str, reduce=_summed) -> float | None:
        samples = of_type(family, "gauge")
        value = None if samples is None else reduce(samples, family)
        if samples is not None and value is None:
            missing.append(family)
        return value

    def counter(family: str) -> float | None:
        samples = of_type(family, "counter")
        value = None if samples is None else _summed(samples, f"{family}_total")
        if samples is not None and value is None:
            missing.append(family)
        return value

    def histogram(family: str) -> Histogram | None:
        samples = of_type(family, "histogram")
        value = None if samples is None else _histogram(samples, family)
        if samples is not None and value is None:
            missing.append(family)
        return value

    return ServerSample(
        running=gauge(names.running),
        waiting=gauge(names.waiting),
        ttft=histogram(names.ttft),
        itl=histogram(names.itl),
        prompt_tokens_total=counter(names.prompt_tokens),
        generation_tokens_total=counter(names.generation_tokens),
        kv_usage=gauge(names.kv_usage, _largest),
        missing=tuple(missing),
    )

"""One ``/metrics`` text as series, and what changed between two of them (``diagnose``);
the control face's URL as a user types it."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from prometheus_client.parser import text_string_to_metric_families

Labels = frozenset[tuple[str, str]]


def control_url(text: str) -> str:
    """A control face's URL as typed: ``127.0.0.1:9090`` (no scheme) means ``http://…``
    (it was taken as a URL with no host, and reported UNREACHABLE)."""
    text = text.strip().rstrip("/")
    return text if "://" in text else f"http://{text}"


class Scrape:
    """One /metrics text, as ``name → {labels: value}``."""

    def __init__(self, text: str) -> None:
        self.samples: dict[str, dict[Labels, float]] = defaultdict(dict)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                self.samples[sample.name][frozenset(sample.labels.items())] = sample.value

    def series(self, name: str) -> dict[Labels, float]:
        return self.samples.get(name, {})


def label(labels: Labels, name: str) -> str:
    return dict(labels).get(name, "")


def show(name: str, labels: Labels) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels))
    return f"{name}{{{inner}}}" if inner else name


def delta(before: Scrape, after: Scrape, name: str) -> dict[Labels, float]:
    old = before.series(name)
    return {labels: value - old.get(labels, 0.0) for labels, value in after.series(name).items()}


def quantile(buckets: dict[float, float], q: float) -> float | None:
    """The q-quantile of cumulative bucket counts, interpolated as Prometheus does."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank, previous_bound, previous_count = q * total, 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if bound == float("inf"):
                return previous_bound
            share = (rank - previous_count) / max(count - previous_count, 1e-12)
            return previous_bound + (bound - previous_bound) * share
        previous_bound, previous_count = bound, count
    return previous_bound


def histogram_deltas(
    before: Scrape, after: Scrape, name: str, keys: Iterable[str]
) -> dict[tuple[str, ...], dict[float, float]]:
    """Bucket count increases of a histogram, grouped by the labels ``keys``."""
    grouped: dict[tuple[str, ...], dict[float, float]] = defaultdict(lambda: defaultdict(float))
    for labels, increase in delta(before, after, f"{name}_bucket").items():
        key = tuple(label(labels, k) for k in keys)
        grouped[key][float(label(labels, "le"))] += increase
    return grouped

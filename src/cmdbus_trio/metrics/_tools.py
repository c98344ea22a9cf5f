"""What the catalogue's families are used through: a bounded table of subject labels,
remembered children, and the exposition. Never imports trio."""

from __future__ import annotations

import functools
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics import MetricWrapperBase


class SubjectSeries:
    """The label a subject is exported under: its own for the first ``limit`` distinct
    subjects, then ``other`` (each fold counted in ``folds``). Memory and scrape size
    stay bounded whatever pools or event types clients send; the subjects a deployment
    really has come first."""

    def __init__(self, limit: int, folds: Counter, other: str) -> None:
        self.limit = limit
        self.named: set[str] = set()
        self._folds = folds
        self._other = other

    def label(self, subject: str) -> str:
        if subject in self.named:
            return subject
        if len(self.named) < self.limit:
            self.named.add(subject)
            return subject
        self._folds.inc()
        return self._other


@functools.cache
def child(family: MetricWrapperBase, *labels: str) -> Any:
    """``family.labels(*labels)``, remembered: on the request path the lookup cost as much
    as the observation. Only for label values from a fixed set (faces, ops the writer
    knows, outcomes) or a bounded one (a subject's :meth:`SubjectSeries.label`), never
    from a client's input as it is: each one is a series held forever."""
    return family.labels(*labels)


def exposition(
    registry: CollectorRegistry, samples: tuple[str, ...] | None = None
) -> tuple[bytes, str]:
    """The Prometheus text of ``registry`` (only ``samples``, when given), and its
    content type."""
    shown = registry if samples is None else registry.restricted_registry(samples)
    return generate_latest(shown), CONTENT_TYPE_LATEST

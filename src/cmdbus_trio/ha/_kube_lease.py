"""The ``kubernetes:NAMESPACE/NAME`` lease store: a ``coordination.k8s.io/v1`` Lease.

The API server is the store that decides: a write names the ``resourceVersion`` it
read, and the server answers 409 when the Lease changed since. The whole record is one
annotation (:data:`RECORD_ANNOTATION`); ``spec`` carries the holder, the duration, the
renew time and the epoch (as ``leaseTransitions``) too, so ``kubectl get lease`` shows
them. The service account needs ``get``, ``create`` and ``update`` on the Lease, nothing
more.
"""

from __future__ import annotations

import datetime
import json
import math
import urllib.parse
from typing import Any

from cmdbus_trio.storage import refuses_loop_thread

from ._kube_api import KubeAPI, KubeAPIError, refusal
from .lease import LeaseConflict, LeaseError, LeaseRecord, Versioned

RECORD_ANNOTATION = "cmdbus-trio.io/lease-record"


class KubernetesLeaseStore:
    def __init__(self, namespace: str, name: str, api: KubeAPI) -> None:
        self.namespace, self.name = namespace, name
        self.api = api
        self._path = (
            f"/apis/coordination.k8s.io/v1/namespaces/{urllib.parse.quote(namespace)}/leases"
        )

    def describe(self) -> str:
        return f"kubernetes:{self.namespace}/{self.name}"

    @refuses_loop_thread
    def read(self) -> Versioned | None:
        status, body = self._request("GET", f"{self._path}/{urllib.parse.quote(self.name)}")
        if status == 404:
            return None
        if status != 200:
            raise LeaseError(f"cannot read the lease {self.describe()}: {refusal(status, body)}")
        return Versioned(_record_of(body), _version_of(body))

    @refuses_loop_thread
    def write(self, record: LeaseRecord, version: str | None) -> str:
        lease = self._lease(record, version)
        if version is None:
            status, body = self._request("POST", self._path, lease)
        else:
            status, body = self._request("PUT", f"{self._path}/{self.name}", lease)
        if status in (404, 409):  # changed, created meanwhile, or deleted
            raise LeaseConflict(f"the lease {self.describe()} changed ({status})")
        if status not in (200, 201):
            raise LeaseError(f"cannot write the lease {self.describe()}: {refusal(status, body)}")
        return _version_of(body)

    def _lease(self, record: LeaseRecord, version: str | None) -> dict[str, Any]:
        metadata: dict[str, Any] = {
            "name": self.name,
            "namespace": self.namespace,
            "annotations": {RECORD_ANNOTATION: record.encode().decode()},
        }
        if version is not None:
            metadata["resourceVersion"] = version
        spec: dict[str, Any] = {
            "leaseDurationSeconds": math.ceil(record.duration_ms / 1000),
            "leaseTransitions": record.epoch,
            "renewTime": _micro_time(record.renewed_at),
        }
        if record.holder is not None:
            spec["holderIdentity"] = record.holder
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": metadata,
            "spec": spec,
        }

    def _request(
        self, method: str, path: str, body: dict[str, Any] | None = None
    ) -> tuple[int, Any]:
        try:
            return self.api.request(method, path, body)
        except KubeAPIError as exc:
            raise LeaseError(f"the lease {self.describe()}: {exc}") from None


def _record_of(lease: Any) -> LeaseRecord:
    """The record a Lease carries: its annotation, or (a Lease made by hand) its spec."""
    try:
        metadata, spec = lease["metadata"], lease.get("spec") or {}
        annotated = (metadata.get("annotations") or {}).get(RECORD_ANNOTATION)
    except (TypeError, KeyError, AttributeError):
        raise LeaseError("the API answered something that is not a Lease") from None
    if annotated is not None:
        try:
            return LeaseRecord.from_json(json.loads(annotated))
        except ValueError as exc:
            raise LeaseError(
                f"the lease annotation {RECORD_ANNOTATION} is not JSON: {exc}"
            ) from None
    holder = spec.get("holderIdentity") or None
    return LeaseRecord.from_json(
        {
            "holder": holder,
            "epoch": spec.get("leaseTransitions") or 0,
            "duration_ms": (spec.get("leaseDurationSeconds") or 1) * 1000,
            "last_primary": holder,
        }
    )


def _version_of(lease: Any) -> str:
    try:
        version = lease["metadata"]["resourceVersion"]
    except (TypeError, KeyError):
        raise LeaseError("the API answered a Lease without a resourceVersion") from None
    return str(version)


def _micro_time(unix: float) -> str:
    """A Kubernetes MicroTime: RFC 3339 with microseconds, UTC."""
    moment = datetime.datetime.fromtimestamp(unix, datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")

"""The ``kubernetes:NAMESPACE/NAME`` lease store: a ``coordination.k8s.io/v1`` Lease.

The API server is the store that decides: a write names the ``resourceVersion`` it
read, and the server answers 409 when the Lease changed since. The whole record is one
annotation (:data:`RECORD_ANNOTATION`); ``spec`` carries the holder, the duration, the
renew time and the epoch (as ``leaseTransitions``) too, so ``kubectl get lease`` shows
them. The service account needs ``get``, ``create`` and ``update`` on the Lease, nothing
more. The token is read again for each request: bound service-account tokens rotate.
"""

from __future__ import annotations

import datetime
import http.client
import json
import math
import os
import ssl
import urllib.parse
from pathlib import Path
from typing import Any

from cmdbus_trio.storage import refuses_loop_thread

from .lease import LeaseConflict, LeaseError, LeaseRecord, Versioned

RECORD_ANNOTATION = "cmdbus-trio.io/lease-record"
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
REQUEST_TIMEOUT = 2.0
"""Seconds for one request to the API server: a lease renews every third of its
duration (at least 1 s), so a request that hangs longer has missed its turn anyway."""


class KubernetesLeaseStore:
    def __init__(
        self,
        namespace: str,
        name: str,
        api: str,
        *,
        token_file: Path | None = None,
        ca_file: Path | None = None,
        timeout: float = REQUEST_TIMEOUT,
    ) -> None:
        self.namespace, self.name = namespace, name
        url = urllib.parse.urlsplit(api)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"the Kubernetes API address must be http(s)://HOST:PORT: {api!r}")
        self._url = url
        self._token_file = token_file
        self._context = (
            ssl.create_default_context(cafile=ca_file) if url.scheme == "https" else None
        )
        self._timeout = timeout
        self._path = (
            f"/apis/coordination.k8s.io/v1/namespaces/{urllib.parse.quote(namespace)}/leases"
        )

    @classmethod
    def in_cluster(cls, namespace: str, name: str) -> KubernetesLeaseStore:
        """The API server and credentials a pod has (its service account)."""
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        token = SERVICE_ACCOUNT / "token"
        if not host or not token.exists():
            raise ValueError(
                f"CMDBUS_HA_LEASE=kubernetes:{namespace}/{name} needs a pod's service account: "
                "KUBERNETES_SERVICE_HOST is not set or "
                f"{token} is missing (automountServiceAccountToken)"
            )
        address = f"[{host}]" if ":" in host else host
        return cls(
            namespace, name, f"https://{address}:{port}",
            token_file=token, ca_file=SERVICE_ACCOUNT / "ca.crt",
        )  # fmt: skip

    def describe(self) -> str:
        return f"kubernetes:{self.namespace}/{self.name}"

    @refuses_loop_thread
    def read(self) -> Versioned | None:
        status, body = self._request("GET", f"{self._path}/{urllib.parse.quote(self.name)}")
        if status == 404:
            return None
        if status != 200:
            raise self._refused("read", status, body)
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
            raise self._refused("write", status, body)
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
        headers = {"Accept": "application/json"}
        if self._token_file is not None:
            try:
                headers["Authorization"] = f"Bearer {self._token_file.read_text().strip()}"
            except OSError as exc:
                raise LeaseError(f"cannot read the service-account token: {exc}") from None
        payload = None if body is None else json.dumps(body).encode()
        if payload is not None:
            headers["Content-Type"] = "application/json"
        connection = self._connection()
        try:
            connection.request(method, path, body=payload, headers=headers)
            response = connection.getresponse()
            raw = response.read(1 << 20)
        except (OSError, http.client.HTTPException) as exc:
            raise LeaseError(
                f"the lease {self.describe()}: no answer from the API: {exc}"
            ) from None
        finally:
            connection.close()
        try:
            return response.status, json.loads(raw) if raw else None
        except ValueError:
            return response.status, raw[:200].decode(errors="replace")

    def _connection(self) -> http.client.HTTPConnection:
        host, port = self._url.hostname or "", self._url.port
        if self._context is not None:
            return http.client.HTTPSConnection(
                host, port, timeout=self._timeout, context=self._context
            )
        return http.client.HTTPConnection(host, port, timeout=self._timeout)

    def _refused(self, doing: str, status: int, body: Any) -> LeaseError:
        message = body.get("message") if isinstance(body, dict) else body
        return LeaseError(f"cannot {doing} the lease {self.describe()}: {status} {message}")


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

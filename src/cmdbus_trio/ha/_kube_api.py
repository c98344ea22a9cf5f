"""The Kubernetes API as a member uses it: one blocking HTTP request at a time.

Both the ``kubernetes:`` lease store and the pod labels speak through :class:`KubeAPI`.
A pod finds its API server and credentials as client-go's in-cluster configuration does
(``KUBERNETES_SERVICE_HOST``, the service account's files); the directory of those files
is a setting (``CMDBUS_HA_KUBE_SERVICE_ACCOUNT``), so a member outside a cluster (a test,
a host that runs the members beside a cluster) can point at another API server. The token
is read again for each request: bound service-account tokens rotate.
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cmdbus_trio.config import KUBE_SERVICE_ACCOUNT

SERVICE_ACCOUNT = Path(KUBE_SERVICE_ACCOUNT)
REQUEST_TIMEOUT = 2.0
"""Seconds for one request to the API server: a lease renews every third of its
duration (at least 1 s), so a request that hangs longer has missed its turn anyway."""
MAX_ANSWER = 1 << 20
"""Bytes of an answer read at most: a Lease or a pod is a few kilobytes."""


class KubeAPIError(Exception):
    """No answer from the API server, or no credentials to ask it with."""


class KubeAPI:
    def __init__(
        self,
        address: str,
        *,
        token_file: Path | None = None,
        ca_file: Path | None = None,
        timeout: float = REQUEST_TIMEOUT,
    ) -> None:
        url = urllib.parse.urlsplit(address)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"the Kubernetes API address must be http(s)://HOST:PORT: {address!r}")
        self._url = url
        self._token_file = token_file
        self._context = (
            ssl.create_default_context(cafile=ca_file) if url.scheme == "https" else None
        )
        self._timeout = timeout

    @classmethod
    def in_cluster(
        cls, service_account: Path = SERVICE_ACCOUNT, *, environ: Mapping[str, str] | None = None
    ) -> KubeAPI:
        """The API server and credentials of a pod: ``KUBERNETES_SERVICE_HOST`` and
        ``_PORT``, and the token and CA certificate in ``service_account``. ValueError
        saying which is missing."""
        environ = os.environ if environ is None else environ
        host = environ.get("KUBERNETES_SERVICE_HOST")
        port = environ.get("KUBERNETES_SERVICE_PORT", "443")
        token = service_account / "token"
        if not host or not token.exists():
            raise ValueError(
                "needs a pod's service account: KUBERNETES_SERVICE_HOST is not set or "
                f"{token} is missing (automountServiceAccountToken)"
            )
        address = f"[{host}]" if ":" in host else host
        return cls(
            f"https://{address}:{port}", token_file=token, ca_file=service_account / "ca.crt"
        )

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
    ) -> tuple[int, Any]:
        """The status and the decoded answer (its first 200 characters when not JSON).
        :class:`KubeAPIError` when no answer came or the token cannot be read."""
        headers = {"Accept": "application/json"}
        if self._token_file is not None:
            try:
                headers["Authorization"] = f"Bearer {self._token_file.read_text().strip()}"
            except OSError as exc:
                raise KubeAPIError(f"cannot read the service-account token: {exc}") from None
        payload = None if body is None else json.dumps(body).encode()
        if payload is not None:
            headers["Content-Type"] = content_type
        connection = self._connection()
        try:
            connection.request(method, path, body=payload, headers=headers)
            response = connection.getresponse()
            raw = response.read(MAX_ANSWER)
        except (OSError, http.client.HTTPException) as exc:
            raise KubeAPIError(f"no answer from the API: {exc}") from None
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


def refusal(status: int, body: Any) -> str:
    """What the API said, in one line: the status and the Status object's message."""
    message = body.get("message") if isinstance(body, dict) else body
    return f"{status} {message}"

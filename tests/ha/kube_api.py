"""A small Kubernetes API server for the HA tests: Leases and pods' labels, in memory.

It keeps what a lease store relies on: ``resourceVersion`` grows with every write; a
``PUT`` naming another version is answered 409 (Conflict), a ``POST`` of a Lease that
exists 409 (AlreadyExists), a ``GET`` of one that does not 404; a request without the
expected bearer token 401. Pods (added by the test, as a StatefulSet controller would)
take a ``PATCH`` of their labels: a merge patch, or a JSON patch whose ``test`` must hold
(422 when it does not), as the API server applies them. ``pause()`` makes it hold every
request until ``resume()`` (an API server that does not answer). ``serving(api, ca)``
answers over TLS with a certificate of ``ca`` (a trustme CA)."""

from __future__ import annotations

import copy
import itertools
import json
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

PREFIX = "/apis/coordination.k8s.io/v1/namespaces/"
PODS = "/api/v1/namespaces/"


class FakeKubeAPI:
    def __init__(self, token: str | None = None) -> None:
        self.token = token
        self.leases: dict[tuple[str, str], dict[str, Any]] = {}
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.requests: list[tuple[str, str]] = []
        self._versions = itertools.count(100)
        self._lock = threading.Lock()
        self._answering = threading.Event()
        self._answering.set()
        self.url = ""

    def pause(self) -> None:
        self._answering.clear()

    def resume(self) -> None:
        self._answering.set()

    def add_pod(self, namespace: str, name: str) -> None:
        with self._lock:
            self.pods[(namespace, name)] = {"metadata": {"name": name, "labels": {}}}

    def labels(self, namespace: str, name: str) -> dict[str, str]:
        with self._lock:
            return dict(self.pods[(namespace, name)]["metadata"]["labels"])

    def handle(
        self, method: str, path: str, body: Any, token: str | None, content_type: str = ""
    ) -> tuple[int, Any]:
        self._answering.wait()
        self.requests.append((method, path))
        if self.token is not None and token != self.token:
            return 401, _status(401, "Unauthorized")
        if path.startswith(PODS) and not path.startswith(PREFIX):
            return self._pod(method, path[len(PODS) :].split("/"), body, content_type)
        if not path.startswith(PREFIX):
            return 404, _status(404, "not a Lease path")
        parts = path[len(PREFIX) :].split("/")
        if len(parts) not in (2, 3) or parts[1] != "leases":
            return 404, _status(404, "not a Lease path")
        namespace = parts[0]
        with self._lock:
            if method == "GET" and len(parts) == 3:
                lease = self.leases.get((namespace, parts[2]))
                if lease is None:
                    return 404, _status(404, f'leases "{parts[2]}" not found')
                return 200, lease
            if method == "POST" and len(parts) == 2:
                name = body["metadata"]["name"]
                if (namespace, name) in self.leases:
                    return 409, _status(409, f'leases "{name}" already exists')
                return 201, self._store(namespace, name, body)
            if method == "PUT" and len(parts) == 3:
                name = parts[2]
                lease = self.leases.get((namespace, name))
                if lease is None:
                    return 404, _status(404, f'leases "{name}" not found')
                if body["metadata"].get("resourceVersion") != lease["metadata"]["resourceVersion"]:
                    return 409, _status(409, "the object has been modified")
                return 200, self._store(namespace, name, body)
        return 405, _status(405, "method not allowed")

    def _pod(self, method: str, parts: list[str], body: Any, content_type: str) -> tuple[int, Any]:
        if len(parts) != 3 or parts[1] != "pods" or method != "PATCH":
            return 405, _status(405, "only a PATCH of a pod")
        with self._lock:
            pod = self.pods.get((parts[0], parts[2]))
            if pod is None:
                return 404, _status(404, f'pods "{parts[2]}" not found')
            labels = pod["metadata"]["labels"]
            if content_type == "application/merge-patch+json":
                for key, value in body["metadata"]["labels"].items():
                    if value is None:
                        labels.pop(key, None)
                    else:
                        labels[key] = value
                return 200, pod
            if content_type != "application/json-patch+json":
                return 415, _status(415, f"unsupported media type {content_type}")
            changed = dict(labels)
            for op in body:
                prefix = "/metadata/labels/"
                key = op["path"].removeprefix(prefix).replace("~1", "/").replace("~0", "~")
                if op["op"] == "test" and changed.get(key) != op["value"]:
                    return 422, _status(422, f"test of {op['path']} failed")
                if op["op"] in ("replace", "add"):
                    changed[key] = op["value"]
            pod["metadata"]["labels"] = changed
            return 200, pod

    def _store(self, namespace: str, name: str, body: Any) -> dict[str, Any]:
        lease = copy.deepcopy(body)
        lease["metadata"]["resourceVersion"] = str(next(self._versions))
        self.leases[(namespace, name)] = lease
        return lease


def _status(code: int, message: str) -> dict[str, Any]:
    return {"kind": "Status", "status": "Failure", "code": code, "message": message}


@contextmanager
def serving(api: FakeKubeAPI, ca: Any = None) -> Iterator[FakeKubeAPI]:
    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            auth = self.headers.get("Authorization") or ""
            token = auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else None
            kind = self.headers.get("Content-Type") or ""
            status, reply = api.handle(self.command, self.path, body, token, kind)
            raw = json.dumps(reply).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        do_GET = do_POST = do_PUT = do_PATCH = _answer

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    scheme = "http"
    if ca is not None:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("127.0.0.1").configure_cert(context)
        server.socket = context.wrap_socket(server.socket, server_side=True)
        scheme = "https"
    api.url = f"{scheme}://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield api
    finally:
        api.resume()
        server.shutdown()
        server.server_close()

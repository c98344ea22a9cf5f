"""The pods' role labels (cmdbus_trio/ha/_kube_pods.py) against the fake API server,
the Kubernetes API client over TLS with a pod's credentials, and the loop that keeps a
member's label in step with its role."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
import trustme

from cmdbus_trio import metrics
from cmdbus_trio.ha import _kube_pods
from cmdbus_trio.ha._kube_api import KubeAPI
from cmdbus_trio.ha._kube_pods import (
    ROLE_LABEL,
    PodLabelError,
    PodLabels,
    keep_labelled,
)
from cmdbus_trio.ha.lease import open_lease_store

from .kube_api import FakeKubeAPI, serving


def service_account(tmp_path: Path, ca: trustme.CA, token: str = "secret") -> Path:
    """A pod's service-account directory."""
    folder = tmp_path / "serviceaccount"
    folder.mkdir()
    (folder / "token").write_text(token + "\n")
    ca.cert_pem.write_to_path(str(folder / "ca.crt"))
    return folder


def test_a_member_labels_its_pod_and_relabels_only_a_pod_still_primary(tmp_path: Path) -> None:
    ca = trustme.CA()
    with serving(FakeKubeAPI(token="secret"), ca) as api:
        api.add_pod("shard", "m-0")
        api.add_pod("shard", "m-1")
        host, port = api.url.removeprefix("https://").split(":")
        environ = {"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port}
        api_client = KubeAPI.in_cluster(service_account(tmp_path, ca), environ=environ)
        labels = PodLabels(api_client, "shard")
        labels.set_role("m-0", "primary")
        labels.set_role("m-1", "standby")
        assert api.labels("shard", "m-0") == {ROLE_LABEL: "primary"}
        assert labels.replace_primary("m-0") is True
        assert api.labels("shard", "m-0") == {ROLE_LABEL: "replaced"}
        # Not primary (the member relabelled itself meanwhile): nothing changes.
        assert labels.replace_primary("m-1") is False
        assert api.labels("shard", "m-1") == {ROLE_LABEL: "standby"}
        assert labels.replace_primary("gone") is False  # a pod deleted: nothing to do
        with pytest.raises(PodLabelError, match='cannot label the pod shard/gone: 404 pods "gone"'):
            labels.set_role("gone", "primary")


def test_a_refused_or_unanswered_label_says_why(tmp_path: Path) -> None:
    ca = trustme.CA()
    with serving(FakeKubeAPI(token="secret"), ca) as api:
        api.add_pod("shard", "m-0")
        host, port = api.url.removeprefix("https://").split(":")
        environ = {"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port}
        wrong = PodLabels(
            KubeAPI.in_cluster(service_account(tmp_path, ca, "wrong"), environ=environ), "shard"
        )
        with pytest.raises(PodLabelError, match="cannot label the pod shard/m-0: 401 Unauthorized"):
            wrong.set_role("m-0", "primary")
        # A CA that did not sign the server's certificate: no answer, and why.
        other = tmp_path / "other"
        other.mkdir()
        trustme.CA().cert_pem.write_to_path(str(other / "ca.crt"))
        (other / "token").write_text("secret")
        untrusted = PodLabels(KubeAPI.in_cluster(other, environ=environ), "shard")
        with pytest.raises(PodLabelError, match=r"no answer from the API: .*CERTIFICATE_VERIFY"):
            untrusted.set_role("m-0", "primary")
        assert api.labels("shard", "m-0") == {}


def test_a_kubernetes_lease_uses_the_service_account_directory_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca = trustme.CA()
    with serving(FakeKubeAPI(token="secret"), ca) as api:
        host, port = api.url.removeprefix("https://").split(":")
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", host)
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", port)
        store = open_lease_store("kubernetes:shard/lease-0", service_account(tmp_path, ca))
        assert store.read() is None  # asked over TLS, with the token: answered
        with pytest.raises(ValueError, match=r"CMDBUS_HA_LEASE=kubernetes:shard/lease-0 needs"):
            open_lease_store("kubernetes:shard/lease-0", tmp_path / "nowhere")


class Recorded:
    """PodLabels as the loop sees it: the calls, and refusals on demand."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.refuse = 0

    def _maybe_refuse(self) -> None:
        if self.refuse:
            self.refuse -= 1
            raise PodLabelError("cannot label the pod ns/x: 403 forbidden")

    def set_role(self, pod: str, role: str) -> None:
        self._maybe_refuse()
        self.calls.append((pod, role))

    def replace_primary(self, pod: str) -> bool:
        self._maybe_refuse()
        self.calls.append((pod, "replaced"))
        return True


async def direct(fn: Callable[[], Any]) -> Any:
    return fn()


async def test_the_label_follows_the_role_and_a_refusal_is_tried_again(
    mock_clock: trio.testing.MockClock,
) -> None:
    """A refused label is retried after RETRY_EVERY; a role change relabels at once; a
    replaced member is relabelled once per epoch; an idle member asks nothing."""
    mock_clock.autojump_threshold = 0
    labels = Recorded()
    state: dict[str, Any] = {"role": "starting", "replaced": None}
    changed = trio.Event()
    labels.refuse = 2
    failures = metrics.HA_POD_LABEL_FAILURES._value.get()

    async def wait_changed() -> None:
        await changed.wait()

    def change(**values: Any) -> None:
        nonlocal changed
        state.update(values)
        changed.set()
        changed = trio.Event()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            keep_labelled, labels, "m-1", lambda: (state["role"], state["replaced"]),
            wait_changed, direct,
        )  # fmt: skip
        await trio.sleep(_kube_pods.RETRY_EVERY * 2 - 0.01)
        assert labels.calls == []  # two refusals, a second apart
        await trio.sleep(0.02)
        assert labels.calls == [("m-1", "starting")]
        assert metrics.HA_POD_LABEL_FAILURES._value.get() == failures + 2
        await trio.sleep(_kube_pods.RECHECK_EVERY * 10)  # idle: nothing asked again
        assert labels.calls == [("m-1", "starting")]
        change(role="primary", replaced=("m-0", 4))
        await trio.sleep(0.001)
        assert labels.calls[1:] == [("m-1", "primary"), ("m-0", "replaced")]
        await trio.sleep(_kube_pods.RECHECK_EVERY * 3)
        change(role="standby", replaced=None)
        await trio.sleep(0.001)
        change(role="primary", replaced=("m-0", 4))  # the same term: not again
        await trio.sleep(_kube_pods.RECHECK_EVERY * 2)
        change(role="primary", replaced=("m-0", 6))  # a later term: again
        await trio.sleep(0.001)
        assert labels.calls[3:] == [("m-1", "standby"), ("m-1", "primary"), ("m-0", "replaced")]
        nursery.cancel_scope.cancel()

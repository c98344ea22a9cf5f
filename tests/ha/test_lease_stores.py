"""The lease stores' contract (cmdbus_trio/ha/lease.py), one suite for both: the
``file:`` store and the ``kubernetes:`` store against a fake API server that answers
409 on a stale resourceVersion. Compare-and-swap is what keeps one primary, so each
test writes as two members would."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from cmdbus_trio import metrics
from cmdbus_trio.ha import _file_lease
from cmdbus_trio.ha._file_lease import FileLeaseStore
from cmdbus_trio.ha._kube_api import KubeAPI
from cmdbus_trio.ha._kube_lease import RECORD_ANNOTATION, KubernetesLeaseStore
from cmdbus_trio.ha.lease import (
    LeaseConflict,
    LeaseError,
    LeaseRecord,
    LeaseStore,
    open_lease_store,
)
from cmdbus_trio.storage import LoopThreadError

from .kube_api import FakeKubeAPI, serving


def record(holder: str | None = "a", epoch: int = 1, **fields: object) -> LeaseRecord:
    return LeaseRecord(holder=holder, epoch=epoch, duration_ms=5000, **fields)  # type: ignore[arg-type]


@pytest.fixture(params=["file", "kubernetes"])
def stores(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[LeaseStore, LeaseStore]]:
    """Two members' views of one lease."""
    if request.param == "file":
        yield FileLeaseStore(tmp_path / "lease"), FileLeaseStore(tmp_path / "lease")
        return
    token = tmp_path / "token"
    token.write_text("secret\n")
    with serving(FakeKubeAPI(token="secret")) as api:
        yield (
            KubernetesLeaseStore("shard", "cmdbus-0", KubeAPI(api.url, token_file=token)),
            KubernetesLeaseStore("shard", "cmdbus-0", KubeAPI(api.url, token_file=token)),
        )


def test_an_empty_store_has_no_record_and_creating_it_twice_conflicts(
    stores: tuple[LeaseStore, LeaseStore],
) -> None:
    a, b = stores
    assert a.read() is None
    version = a.write(record("a", faces={"ha": "127.0.0.1:1"}), None)
    read = b.read()
    assert read is not None and read.version == version
    assert read.record == record("a", faces={"ha": "127.0.0.1:1"})
    with pytest.raises(LeaseConflict):
        b.write(record("b"), None)
    assert b.read() == read


def test_of_two_writes_on_one_version_one_wins(stores: tuple[LeaseStore, LeaseStore]) -> None:
    a, b = stores
    first = a.write(record("a"), None)
    won = a.write(record("a", epoch=1, in_sync="b"), first)
    with pytest.raises(LeaseConflict):
        b.write(record("b", epoch=2), first)
    current = b.read()
    assert current is not None and current.version == won
    assert current.record.holder == "a" and current.record.in_sync == "b"
    assert b.write(record("b", epoch=2), won) != won  # on the version it read: it wins


def test_a_version_long_gone_still_conflicts(stores: tuple[LeaseStore, LeaseStore]) -> None:
    """More writes than the file store keeps, then a member that slept through them."""
    a, b = stores
    version = a.write(record(epoch=1), None)
    stale = version
    for epoch in range(2, _file_lease.KEPT + 5):
        version = a.write(record(epoch=epoch), version)
    with pytest.raises(LeaseConflict):
        b.write(record("b", epoch=99), stale)
    current = a.read()
    assert current is not None and current.record.epoch == _file_lease.KEPT + 4
    assert current.version == version


def test_members_racing_lose_no_update(stores: tuple[LeaseStore, LeaseStore]) -> None:
    """Four threads (two per member) read and write the epoch + 1 as fast as they can:
    the final epoch is the number of writes that won."""
    a, b = stores
    a.write(record(epoch=0), None)
    won = [0, 0, 0, 0]

    def member(store: LeaseStore, index: int) -> None:
        for _ in range(25):
            current = store.read()
            assert current is not None
            try:
                store.write(record(epoch=current.record.epoch + 1), current.version)
                won[index] += 1
            except LeaseConflict:
                pass

    threads = [threading.Thread(target=member, args=(s, i)) for i, s in enumerate([a, b, a, b])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    final = a.read()
    assert final is not None and final.record.epoch == sum(won) and sum(won) >= 25


async def test_the_stores_refuse_the_loop_thread(stores: tuple[LeaseStore, LeaseStore]) -> None:
    a, _ = stores
    with pytest.raises(LoopThreadError):
        a.read()
    with pytest.raises(LoopThreadError):
        a.write(record(), None)
    assert await trio.to_thread.run_sync(a.read) is None  # in a thread, it answers
    # These calls block deliberately; take them back out so the session check holds.
    for entry in (f"{type(a).__name__}.read", f"{type(a).__name__}.write"):
        metrics.LOOP_BLOCKING_CALLS.remove(entry)
        metrics.LOOP_BLOCKING_CALLS.labels(entry=entry)


def test_a_malformed_record_is_an_error_naming_the_field(tmp_path: Path) -> None:
    store = FileLeaseStore(tmp_path / "lease")
    store.write(record(), None)
    (tmp_path / "lease" / "v00000000000000000002").write_text('{"holder": 1}')
    with pytest.raises(LeaseError, match="unknown or missing fields"):
        store.read()
    (tmp_path / "lease" / "v00000000000000000003").write_text(
        '{"holder": 1, "epoch": 1, "duration_ms": 5}'
    )
    with pytest.raises(LeaseError, match="holder is not a name or null"):
        store.read()
    (tmp_path / "lease" / "v00000000000000000004").write_text(
        '{"holder": null, "epoch": 1, "duration_ms": 5, "faces": {"ha": 7000}}'
    )
    with pytest.raises(LeaseError, match="faces are not addresses"):
        store.read()
    (tmp_path / "lease" / "v00000000000000000004").write_text("{not json")
    with pytest.raises(LeaseError, match="v4 is not JSON"):
        store.read()
    (tmp_path / "lease" / "v00000000000000000005").write_text(
        '{"holder": null, "epoch": -1, "duration_ms": 5}'
    )
    with pytest.raises(LeaseError, match="out of range"):
        store.read()


def test_a_member_stopped_mid_write_holds_nothing(tmp_path: Path) -> None:
    """What a member stopped between its temporary file and the link leaves: a file
    nobody reads, removed once its process is gone."""
    store = FileLeaseStore(tmp_path / "lease")
    version = store.write(record(), None)
    stopped = tmp_path / "lease" / ".tmp-999999999-abcd"  # no such process
    stopped.write_bytes(record("ghost").encode()[:7])  # half written
    current = store.read()
    assert current is not None and current.record.holder == "a"
    store.write(record("b", epoch=2), version)
    assert not stopped.exists()


def test_a_file_store_where_nothing_can_be_written_says_so(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    store = FileLeaseStore(blocker / "lease")
    with pytest.raises(LeaseError, match="cannot create the lease file:"):
        store.write(record(), None)


def test_the_kubernetes_lease_shows_holder_and_epoch_to_kubectl(tmp_path: Path) -> None:
    with serving(FakeKubeAPI()) as api:
        store = KubernetesLeaseStore("shard", "cmdbus-0", KubeAPI(api.url))
        store.write(record("a", epoch=3, renewed_at=1_790_000_000.25), None)
        lease = api.leases[("shard", "cmdbus-0")]
        assert lease["spec"] == {
            "holderIdentity": "a",
            "leaseDurationSeconds": 5,
            "leaseTransitions": 3,
            "renewTime": "2026-09-21T14:13:20.250000Z",
        }
        assert RECORD_ANNOTATION in lease["metadata"]["annotations"]
        # A Lease made by hand (no annotation): read from its spec.
        del lease["metadata"]["annotations"]
        current = store.read()
        assert current is not None
        assert current.record == LeaseRecord("a", 3, 5000, last_primary="a")


def test_the_kubernetes_store_says_what_the_api_answered(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("wrong")
    with serving(FakeKubeAPI(token="secret")) as api:
        store = KubernetesLeaseStore("shard", "cmdbus-0", KubeAPI(api.url, token_file=token))
        with pytest.raises(
            LeaseError, match="cannot read the lease kubernetes:shard/cmdbus-0: 401 Unauthorized"
        ):
            store.read()
        token.unlink()
        with pytest.raises(LeaseError, match="cannot read the service-account token"):
            store.read()
    token.write_text("secret")
    with pytest.raises(LeaseError, match="no answer from the API"):
        store.read()  # the server is gone


def test_an_api_server_that_does_not_answer_is_an_error_after_the_timeout() -> None:
    """The timeout (0.3 s) is shorter than the pause (until the test resumes it)."""
    with serving(FakeKubeAPI()) as api:
        store = KubernetesLeaseStore("shard", "cmdbus-0", KubeAPI(api.url, timeout=0.3))
        api.pause()
        with pytest.raises(LeaseError, match="no answer from the API"):
            store.read()
        api.resume()
        assert store.read() is None


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "CMDBUS_HA_LEASE must be file:PATH or kubernetes:NAMESPACE/NAME, not ''"),
        ("file:", "not 'file:'"),
        ("/tmp/lease", "not '/tmp/lease'"),
        ("kubernetes:onlyname", "not 'kubernetes:onlyname'"),
        ("kubernetes:a/b/c", "not 'kubernetes:a/b/c'"),
        ("kubernetes:/b", "not 'kubernetes:/b'"),
        ("etcd:x", "not 'etcd:x'"),
    ],
)
def test_a_lease_setting_of_another_form_names_the_setting(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        open_lease_store(spec)


def test_a_kubernetes_lease_outside_a_cluster_says_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ValueError, match="needs a pod's service account: KUBERNETES_SERVICE_HOST"):
        open_lease_store("kubernetes:shard/cmdbus-0")
    assert isinstance(open_lease_store(f"file:{tmp_path}/lease"), FileLeaseStore)


def test_a_member_paused_between_its_check_and_its_link_conflicts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Member b checks that v1 is there, then sleeps (as if stopped) while a writes more
    versions than are kept, so v2 is gone when b links its own v2: nobody would read
    it, so b must not believe it wrote."""
    a, b = FileLeaseStore(tmp_path / "lease"), FileLeaseStore(tmp_path / "lease")
    first = a.write(record(epoch=1), None)
    link = _file_lease.os.link
    paused = []

    def slow_link(source: str, target: str) -> None:
        if not paused:
            paused.append(target)
            version = first
            for epoch in range(2, _file_lease.KEPT + 4):
                version = a.write(record(epoch=epoch), version)
        link(source, target)

    monkeypatch.setattr(_file_lease.os, "link", slow_link)
    with pytest.raises(LeaseConflict):
        b.write(record("b", epoch=99), first)
    current = a.read()
    assert current is not None and current.record.epoch == _file_lease.KEPT + 3
    assert not Path(paused[0]).exists()

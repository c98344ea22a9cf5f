"""The members' pods labelled with their roles (``CMDBUS_HA_POD_LABELS``).

A shard's client Service selects the pod labelled ``cmdbus-trio.io/role: primary``, so
it reaches only the primary. Each member labels its own pod with its role as it changes;
a member that takes over relabels the pod of the member it replaced, only while that
pod still says ``primary`` (a JSON patch with a ``test``), so a dead primary's pod
leaves the Service at once, not when its node is found gone a minute later, and a live
one's own newer label is never overwritten.

The label routes clients; it decides nothing. A pod labelled primary by mistake (for
the instant before a relabel) is a member that answers ``unavailable`` and names the
primary, as any standby does. The service account needs ``patch`` on the shard's two
pods, nothing more.
"""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import trio

from cmdbus_trio import metrics
from cmdbus_trio.logs import event
from cmdbus_trio.storage import refuses_loop_thread

from ._kube_api import KubeAPI, KubeAPIError, refusal

log = logging.getLogger(__name__)

ROLE_LABEL = "cmdbus-trio.io/role"
PRIMARY = "primary"
REPLACED = "replaced"
"""The label of a primary's pod after another member took the lease from it: it is not
primary, and may be gone (its own label, once it is back, says what it is)."""


class PodLabelError(Exception):
    """A pod's label could not be set: the API refused, or did not answer."""


class PodLabels:
    def __init__(self, api: KubeAPI, namespace: str) -> None:
        self.api = api
        self.namespace = namespace
        self._path = f"/api/v1/namespaces/{urllib.parse.quote(namespace)}/pods/"

    @refuses_loop_thread
    def set_role(self, pod: str, role: str) -> None:
        """Label ``pod`` with ``role``."""
        patch = {"metadata": {"labels": {ROLE_LABEL: role}}}
        self._patch(pod, patch, "application/merge-patch+json")

    @refuses_loop_thread
    def replace_primary(self, pod: str) -> bool:
        """Label ``pod`` :data:`REPLACED` if it is labelled primary now; False when it
        was not (or is gone): nothing changed."""
        path = "/metadata/labels/" + ROLE_LABEL.replace("~", "~0").replace("/", "~1")
        patch = [
            {"op": "test", "path": path, "value": PRIMARY},
            {"op": "replace", "path": path, "value": REPLACED},
        ]
        return self._patch(pod, patch, "application/json-patch+json", unless=(404, 422))

    def _patch(
        self, pod: str, patch: object, content_type: str, unless: tuple[int, ...] = ()
    ) -> bool:
        where = f"the pod {self.namespace}/{pod}"
        try:
            status, body = self.api.request(
                "PATCH", self._path + urllib.parse.quote(pod), patch, content_type=content_type
            )
        except KubeAPIError as exc:
            raise PodLabelError(f"cannot label {where}: {exc}") from None
        if status in unless:
            return False
        if status != 200:
            raise PodLabelError(f"cannot label {where}: {refusal(status, body)}")
        return True


RETRY_EVERY = 1.0
"""Seconds between attempts at a label the API refused or did not answer."""
RECHECK_EVERY = 0.5
"""Seconds at most between looks at the role, when nothing wakes the loop sooner (a
primary's lease that lapsed by its own clock changes its role with no event)."""


async def keep_labelled(
    labels: PodLabels,
    pod: str,
    wanted: Callable[[], tuple[str, tuple[str, int] | None]],
    changed: Callable[[], Awaitable[None]],
    offload: Callable[[Callable[[], Any]], Awaitable[Any]],
) -> None:
    """Keep ``pod`` labelled with this member's role, and relabel the pod it took the
    lease from, until cancelled. ``wanted()`` is the role now and, on a primary, the
    member it replaced with the epoch it took the lease in; ``changed()`` returns when
    they may have changed. A refused label is logged, counted and tried again."""
    labelled: str | None = None
    replaced: tuple[str, int] | None = None
    while True:
        role, previous = wanted()
        try:
            if role != labelled:
                await offload(partial(labels.set_role, pod, role))
                labelled = role
            if previous is not None and previous != replaced:
                await offload(partial(labels.replace_primary, previous[0]))
                replaced = previous
        except PodLabelError as exc:
            event(log, logging.WARNING, "pod_label_failed", error=str(exc))
            metrics.HA_POD_LABEL_FAILURES.inc()
            await trio.sleep(RETRY_EVERY)
            continue
        with trio.move_on_after(RECHECK_EVERY):
            await changed()

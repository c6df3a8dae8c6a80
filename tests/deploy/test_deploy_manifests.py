"""The kustomize overlays render, validate offline against the Kubernetes schemas, and have the properties
fedmq's deployment promises (probes, GPU requests, non-root pods, one Secret per agent, broker config)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from fedmq.aggregator.config import JobConfig
from fedmq.client_agent.availability import Markov, parse_availability

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
K8S_VERSION = "1.32"  # kubectl here is 1.32; the strict schemas reject unknown fields
RABBITMQ_CLUSTER_SCHEMA = json.loads((HERE / "schemas" / "rabbitmqcluster-v1beta1.json").read_text())
WORKLOADS = ("Deployment", "StatefulSet", "Job")

Obj = dict[str, Any]


def find(objs: list[Obj], kind: str, name: str) -> Obj:
    hits = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(hits) == 1, f"expected one {kind}/{name}, found {len(hits)}"
    return hits[0]


def find_prefix(objs: list[Obj], kind: str, prefix: str) -> Obj:
    """Generated ConfigMaps carry a content hash suffix."""
    hits = [o for o in objs if o["kind"] == kind and o["metadata"]["name"].startswith(prefix)]
    assert len(hits) == 1, f"expected one {kind}/{prefix}*, found {len(hits)}"
    return hits[0]


def pod_spec(obj: Obj) -> Obj:
    return obj["spec"]["template"]["spec"]


def containers(obj: Obj) -> Iterator[Obj]:
    spec = pod_spec(obj)
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


def container(obj: Obj, name: str) -> Obj:
    hits = [c for c in containers(obj) if c["name"] == name]
    assert len(hits) == 1
    return hits[0]


def env(c: Obj) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in c.get("env", [])}


def flag(args: list[str], name: str) -> str:
    assert name in args, f"{name} missing from {args}"
    return args[args.index(name) + 1]


def validate_object(obj: Obj) -> None:
    if obj["kind"] == "RabbitmqCluster":
        # kubernetes-validate ships only the built-in kinds; the operator's CRD is checked against a small
        # vendored subset schema (tests/deploy/schemas) instead of the 100 kB upstream CRD.
        jsonschema.validate(obj, RABBITMQ_CLUSTER_SCHEMA)
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


# --- rendering and schemas ---------------------------------------------------------------------------------


def test_every_overlay_renders_the_whole_federation(rendered: dict[str, list[Obj]]) -> None:
    for name, objs in rendered.items():
        kinds = {(o["kind"], o["metadata"]["name"]) for o in objs}
        for must in [
            ("Namespace", "fedmq"),
            ("Job", "fedmq-provision"),
            ("Deployment", "fedmq-aggregator"),
            ("StatefulSet", "fedmq-agent"),
            ("NetworkPolicy", "default-deny-all"),
            ("PersistentVolumeClaim", "fedmq-checkpoints"),
            ("Role", "fedmq-provision"),
        ]:
            assert must in kinds, f"{name}: {must} missing"
        for o in objs:
            if o["kind"] != "Namespace":
                assert o["metadata"].get("namespace") == "fedmq", (
                    f"{name}: {o['kind']}/{o['metadata']['name']}"
                )
            assert o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "fedmq"


def test_every_object_validates_against_the_kubernetes_schemas(rendered: dict[str, list[Obj]]) -> None:
    checked = 0
    for name, objs in rendered.items():
        for obj in objs:
            try:
                validate_object(obj)
            except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as exc:
                pytest.fail(
                    f"{name}: {obj['kind']}/{obj['metadata']['name']}: "
                    f"{'.'.join(map(str, exc.path))}: {exc.message}"
                )
            checked += 1
    assert checked >= 3 * 20


def test_the_validators_reject_broken_objects(rendered: dict[str, list[Obj]]) -> None:
    """The offline validation is not a rubber stamp: a typo or a wrong type is caught."""
    deploy = json.loads(json.dumps(find(rendered["gpu"], "Deployment", "fedmq-aggregator")))
    deploy["spec"]["replica"] = 2  # typo
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_object(deploy)
    sts = json.loads(json.dumps(find(rendered["gpu"], "StatefulSet", "fedmq-agent")))
    sts["spec"]["replicas"] = "four"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_object(sts)
    cluster = json.loads(json.dumps(find(rendered["gpu"], "RabbitmqCluster", "fedmq-rabbitmq")))
    cluster["spec"]["tls"]["disableNonTLSListener"] = True
    with pytest.raises(jsonschema.ValidationError):
        validate_object(cluster)


# --- RabbitMQ ----------------------------------------------------------------------------------------------


def conf_values(text: str) -> dict[str, str]:
    """rabbitmq.conf (sysctl format) -> key: value, comments dropped."""
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def assert_fedmq_broker_settings(conf: dict[str, str]) -> None:
    # fedmq chunks at 8 MiB: the limit must admit a chunk plus its envelope, and stay at or under 3.x's cap.
    assert 8 * 2**20 < int(conf["max_message_size"]) <= 128 * 2**20
    assert int(conf["consumer_timeout"]) >= 2 * 3600 * 1000  # rounds can exceed the 30 min default
    assert conf["heartbeat"] == "30"


def test_operator_cluster_has_three_persistent_tls_replicas_and_fedmq_config(
    rendered: dict[str, list[Obj]],
) -> None:
    for name in ("gpu", "chaos"):
        spec = find(rendered[name], "RabbitmqCluster", "fedmq-rabbitmq")["spec"]
        assert spec["replicas"] == 3
        assert re.fullmatch(r"rabbitmq:\d+\.\d+\.\d+-management", spec["image"])
        assert spec["persistence"]["storage"].endswith("Gi")
        assert spec["tls"] == {
            "secretName": "fedmq-rabbitmq-tls",
            "caSecretName": "fedmq-rabbitmq-ca",
            "disableNonTLSListeners": True,
        }
        assert_fedmq_broker_settings(conf_values(spec["rabbitmq"]["additionalConfig"]))


def test_plain_statefulset_broker_replaces_the_operator_in_dev(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["dev"]
    assert not [o for o in objs if o["kind"] == "RabbitmqCluster"]
    sts = find(objs, "StatefulSet", "fedmq-rabbitmq")
    assert (
        sts["spec"]["replicas"] == 1 and sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    )
    conf = conf_values(find_prefix(objs, "ConfigMap", "fedmq-rabbitmq-config")["data"]["rabbitmq.conf"])
    assert_fedmq_broker_settings(conf)
    assert conf["listeners.tcp"] == "none" and conf["listeners.ssl.default"] == "5671"
    service = find(objs, "Service", "fedmq-rabbitmq")
    assert {p["port"] for p in service["spec"]["ports"]} >= {5671, 15671}
    # the component offers the operator's names, so nothing else in the federation changes
    assert service["spec"]["selector"] == {"app.kubernetes.io/name": "fedmq-rabbitmq"}
    # the component at its full size is still 3 nodes (dev scales it down)
    assert (
        "replicas: 3" in (ROOT / "k8s" / "components" / "rabbitmq-statefulset" / "rabbitmq.yaml").read_text()
    )


# --- workloads ---------------------------------------------------------------------------------------------


def test_every_pod_runs_non_root_read_only_without_privilege_escalation(
    rendered: dict[str, list[Obj]],
) -> None:
    for name, objs in rendered.items():
        for obj in (o for o in objs if o["kind"] in WORKLOADS):
            where = f"{name}: {obj['kind']}/{obj['metadata']['name']}"
            pod_sc = pod_spec(obj)["securityContext"]
            assert pod_sc["runAsNonRoot"] is True and pod_sc["runAsUser"] > 0, where
            assert pod_sc["seccompProfile"]["type"] == "RuntimeDefault", where
            for c in containers(obj):
                sc = c["securityContext"]
                assert sc["allowPrivilegeEscalation"] is False, f"{where}/{c['name']}"
                assert sc["readOnlyRootFilesystem"] is True, f"{where}/{c['name']}"
                assert sc["capabilities"]["drop"] == ["ALL"], f"{where}/{c['name']}"
                assert sc.get("privileged", False) is False
                res = c["resources"]
                assert {"cpu", "memory"} <= set(res["requests"]) and {"cpu", "memory"} <= set(
                    res["limits"]
                ), f"{where}/{c['name']}"


def test_fedmq_pods_have_no_api_token_and_no_secrets_in_env(rendered: dict[str, list[Obj]]) -> None:
    for name, objs in rendered.items():
        for obj in (o for o in objs if o["kind"] in WORKLOADS and o["metadata"]["name"].startswith("fedmq-")):
            if obj["metadata"]["name"] == "fedmq-rabbitmq":
                continue  # peer discovery needs its token (documented checkov skip)
            assert pod_spec(obj)["automountServiceAccountToken"] is False
            for c in containers(obj):
                for e in c.get("env", []):
                    assert "secretKeyRef" not in e.get("valueFrom", {}), (
                        f"{name}: {c['name']} has {e['name']} from a Secret"
                    )


def test_probes_use_the_metrics_server(rendered: dict[str, list[Obj]]) -> None:
    for objs in rendered.values():
        for kind, obj_name, cname in [
            ("Deployment", "fedmq-aggregator", "aggregator"),
            ("StatefulSet", "fedmq-agent", "agent"),
        ]:
            c = container(find(objs, kind, obj_name), cname)
            port = int(flag(c["args"], "--metrics-port"))
            assert c["ports"] == [{"name": "metrics", "containerPort": port}]
            assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
            assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
            assert flag(c["args"], "--log-format") == "json"


def test_aggregator_is_an_active_and_a_hot_standby_on_one_checkpoint_volume(
    rendered: dict[str, list[Obj]],
) -> None:
    for name in ("gpu", "chaos"):
        objs = rendered[name]
        dep = find(objs, "Deployment", "fedmq-aggregator")
        assert dep["spec"]["replicas"] == 2
        assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
        assert find(objs, "PersistentVolumeClaim", "fedmq-checkpoints")["spec"]["accessModes"] == [
            "ReadWriteMany"
        ]
        assert find(objs, "PodDisruptionBudget", "fedmq-aggregator")["spec"]["minAvailable"] == 1
    dev = find(rendered["dev"], "Deployment", "fedmq-aggregator")
    assert dev["spec"]["replicas"] == 1 and dev["spec"]["strategy"] == {"type": "Recreate"}
    for objs in rendered.values():
        dep = find(objs, "Deployment", "fedmq-aggregator")
        c = container(dep, "aggregator")
        assert c["args"][:2] == ["aggregator", "run"]
        state_dir = flag(c["args"], "--state-dir")
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        assert mounts["state"]["mountPath"] == state_dir
        vols = {v["name"]: v for v in pod_spec(dep)["volumes"]}
        assert vols["state"]["persistentVolumeClaim"]["claimName"] == "fedmq-checkpoints"
        assert vols["credentials"]["secret"]["secretName"] == "fedmq-aggregator"
        assert mounts["job-config"]["mountPath"] == flag(c["args"], "--config")


def test_job_config_is_a_valid_fedmq_job(rendered: dict[str, list[Obj]]) -> None:
    for objs in rendered.values():
        text = find_prefix(objs, "ConfigMap", "fedmq-job")["data"]["job.toml"]
        cfg = JobConfig.from_dict(tomllib.loads(text))
        agg = container(find(objs, "Deployment", "fedmq-aggregator"), "aggregator")
        assert cfg.job == flag(agg["args"], "--job")
        assert cfg.clients == find(objs, "StatefulSet", "fedmq-agent")["spec"]["replicas"]


def test_one_secret_per_agent_and_each_agent_container_sees_only_its_own(
    rendered: dict[str, list[Obj]],
) -> None:
    for name, objs in rendered.items():
        sts = find(objs, "StatefulSet", "fedmq-agent")
        n = sts["spec"]["replicas"]
        expected = [f"fedmq-agent-{i}" for i in range(n)]
        vols = {v["name"]: v for v in pod_spec(sts)["volumes"]}
        sources = vols["all-credentials"]["projected"]["sources"]
        assert [s["secret"]["name"] for s in sources] == expected, name
        for i, s in enumerate(sources):
            assert s["secret"]["items"] == [
                {"key": "username", "path": f"agent-{i}/username"},
                {"key": "password", "path": f"agent-{i}/password"},
            ]
        assert vols["credentials"]["emptyDir"]["medium"] == "Memory"
        # only the init container mounts every agent's Secret; the agent mounts its own copy read-only
        init = container(sts, "credentials")
        assert {m["name"] for m in init["volumeMounts"]} == {"all-credentials", "credentials"}
        agent = container(sts, "agent")
        agent_mounts = {m["name"]: m for m in agent["volumeMounts"]}
        assert "all-credentials" not in agent_mounts and agent_mounts["credentials"]["readOnly"] is True
        assert "--client-id-from-hostname" in agent["args"]
        # the provisioner creates exactly these Secrets and may touch nothing else
        job = find(objs, "Job", "fedmq-provision")
        prov = container(job, "provision")
        assert prov["args"][:2] == ["broker", "provision"] and int(flag(prov["args"], "--agents")) == n
        assert "--remove-guest" in prov["args"]
        rules = find(objs, "Role", "fedmq-provision")["rules"]
        named = [r for r in rules if r.get("resourceNames")]
        assert [r["resources"] for r in rules] == [["secrets"]] * len(rules)
        assert sorted(named[0]["resourceNames"]) == sorted(["fedmq-aggregator", *expected])
        # the kubectl step is the only container with the ServiceAccount token
        token_mounts = [
            c["name"]
            for c in containers(job)
            if any(
                m["mountPath"] == "/var/run/secrets/kubernetes.io/serviceaccount" for m in c["volumeMounts"]
            )
        ]
        assert token_mounts == ["apply"]


def shell_of(c: Obj) -> str:
    assert c["command"][:2] == ["/bin/sh", "-c"]
    return c["command"][2] if len(c["command"]) > 2 else c["args"][0]


def test_credential_scripts_give_the_pod_its_own_identity(
    rendered: dict[str, list[Obj]], tmp_path: Path
) -> None:
    """Run the init container's and the agent's shell snippets for pod fedmq-agent-1 against a fake fedmq."""
    sts = find(rendered["chaos"], "StatefulSet", "fedmq-agent")
    root = tmp_path / "run"
    for i in range(2):
        d = root / "fedmq" / "all-credentials" / f"agent-{i}"
        d.mkdir(parents=True)
        (d / "username").write_text(f"agent-{i}")
        (d / "password").write_text(f"secret-{i}")
    (root / "fedmq" / "credentials").mkdir()
    init = shell_of(container(sts, "credentials")).replace("/run/", f"{root}/")
    proc = subprocess.run(
        ["/bin/sh", "-c", init],
        env={"HOSTNAME": "fedmq-agent-1", "PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    copied = root / "fedmq" / "credentials"
    assert sorted(p.name for p in copied.iterdir()) == ["password", "username"]
    assert (copied / "username").read_text() == "agent-1" and (copied / "password").read_text() == "secret-1"

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "fedmq").write_text(
        '#!/bin/sh\nprintf "%s|%s|%s\\n" "$FEDMQ_BROKER_USER" "$FEDMQ_BROKER_PASSWORD" "$*"\n'
    )
    (fake / "fedmq").chmod(0o755)
    agent = container(sts, "agent")
    script = agent["command"][2].replace("/run/", f"{root}/")
    proc = subprocess.run(
        ["/bin/sh", "-c", script, *agent["command"][3:], *agent["args"]],
        env={"PATH": f"{fake}:{os.environ['PATH']}"},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    user, password, argv = proc.stdout.strip().split("|")
    assert (user, password) == ("agent-1", "secret-1")
    assert argv == " ".join(agent["args"])

    # a pod whose Secret is missing stops in its init container instead of starting without an identity
    proc = subprocess.run(
        ["/bin/sh", "-c", init],
        env={"HOSTNAME": "fedmq-agent-7", "PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0


def test_gpu_overlay_gives_each_agent_one_gpu_and_cuda(rendered: dict[str, list[Obj]]) -> None:
    sts = find(rendered["gpu"], "StatefulSet", "fedmq-agent")
    spec = pod_spec(sts)
    agent = container(sts, "agent")
    assert agent["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert agent["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert env(agent)["FEDMQ_DEVICE"] == "cuda"
    assert agent["image"].endswith(":0.1.0-cuda") and container(sts, "credentials")["image"] == agent["image"]
    aggregator = container(find(rendered["gpu"], "Deployment", "fedmq-aggregator"), "aggregator")
    assert aggregator["image"].endswith(":0.1.0-cpu")
    for name in ("dev", "chaos"):
        other = find(rendered[name], "StatefulSet", "fedmq-agent")
        a = container(other, "agent")
        assert "nvidia.com/gpu" not in a["resources"]["limits"] and "tolerations" not in pod_spec(other)
        assert env(a)["FEDMQ_DEVICE"] == "cpu" and a["image"].endswith(":0.1.0-cpu")
    # only the agents get GPUs
    for obj in (
        o for o in rendered["gpu"] if o["kind"] in WORKLOADS and o["metadata"]["name"] != "fedmq-agent"
    ):
        for c in containers(obj):
            assert "nvidia.com/gpu" not in c["resources"].get("limits", {})


def test_chaos_overlay_runs_agents_with_a_markov_availability_model(rendered: dict[str, list[Obj]]) -> None:
    spec = env(container(find(rendered["chaos"], "StatefulSet", "fedmq-agent"), "agent"))[
        "FEDMQ_AVAILABILITY"
    ]
    assert spec == "markov:0.9,0.7"
    assert isinstance(parse_availability(spec), Markov)  # the agent's own parser accepts it
    for name in ("dev", "gpu"):
        assert (
            env(container(find(rendered[name], "StatefulSet", "fedmq-agent"), "agent"))["FEDMQ_AVAILABILITY"]
            == "always"
        )


def test_network_policies_let_agents_reach_only_the_broker(rendered: dict[str, list[Obj]]) -> None:
    for objs in rendered.values():
        deny = find(objs, "NetworkPolicy", "default-deny-all")["spec"]
        assert deny == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
        for who in ("fedmq-agent", "fedmq-aggregator"):
            pol = find(objs, "NetworkPolicy", who)["spec"]
            assert pol["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": who}}
            assert pol["egress"] == [
                {
                    "to": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "fedmq-rabbitmq"}}}],
                    "ports": [{"protocol": "TCP", "port": 5671}],
                }
            ]
        dns = find(objs, "NetworkPolicy", "allow-dns")["spec"]
        assert {p["port"] for p in dns["egress"][0]["ports"]} == {53}
        assert all("ipBlock" not in peer for rule in dns["egress"] for peer in rule["to"])
        # the broker's pods carry the label the policies select, whichever way RabbitMQ is deployed
        broker_urls = {
            flag(container(find(objs, k, n), c)["args"], "--broker")
            for k, n, c in [
                ("Deployment", "fedmq-aggregator", "aggregator"),
                ("StatefulSet", "fedmq-agent", "agent"),
            ]
        }
        assert broker_urls == {"amqps://fedmq-rabbitmq.fedmq.svc:5671/fedmq"}

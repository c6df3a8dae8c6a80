"""The hosts overlay (k8s/overlays/hosts): it renders and validates, its host count agrees in every place,
each pod's hostname gives it its own host's credentials, and the hosts split the job's population once."""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from fedmq.aggregator.config import JobConfig
from fedmq.cli.commands.agent import _hosted_clients

ROOT = Path(__file__).resolve().parents[2]
Obj = dict[str, Any]


@pytest.fixture(scope="module")
def objs() -> list[Obj]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl renders the kustomize overlays (docs/deploy.md)"
    proc = subprocess.run(
        [kubectl, "kustomize", str(ROOT / "k8s" / "overlays" / "hosts")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def find(objs: list[Obj], kind: str, prefix: str) -> Obj:
    hits = [o for o in objs if o["kind"] == kind and o["metadata"]["name"].startswith(prefix)]
    assert len(hits) == 1, (kind, prefix, len(hits))
    return hits[0]


def container(obj: Obj, name: str) -> Obj:
    spec = obj["spec"]["template"]["spec"]
    return next(c for c in [*spec.get("initContainers", []), *spec["containers"]] if c["name"] == name)


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_the_hosts_overlay_agrees_with_itself_and_splits_the_population(objs, monkeypatch):
    for obj in objs:
        if obj["kind"] != "RabbitmqCluster":  # (the operator's kind: tests/deploy/test_deploy_manifests.py)
            kubernetes_validate.validate(obj, "1.32", strict=True)
    sts = find(objs, "StatefulSet", "fedmq-agent")
    n = sts["spec"]["replicas"]
    agent = container(sts, "agent")
    env = {e["name"]: e.get("value") for e in agent["env"]}
    assert "--host-from-hostname" in agent["args"] and "--client-id-from-hostname" not in agent["args"]
    assert int(env["FEDMQ_HOSTS"]) == n
    hosts = [f"h{i}" for i in range(n)]
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    sources = volumes["all-credentials"]["projected"]["sources"]
    assert [s["secret"]["name"] for s in sources] == [f"fedmq-host-{h}" for h in hosts]
    prov = container(find(objs, "Job", "fedmq-provision"), "provision")
    assert flag(prov["args"], "--hosts") == str(n) and "--agents" not in prov["args"]
    names = find(objs, "Role", "fedmq-provision")["rules"][1]["resourceNames"]
    assert sorted(names) == sorted(["fedmq-aggregator", *(f"fedmq-host-{h}" for h in hosts)])

    # the hosts read the job file the aggregator reads: its population is what they split
    mount = next(m for m in agent["volumeMounts"] if m["name"] == "job-config")
    assert mount["mountPath"] == env["FEDMQ_CONFIG"] and volumes["job-config"]["configMap"][
        "name"
    ].startswith("fedmq-job-")
    cfg = JobConfig.from_dict(tomllib.loads(find(objs, "ConfigMap", "fedmq-job")["data"]["job.toml"]))
    served = []
    for i in range(n):
        monkeypatch.setattr("socket.gethostname", lambda i=i: f"fedmq-agent-{i}")
        host, ranges = _hosted_clients(cfg.clients, None, None, True, n, None, False, None)
        assert host == hosts[i]
        served += [c for lo, hi in ranges for c in range(lo, hi)]
    assert served == list(range(cfg.clients)) and cfg.selected_count() >= cfg.min_clients


def test_each_host_pod_copies_its_own_credentials(objs, tmp_path):
    init = container(find(objs, "StatefulSet", "fedmq-agent"), "credentials")
    script = init["args"][0].replace("/run/", f"{tmp_path}/")
    for h in ("h0", "h1"):
        d = tmp_path / "fedmq" / "all-credentials" / h
        d.mkdir(parents=True)
        (d / "username").write_text(f"fedmq.host.{h}")
        (d / "password").write_text(f"secret-{h}")
    (tmp_path / "fedmq" / "credentials").mkdir()
    env = {"HOSTNAME": "fedmq-agent-1", "PATH": os.environ["PATH"]}
    proc = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    copied = tmp_path / "fedmq" / "credentials"
    assert (copied / "username").read_text() == "fedmq.host.h1" and (
        copied / "password"
    ).read_text() == "secret-h1"
    env["HOSTNAME"] = "fedmq-agent-7"  # no such host's Secret: the pod stops in its init container
    assert subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True).returncode != 0

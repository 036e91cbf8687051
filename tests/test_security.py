"""Ports that execute graphs stay inside the job (docs/security.md).

Every port a tfdp process serves (MultiWorkerMirroredStrategy workers, the
tf.data service dispatcher and workers) runs whatever TensorFlow graph it is
sent, unauthenticated. The Kubernetes manifests must admit only the job's own
pods to each (a NetworkPolicy), the Compose files must keep them on an
internal network; both are read as `kubectl apply -f` and `docker compose -f`
would read them (plain YAML, merge keys resolved), the manifests also checked
against Kubernetes' own schemas (PyPI kubernetes-validate). The checkers are
tried on broken copies too, so a port left open fails the suite.
"""

from __future__ import annotations

import copy
import json
import os
import re
import socket
import subprocess
import sys

import pytest
import yaml

from conftest import REPO

K8S = ["docker/k8s/tfdp-job.yaml", "docker/k8s/tfdp-job-bucket.yaml", "docker/k8s-data-service.yaml",
       "docker/k8s/tfdp-tfjob.yaml", "docker/k8s/tfdp-jobset.yaml"]
# Custom resources: their operators' CRD schemas validate them (tests/distribute/test_operators.py); here their
# pod templates are found for the port check.
OPERATOR_KINDS = {"TFJob": lambda doc: [r["template"] for r in doc["spec"]["tfReplicaSpecs"].values()],
                  "JobSet": lambda doc: [r["template"]["spec"]["template"] for r in doc["spec"]["replicatedJobs"]]}
COMPOSE = ["docker/compose.yaml", "docker/compose-data-service.yml"]
POD_KINDS = {"Pod": (), "Job": ("spec", "template"), "Deployment": ("spec", "template"),
             "StatefulSet": ("spec", "template"), "DaemonSet": ("spec", "template"),
             "ReplicaSet": ("spec", "template")}


def load_all(path: str) -> list[dict]:
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def served_ports(args: list[str], env: dict[str, str], declared: list[int]) -> set[int]:
    """The ports a tfdp process with these arguments and environment listens on: its declared ports,
    `--port=N` (data-service), and its own entry in the worker list (TFDP_WORKERS, TF_CONFIG)."""
    ports = set(declared)
    ports |= {int(m) for a in args for m in re.findall(r"^--port=(\d+)$", str(a))}
    for address in env.get("TFDP_WORKERS", "").split(","):
        if ":" in address:
            ports.add(int(address.rsplit(":", 1)[1]))
    if env.get("TF_CONFIG"):
        for addresses in json.loads(env["TF_CONFIG"])["cluster"].values():
            ports |= {int(a.rsplit(":", 1)[1]) for a in addresses}
    return ports


def pods(docs: list[dict]) -> list[tuple[str, dict, dict]]:
    """(name, labels, pod spec) of every pod template in the manifests."""
    found = []
    for doc in docs:
        for template in OPERATOR_KINDS.get(doc["kind"], lambda _: [])(doc):
            found.append((doc["metadata"]["name"], template.get("metadata", {}).get("labels", {}), template["spec"]))
        if doc["kind"] in POD_KINDS:
            template = doc
            for key in POD_KINDS[doc["kind"]]:
                template = template[key]
            found.append((doc["metadata"]["name"], template.get("metadata", {}).get("labels", {}), template["spec"]))
    return found


def selects(selector: dict, labels: dict) -> bool:
    assert not selector.get("matchExpressions"), "only matchLabels selectors are checked"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def k8s_open_ports(docs: list[dict]) -> list[str]:
    """What in the manifests lets something outside the job reach a graph-executing port; [] when nothing."""
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    problems = []
    for name, labels, spec in pods(docs):
        if spec.get("hostNetwork"):
            problems.append(f"{name}: hostNetwork")
        for c in spec["containers"]:
            env = {e["name"]: e.get("value", "") for e in c.get("env", [])}
            ports = served_ports(c.get("args", []), env, [p["containerPort"] for p in c.get("ports", [])])
            problems += [f"{name}: hostPort {p['hostPort']}" for p in c.get("ports", []) if p.get("hostPort")]
            guarding = [p for p in policies if selects(p["spec"]["podSelector"], labels)
                        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
            if not guarding:
                problems += [f"{name}: port {port} has no NetworkPolicy" for port in sorted(ports)]
            admitted = set()
            for policy in guarding:  # policies add up: any one of them admitting outsiders opens the pod
                own = policy["spec"]["podSelector"].get("matchLabels", {})
                for rule in policy["spec"].get("ingress", []):
                    peers = rule.get("from")
                    if not peers:
                        problems.append(f"{name}: {policy['metadata']['name']} admits anyone")
                    for peer in peers or []:
                        inside = (set(peer) == {"podSelector"} and own
                                  and own.items() <= peer["podSelector"].get("matchLabels", {}).items())
                        if not inside:
                            problems.append(f"{name}: {policy['metadata']['name']} admits {peer} (not only the job)")
                    admitted |= {p["port"] for p in rule["ports"]} if rule.get("ports") else ports
            if guarding:  # and the job itself must get through, or it cannot run
                problems += [f"{name}: port {port} is closed to the job too" for port in sorted(ports - admitted)]
    for doc in docs:
        if doc["kind"] == "Service" and doc["spec"].get("type", "ClusterIP") not in ("ClusterIP",):
            problems.append(f"Service {doc['metadata']['name']}: type {doc['spec']['type']} (reachable from outside)")
    return problems


def compose_open_ports(doc: dict) -> list[str]:
    """What in a Compose file lets something outside the job reach a graph-executing port; [] when nothing."""
    networks = doc.get("networks") or {}
    problems = []
    for name, service in doc["services"].items():
        env = service.get("environment") or {}
        if isinstance(env, list):
            env = dict(item.split("=", 1) for item in env)
        command = service.get("command") or []
        if not served_ports(command, env, []) and "train" not in command and "data-service" not in command:
            continue
        if service.get("network_mode"):
            problems.append(f"{name}: network_mode {service['network_mode']}")
        if service.get("ports"):
            problems.append(f"{name}: publishes {service['ports']}")
        joined = service.get("networks") or ["default"]
        for net in joined:
            if not (networks.get(net) or {}).get("internal"):
                problems.append(f"{name}: on network {net}, which is not internal")
    return problems


@pytest.mark.parametrize("path", K8S)
def test_every_graph_port_in_the_kubernetes_manifests_admits_only_the_jobs_pods(path):
    import kubernetes_validate
    docs = load_all(path)
    for doc in docs:  # what `kubectl apply` would accept: Kubernetes' own schemas, unknown fields refused
        if doc["kind"] not in OPERATOR_KINDS:
            kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    assert [p for _, _, spec in pods(docs) for c in spec["containers"] for p in c.get("ports", [])], "no ports seen"
    assert k8s_open_ports(docs) == []


@pytest.mark.parametrize("path", COMPOSE)
def test_every_graph_port_in_the_compose_files_is_on_an_internal_network(path):
    doc = load_all(path)[0]
    assert doc["services"]
    assert compose_open_ports(doc) == []


def without_policies(docs):
    return [d for d in docs if d["kind"] != "NetworkPolicy"]


def with_extra_port(docs):
    docs = copy.deepcopy(docs)
    pod_spec = pods(docs)[-1][2]
    pod_spec["containers"][0]["args"].append("--port=6000")
    policy = [d for d in docs if d["kind"] == "NetworkPolicy"][0]
    policy["spec"]["ingress"].append({"ports": [{"port": 6000}]})  # the port admitted with no `from`: anyone
    return docs


def with_ip_block(docs):
    docs = copy.deepcopy(docs)
    [d for d in docs if d["kind"] == "NetworkPolicy"][0]["spec"]["ingress"][0]["from"].append(
        {"ipBlock": {"cidr": "0.0.0.0/0"}})
    return docs


def with_wider_peer(docs):
    docs = copy.deepcopy(docs)
    [d for d in docs if d["kind"] == "NetworkPolicy"][0]["spec"]["ingress"][0]["from"][0]["podSelector"] = {}
    return docs


def with_a_port_not_admitted(docs):
    docs = copy.deepcopy(docs)
    pods(docs)[0][2]["containers"][0]["args"].append("--port=6001")
    return docs


def with_unlabelled_pod(docs):
    docs = copy.deepcopy(docs)
    for d in docs:
        if d["kind"] == "Job":
            d["spec"]["template"]["metadata"]["labels"].pop("tfdp-job")
        for template in OPERATOR_KINDS.get(d["kind"], lambda _: [])(d):
            template["metadata"]["labels"].pop("tfdp-job", None)  # templates may share one labels map (a YAML alias)
    return docs


@pytest.mark.parametrize("path", K8S)
@pytest.mark.parametrize("mutate", [without_policies, with_extra_port, with_ip_block, with_wider_peer,
                                    with_unlabelled_pod, with_a_port_not_admitted])
def test_the_kubernetes_check_finds_a_port_left_open(path, mutate):
    assert k8s_open_ports(mutate(load_all(path)))


@pytest.mark.parametrize("path", COMPOSE)
def test_the_compose_check_finds_a_port_left_open(path):
    doc = load_all(path)[0]
    for mutate in (lambda d: d.pop("networks"),
                   lambda d: d["networks"]["default"].update(internal=False),
                   lambda d: next(iter(d["services"].values())).update(ports=["2222:2222"]),
                   lambda d: next(iter(d["services"].values())).update(networks=["outside"])):
        broken = copy.deepcopy(doc)
        mutate(broken)
        assert compose_open_ports(broken), mutate


def reachable(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        return s.connect_ex((host, port)) == 0


def test_the_data_service_start_up_line_names_where_it_listens():
    """TensorFlow binds the dispatcher and workers to every interface; the line says so, and it is true:
    the port answers on 127.0.0.2 and ::1 too (other loopback addresses), which a server bound to one
    address would not."""
    proc = subprocess.Popen([sys.executable, "-m", "tfdp", "data-service", "dispatcher", "--port=0"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline().strip()
        match = re.fullmatch(r"tfdp: data-service: dispatcher at grpc://\S+:(\d+) \(no --work_dir[^)]*\), "
                             r"listening on (\[::\]|0\.0\.0\.0):(\d+)( and \S+)? \(every interface: TensorFlow binds "
                             r"no single address; keep the port inside the job, docs/security\.md\)", line)
        assert match and match.group(1) == match.group(3), line
        port = int(match.group(1))
        assert reachable("127.0.0.2", port)
        if match.group(2) == "[::]" and socket.has_ipv6:
            assert reachable("::1", port)
    finally:
        proc.terminate()
        proc.wait(timeout=30)

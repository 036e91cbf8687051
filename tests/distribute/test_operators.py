"""The Kubeflow TFJob and the JobSet in docker/k8s/, checked offline as the operators would take them.

Each manifest is validated against its operator's own CRD schema (vendored in
tests/fixtures/crds/, with source and revision), unknown fields refused as
`kubectl apply --validate=strict` refuses them, plus the rules the operators
check in code rather than in the schema (quoted below with file and revision),
and its pod templates against Kubernetes' own schemas (kubernetes-validate).
Broken copies must fail. Then every pod's TF_CONFIG is built as the operator
(TFJob) or the pod's own shell line (JobSet) builds it, and read by tfdp.
"""

from __future__ import annotations

import copy
import functools
import os
import re
import subprocess
import sys

import jsonschema
import pytest
import yaml

from conftest import REPO
from support.operators import permanent_exit_codes, service_address, tfjob_tf_configs
from tfdp.distribute import cluster as cluster_lib
from tfdp.errors import PREEMPTED_EXIT_CODE

K8S = os.path.join(REPO, "docker", "k8s")
CRDS = os.path.join(REPO, "tests", "fixtures", "crds")
TFJOB = "tfdp-tfjob.yaml"
JOBSET = "tfdp-jobset.yaml"


def load(name: str) -> list[dict]:
    with open(os.path.join(K8S, name), encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d]


def custom(name: str) -> dict:
    """The one custom resource (TFJob, JobSet) of a manifest."""
    return next(d for d in load(name) if d["kind"] in ("TFJob", "JobSet"))


def strict(schema):
    """The schema with unknown fields refused: the API server's strict field validation prunes nothing, it
    rejects any field a structural schema does not name (unless it preserves unknown fields)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@functools.cache
def crd_validator(schema_file: str) -> jsonschema.Draft7Validator:
    with open(os.path.join(CRDS, schema_file), encoding="utf-8") as f:
        return jsonschema.Draft7Validator(strict(yaml.safe_load(f)))


def schema_errors(doc: dict, schema_file: str) -> list[str]:
    validator = crd_validator(schema_file)
    return [f"{'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}" for e in validator.iter_errors(doc)]


def pod_errors(template: dict, where: str) -> list[str]:
    """A pod template as Kubernetes itself validates it (kubernetes-validate's bundled schemas, strict)."""
    import kubernetes_validate
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x", **template.get("metadata", {})},
           "spec": template["spec"]}
    try:
        kubernetes_validate.validate(pod, kubernetes_validate.latest_version(), strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{where}: {e}"]
    return []


# kubeflow/training-operator v1.9.0 (6f74c7f6b2ed6c27aabd82d0a316b23f0646059c): what the schema leaves as
# free strings, the operator's Go names. pkg/apis/kubeflow.org/v1/tensorflow_types.go:
#   TFJobReplicaTypePS = "PS", TFJobReplicaTypeWorker = "Worker", TFJobReplicaTypeChief = "Chief",
#   TFJobReplicaTypeMaster = "Master", TFJobReplicaTypeEval = "Evaluator";
#   SuccessPolicyDefault = "", SuccessPolicyAllWorkers = "AllWorkers"; TFJobDefaultContainerName = "tensorflow"
# (tensorflow_defaults.go, setTensorflowTypeNamesToCamelCase, accepts any case of these names).
# pkg/apis/kubeflow.org/v1/common_types.go: RestartPolicyAlways = "Always", RestartPolicyOnFailure = "OnFailure",
#   RestartPolicyNever = "Never", RestartPolicyExitCode = "ExitCode".
# pkg/webhooks/tensorflow/tfjob_webhook.go, validateTFReplicaSpecs: every replica has containers with an
# image, one of them named "tensorflow"; "must not have more than 1 Chief or Master role".
TFJOB_REPLICA_TYPES = {"PS", "Worker", "Chief", "Master", "Evaluator"}
TFJOB_RESTART_POLICIES = {"Always", "OnFailure", "Never", "ExitCode"}
TFJOB_SUCCESS_POLICIES = {"", "AllWorkers"}


def tfjob_errors(doc: dict) -> list[str]:
    """The TFJob as the operator takes it: its CRD schema, then the rules its Go code adds."""
    errors = schema_errors(doc, "tfjob.kubeflow.org_v1.schema.yaml")
    spec = doc["spec"]
    if spec.get("successPolicy", "") not in TFJOB_SUCCESS_POLICIES:
        errors.append(f"spec.successPolicy: {spec['successPolicy']!r} is not one of {sorted(TFJOB_SUCCESS_POLICIES)}")
    camel = {t.lower(): t for t in TFJOB_REPLICA_TYPES}
    chiefs = 0
    for rtype, replica in (spec.get("tfReplicaSpecs") or {}).items():
        where = f"spec.tfReplicaSpecs.{rtype}"
        if rtype.lower() not in camel:
            errors.append(f"{where}: unknown replica type (the operator's: {sorted(TFJOB_REPLICA_TYPES)})")
        chiefs += camel.get(rtype.lower()) in ("Chief", "Master")
        if replica.get("restartPolicy", "Never") not in TFJOB_RESTART_POLICIES:
            errors.append(f"{where}.restartPolicy: {replica['restartPolicy']!r} is not one of "
                          f"{sorted(TFJOB_RESTART_POLICIES)}")
        containers = replica.get("template", {}).get("spec", {}).get("containers") or []
        if not any(c.get("name") == "tensorflow" for c in containers):
            errors.append(f"{where}.template.spec.containers: must have at least one container with name tensorflow")
        errors += [f"{where}: container {c.get('name')} has no image" for c in containers if not c.get("image")]
        if containers:
            errors += pod_errors(replica["template"], where)
    if chiefs > 1:
        errors.append("spec.tfReplicaSpecs: must not have more than 1 Chief or Master role")
    return errors


# kubernetes-sigs/jobset v0.12.0 (f22e565ac3cc3265c7c45ef67ecffdc689af5d77), pkg/webhooks/jobset_webhook.go,
# ValidateCreate: "invalid replicatedJob name '%s' does not appear in .spec.ReplicatedJobs" for
# successPolicy.targetReplicatedJobs; validateFailurePolicy: the same for a rule's targetReplicatedJobs, and
# onJobFailureReasons among validOnJobFailureReasons (batchv1's BackoffLimitExceeded, DeadlineExceeded,
# FailedIndexes, MaxFailedIndexesExceeded, PodFailurePolicy).
JOB_FAILURE_REASONS = {"BackoffLimitExceeded", "DeadlineExceeded", "FailedIndexes", "MaxFailedIndexesExceeded",
                       "PodFailurePolicy"}


def jobset_errors(doc: dict) -> list[str]:
    """The JobSet as its webhook takes it: its CRD schema, the webhook's cross-field rules, and each Job
    template as Kubernetes validates a batch/v1 Job."""
    import kubernetes_validate
    errors = schema_errors(doc, "jobset.x-k8s.io_v1alpha2.schema.yaml")
    spec = doc["spec"]
    names = {r.get("name") for r in spec.get("replicatedJobs", [])}
    targets = list((spec.get("successPolicy") or {}).get("targetReplicatedJobs", []))
    for rule in (spec.get("failurePolicy") or {}).get("rules", []):
        targets += rule.get("targetReplicatedJobs", [])
        errors += [f"failurePolicy rule {rule.get('name')}: {reason!r} is not a Job failure reason"
                   for reason in rule.get("onJobFailureReasons", []) if reason not in JOB_FAILURE_REASONS]
    errors += [f"invalid replicatedJob name '{t}' does not appear in .spec.ReplicatedJobs"
               for t in targets if t not in names]
    for rjob in spec.get("replicatedJobs", []):
        job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": f"{doc['metadata']['name']}-x"},
               "spec": rjob.get("template", {}).get("spec", {})}
        try:
            kubernetes_validate.validate(job, kubernetes_validate.latest_version(), strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"replicatedJobs {rjob.get('name')}: {e}")
    return errors


def test_the_tfjob_is_valid_for_the_operator():
    doc = custom(TFJOB)
    assert (doc["apiVersion"], doc["kind"]) == ("kubeflow.org/v1", "TFJob")
    assert tfjob_errors(doc) == []
    replicas = doc["spec"]["tfReplicaSpecs"]
    assert {rtype: r["replicas"] for rtype, r in replicas.items()} == {"Chief": 1, "Worker": 2, "Evaluator": 1}
    assert {r["restartPolicy"] for r in replicas.values()} == {"ExitCode"}
    # The same command on every pod, the run and the data in a bucket, no shared volume.
    templates = [r["template"]["spec"] for r in replicas.values()]
    assert all(t == templates[0] for t in templates)
    args = templates[0]["containers"][0]["args"]
    assert "--strategy=multi_worker" in args
    assert any(a.startswith("--model_dir=gs://") for a in args) and any(a.startswith("--data_dir=gs://") for a in args)
    assert all("emptyDir" in v for v in templates[0]["volumes"])
    assert "PersistentVolumeClaim" not in [d["kind"] for d in load(TFJOB)]


def test_the_jobset_is_valid_for_its_webhook():
    doc = custom(JOBSET)
    assert (doc["apiVersion"], doc["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    assert jobset_errors(doc) == []
    for rjob in doc["spec"]["replicatedJobs"]:
        job = rjob["template"]["spec"]
        assert job["completionMode"] == "Indexed" and job["template"]["spec"]["restartPolicy"] == "Never"
        assert_exit_contract(job["podFailurePolicy"], "tfdp")


@pytest.mark.parametrize("break_it, message", [
    (lambda d: d["spec"]["tfReplicaSpecs"].__setitem__("Wroker", d["spec"]["tfReplicaSpecs"].pop("Worker")),
     "spec.tfReplicaSpecs.Wroker: unknown replica type"),
    (lambda d: d["spec"]["tfReplicaSpecs"]["Worker"].__setitem__("restartPolicy", "ExitCodes"),
     "restartPolicy: 'ExitCodes' is not one of"),
    (lambda d: d["spec"].__setitem__("tfReplicaSpec", d["spec"].pop("tfReplicaSpecs")),
     "'tfReplicaSpecs' is a required property"),
    (lambda d: d["spec"]["tfReplicaSpecs"]["Chief"].__setitem__("replica", 1),
     "Additional properties are not allowed ('replica' was unexpected)"),
    (lambda d: d["spec"]["tfReplicaSpecs"]["Chief"]["template"]["spec"]["containers"][0].__setitem__("name", "tfdp"),
     "must have at least one container with name tensorflow"),
    (lambda d: d["spec"]["tfReplicaSpecs"].__setitem__("Master", copy.deepcopy(d["spec"]["tfReplicaSpecs"]["Chief"])),
     "must not have more than 1 Chief or Master role"),
    (lambda d: d["spec"]["tfReplicaSpecs"]["Chief"]["template"]["spec"]["containers"][0]["ports"][0]
     .__setitem__("containerPort", "2222"), "'2222' is not of type 'integer'"),
])
def test_a_broken_tfjob_fails_the_validation(break_it, message):
    doc = custom(TFJOB)
    doc["spec"]["tfReplicaSpecs"]["Chief"]["template"] = copy.deepcopy(doc["spec"]["tfReplicaSpecs"]["Chief"]["template"])
    break_it(doc)
    errors = tfjob_errors(doc)
    assert any(message in e for e in errors), errors


@pytest.mark.parametrize("break_it, message", [
    (lambda d: d["spec"].__setitem__("replicatedJob", d["spec"].pop("replicatedJobs")),
     "Additional properties are not allowed ('replicatedJob' was unexpected)"),
    (lambda d: d["spec"]["failurePolicy"]["rules"][0].__setitem__("action", "FailJob"), "'FailJob' is not one of"),
    (lambda d: d["spec"]["successPolicy"].__setitem__("targetReplicatedJobs", ["workers"]),
     "invalid replicatedJob name 'workers'"),
    (lambda d: d["spec"]["failurePolicy"]["rules"][0].__setitem__("onJobFailureReasons", ["PodFailure"]),
     "'PodFailure' is not a Job failure reason"),
    (lambda d: (lambda rule: rule.__setitem__("onExitCode", rule.pop("onExitCodes")))(
        d["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"][0]), "'onExitCode' was unexpected"),
])
def test_a_broken_jobset_fails_the_validation(break_it, message):
    doc = custom(JOBSET)
    break_it(doc)
    errors = jobset_errors(doc)
    assert any(message in e for e in errors), errors


def assert_exit_contract(pod_failure_policy: dict, container: str) -> None:
    """docs/faults.md's contract in a Job's podFailurePolicy: every permanent status tfdp has fails the Job;
    its restart status restarts the pod without counting against backoffLimit."""
    actions = {}
    for rule in pod_failure_policy["rules"]:
        if "onExitCodes" in rule:
            assert rule["onExitCodes"]["containerName"] == container and rule["onExitCodes"]["operator"] == "In"
            actions.update({code: rule["action"] for code in rule["onExitCodes"]["values"]})
    assert actions == {PREEMPTED_EXIT_CODE: "Ignore", **{code: "FailJob" for code in permanent_exit_codes()}}
    assert all(code < 128 for code in permanent_exit_codes()) and PREEMPTED_EXIT_CODE >= 128


def test_every_pod_of_the_tfjob_reads_the_tf_config_the_operator_writes():
    """TF_CONFIG per pod as genTFConfigJSONStr builds it from this manifest (support/operators.py quotes the
    Go), with the port the container names `tfjob-port` (GetPortFromTFJob): one consistent cluster, the chief
    rank 0, the evaluator no member of the training."""
    doc = custom(TFJOB)
    replicas = {rtype: r["replicas"] for rtype, r in doc["spec"]["tfReplicaSpecs"].items()}
    ports = {p["containerPort"] for r in doc["spec"]["tfReplicaSpecs"].values()
             for c in r["template"]["spec"]["containers"] if c["name"] == "tensorflow"
             for p in c["ports"] if p.get("name") == "tfjob-port"}
    assert ports == {2222}
    pods = tfjob_tf_configs(replicas, service_address(doc["metadata"]["name"], "default", ports.pop()))
    cluster_lib.check_consistent({f"{rtype} {i}": text for (rtype, i), text in pods.items()})
    clusters = {pod: cluster_lib.parse_tf_config(text) for pod, text in pods.items()}
    assert {pod: c.rank for pod, c in clusters.items() if not c.is_evaluator} == {
        ("Chief", 0): 0, ("Worker", 0): 1, ("Worker", 1): 2}
    assert [pod for pod, c in clusters.items() if c.is_evaluator] == [("Evaluator", 0)]
    assert clusters["Chief", 0].address == "tfdp-imagenet-chief-0.default.svc:2222"


def jobset_pods(doc: dict) -> list[tuple[str, int, dict]]:
    """(replicated job, completion index, container) of every pod the JobSet starts (replicas Jobs of
    `completions` pods each; this manifest has one Job per replicated job)."""
    pods = []
    for rjob in doc["spec"]["replicatedJobs"]:
        assert rjob["replicas"] == 1
        job = rjob["template"]["spec"]
        assert job["completions"] == job["parallelism"]
        pods += [(rjob["name"], i, job["template"]["spec"]["containers"][0]) for i in range(job["completions"])]
    return pods


def test_the_jobset_shell_line_writes_one_cluster_from_the_completion_index():
    """The container's own command, run here by /bin/sh with what a JobSet pod has in its environment (the
    container's env and the Indexed Job's JOB_COMPLETION_INDEX), and tfdp's cluster reader in place of the
    args: every pod gets its own task in one cluster whose addresses are the pods' JobSet DNS names."""
    doc = custom(JOBSET)
    name = doc["metadata"]["name"]
    read = ("import sys; from tfdp.distribute import cluster; c = cluster.from_environment(); "
            "sys.stdout.write(cluster.to_tf_config(c))")
    configs = {}
    for rjob, index, container in jobset_pods(doc):
        assert container["args"][:2] == ["tfdp", "train"] and "--strategy=multi_worker" in container["args"]
        env = {"PATH": os.environ["PATH"], "PYTHONPATH": REPO, "JOB_COMPLETION_INDEX": str(index),
               **{e["name"]: e["value"] for e in container["env"]}}
        ran = subprocess.run([*container["command"], sys.executable, "-c", read], env=env, capture_output=True,
                             text=True, timeout=60, cwd=REPO)
        assert ran.returncode == 0, ran.stderr
        configs[f"{rjob} {index}"] = ran.stdout
    cluster_lib.check_consistent(configs)
    clusters = {pod: cluster_lib.parse_tf_config(text) for pod, text in configs.items()}
    assert {pod: c.rank for pod, c in clusters.items() if not c.is_evaluator} == {"worker 0": 0, "worker 1": 1}
    assert clusters["evaluator 0"].is_evaluator
    # <jobset>-<replicated job>-<job index>-<pod index>.<subdomain: the JobSet's name> (GenPodName, GetSubdomain)
    assert [a for _, _, a in clusters["worker 0"].all_tasks] == [
        f"{name}-worker-0-0.{name}:2222", f"{name}-worker-0-1.{name}:2222", f"{name}-evaluator-0-0.{name}:2222"]
    ports = {p["containerPort"] for _, _, c in jobset_pods(doc) for p in c["ports"]}
    assert ports == {int(a.rsplit(":", 1)[1]) for _, _, a in clusters["worker 0"].all_tasks}


def test_the_jobset_runs_the_same_tfdp_command_on_every_pod():
    doc = custom(JOBSET)
    containers = [c for _, _, c in jobset_pods(doc)]
    assert all(c["args"] == containers[0]["args"] and c["command"] == containers[0]["command"] for c in containers)
    assert {next(e["value"] for e in c["env"] if e["name"] == "TASK_TYPE") for c in containers} == {"worker", "evaluator"}
    assert re.search(r'exec "\$@"$', containers[0]["command"][2])

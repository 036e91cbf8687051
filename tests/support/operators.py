"""TF_CONFIG exactly as Kubeflow's TFJob operator writes it into every pod.

kubeflow/training-operator v1.9.0 (6f74c7f6b2ed6c27aabd82d0a316b23f0646059c),
pkg/controller.v1/tensorflow/tensorflow.go:

    func genTFConfigJSONStr(tfjob *kubeflowv1.TFJob, rtype, index string) (string, error) {
        ...
        tfConfig := TFConfig{
            Cluster: cluster,
            Task: TaskSpec{
                Type:  strings.ToLower(rtype),
                Index: int(i),
            },
            ...
            Environment: "cloud",
        }
        tfConfigJSONByteSlice, err = json.Marshal(tfConfig)

    func genClusterSpec(tfjob *kubeflowv1.TFJob) (ClusterSpec, error) {
        for rtype, spec := range tfjob.Spec.TFReplicaSpecs {
            rt := strings.ToLower(string(rtype))
            ...
                hostName := common.GenGeneralName(tfjob.Name, rt, fmt.Sprintf("%d", i))
                svcName := hostName + "." + tfjob.Namespace + "." + "svc"
                ...
                endpoint := fmt.Sprintf("%s:%d", svcName, port)
            clusterSpec[rt] = replicaNames

pkg/controller.v1/common/util.go: GenGeneralName is `jobName + "-" + strings.ToLower(rtype) + "-" + index`;
the port is 2222 (TFJobDefaultPort, pkg/apis/kubeflow.org/v1/tensorflow_types.go) unless the container
names a `tfjob-port`. Go's json.Marshal writes a struct's fields in order (cluster, task, environment) and a
map's keys sorted, so every replica type of the job is in every pod's cluster, evaluator and ps included.
"""

from __future__ import annotations

import json
from typing import Callable

TFJOB_PORT = 2222


def service_address(job: str, namespace: str, port: int = TFJOB_PORT) -> Callable[[str, int], str]:
    """The address genClusterSpec gives replica `index` of `rtype`: its headless service's DNS name."""
    return lambda rtype, index: f"{job}-{rtype.lower()}-{index}.{namespace}.svc:{port}"


def tfjob_tf_config(replicas: dict[str, int], rtype: str, index: int,
                    address: Callable[[str, int], str] = service_address("tfdp", "default")) -> str:
    """The TF_CONFIG of pod `index` of replica type `rtype` (as the TFJob spells it: Chief, Worker, ...).

    `replicas` is the job's tfReplicaSpecs as replica type → count; `address` gives each replica's
    host:port (the service names by default; loopback ports in a test that runs the pods).
    """
    cluster = {rt.lower(): [address(rt, i) for i in range(count)] for rt, count in sorted(replicas.items(),
                                                                                        key=lambda r: r[0].lower())}
    return json.dumps({"cluster": cluster, "task": {"type": rtype.lower(), "index": index},
                       "environment": "cloud"}, separators=(",", ":"))


def tfjob_tf_configs(replicas: dict[str, int],
                     address: Callable[[str, int], str] = service_address("tfdp", "default")) -> dict[tuple[str, int], str]:
    """Every pod's TF_CONFIG, by (replica type, index)."""
    return {(rt, i): tfjob_tf_config(replicas, rt, i, address) for rt, count in replicas.items() for i in range(count)}


def permanent_exit_codes() -> set[int]:
    """Every status below 128 a tfdp process ends with: 1 (an uncaught exception: a bug, traceback kept) and
    each one-line error's own `exit_code` (2, and the faults' that have one of their own)."""
    from tfdp.errors import UserError
    codes, pending = {1}, [UserError]
    while pending:
        error = pending.pop()
        codes.add(error.exit_code)
        pending += error.__subclasses__()
    return codes

"""The cluster a multi-worker run belongs to, from TF_CONFIG or Slurm.

TF_CONFIG is the standard JSON that Kubernetes operators, Docker Compose files
and custom schedulers hand each process:
  {"cluster": {"chief": ["host:port"], "worker": ["host:port", ...], "evaluator": ["host:port"]},
   "task": {"type": "worker", "index": 0}, "environment": "cloud"}
Kubeflow's TFJob writes every replica type of the job, lower-cased, into
every pod's cluster: `chief` or its older name `master`, `worker`,
`evaluator`, `ps`, plus `"environment": "cloud"`, which nothing reads. The
chief and the workers train, all-reducing every step; an evaluator joins no
collective (it reads the checkpoints they write), so it is in the cluster but
is no member of the training and has no rank. Parameter servers would need a
different strategy, which tfdp does not have, so `ps` is refused.

It is checked here, before TensorFlow sees it, because TensorFlow's own errors
for a bad spec are a hang or a stack trace. Pure Python: no TensorFlow import.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket

from tfdp.config import DistributeConfig
from tfdp.errors import UserError

TRAINING_TYPES = ("chief", "worker")  # in global rank order: the chief, if any, is rank 0
EVALUATOR = "evaluator"
TASK_TYPES = (*TRAINING_TYPES, EVALUATOR)
# Other names operators write for the same task: TFJob's `Master` replica is "semantically equivalent" to
# `Chief` (kubeflow/training-operator pkg/apis/kubeflow.org/v1/tensorflow_types.go); TensorFlow's own cluster
# checks know only `chief`, so the name is changed before TensorFlow reads TF_CONFIG.
ALIASES = {"master": "chief"}
# Task types tfdp cannot run, and why, in the words the error line uses.
REFUSED = {"ps": "parameter-server training (ParameterServerStrategy) is not supported; tfdp trains with "
                 "all-reduce: give the job chief/worker replicas (and an evaluator if wanted), no ps"}


@dataclasses.dataclass(frozen=True)
class Cluster:
    tasks: dict[str, tuple[str, ...]]   # task type → addresses (canonical names: chief, worker, evaluator)
    task_type: str
    task_index: int

    @property
    def members(self) -> list[tuple[str, int, str]]:
        """(type, index, address) of every training task, in rank order: the evaluator is none of them."""
        return [(t, i, a) for t in TRAINING_TYPES for i, a in enumerate(self.tasks.get(t, ()))]

    @property
    def all_tasks(self) -> list[tuple[str, int, str]]:
        """(type, index, address) of every task, the evaluator's too: the ones pods are started for."""
        return [(t, i, a) for t in TASK_TYPES for i, a in enumerate(self.tasks.get(t, ()))]

    @property
    def is_evaluator(self) -> bool:
        """This process is the evaluator: it evaluates checkpoints beside the training and joins no collective."""
        return self.task_type == EVALUATOR

    @property
    def num_workers(self) -> int:
        return len(self.members)

    @property
    def rank(self) -> int:
        if self.is_evaluator:
            raise ValueError("the evaluator has no rank: it is not a member of the training cluster")
        return [(t, i) for t, i, _ in self.members].index((self.task_type, self.task_index))

    @property
    def address(self) -> str:
        return self.tasks[self.task_type][self.task_index]

    @property
    def members_on_host(self) -> int:
        """Training tasks on this task's host (by the host part of their addresses, this one among them): what
        share one machine's memory (`tfdp launch`'s workers, several Slurm tasks on a node)."""
        host = host_of(self.address)
        return sum(host_of(address) == host for _, _, address in self.members)

    def describe(self, task_type: str, index: int) -> str:
        return f"{task_type} {index} ({self.tasks[task_type][index]})"


def host_of(address: str) -> str:
    """The machine of a `host:port` address, as written: the loopback names (`localhost`, 127.x.x.x, `[::1]`) are one
    machine; other names are not resolved (a lookup could hang on a cluster's DNS before training starts)."""
    host = address.rpartition(":")[0].strip("[]")
    return "loopback" if host in ("localhost", "::1") or host.startswith("127.") else host


def parse_tf_config(text: str) -> Cluster:
    """The cluster in TF_CONFIG, task types under their canonical names (`master` becomes `chief`)."""
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"TF_CONFIG is not valid JSON: {e.msg} at character {e.pos}") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("cluster"), dict) or not isinstance(spec.get("task"), dict):
        raise UserError('TF_CONFIG must be an object with "cluster" and "task" objects')
    tasks = _read_tasks(spec["cluster"])
    raw_type, index = spec["task"].get("type"), spec["task"].get("index", 0)
    task_type = ALIASES.get(raw_type, raw_type) if isinstance(raw_type, str) else raw_type
    if task_type not in tasks:
        raise UserError(f"TF_CONFIG task type '{raw_type}' is not in the cluster (it has: {', '.join(tasks)})")
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(tasks[task_type]):
        raise UserError(f"TF_CONFIG task index {index!r} is out of range: the cluster has "
                        f"{len(tasks[task_type])} '{raw_type}' task(s)")
    cluster = Cluster(tasks, task_type, index)
    _check_addresses(cluster)
    return cluster


def _read_tasks(spec: dict) -> dict[str, tuple[str, ...]]:
    """TF_CONFIG's cluster object as canonical task type → addresses, every type checked."""
    tasks: dict[str, tuple[str, ...]] = {}
    for raw_type, addresses in spec.items():
        if raw_type in REFUSED:
            raise UserError(f"TF_CONFIG cluster has task type '{raw_type}': {REFUSED[raw_type]}")
        task_type = ALIASES.get(raw_type, raw_type)
        if task_type not in TASK_TYPES:
            raise UserError(f"TF_CONFIG cluster has task type '{raw_type}'; tfdp runs only "
                            f"{', '.join(TASK_TYPES)} (or master, the chief's other name)")
        if task_type in tasks:
            raise UserError("TF_CONFIG cluster has both 'chief' and 'master', two names for one task")
        if isinstance(addresses, dict):
            raise UserError(f"TF_CONFIG cluster.{raw_type} is a sparse map (a TFJob's enableDynamicWorker, made for "
                            "parameter-server training): multi-worker training needs every address in a list")
        if not isinstance(addresses, list) or not addresses or not all(isinstance(a, str) for a in addresses):
            raise UserError(f"TF_CONFIG cluster.{raw_type} must be a non-empty list of \"host:port\" strings")
        tasks[task_type] = tuple(addresses)
    if not any(t in tasks for t in TRAINING_TYPES):
        raise UserError("TF_CONFIG cluster lists no chief or worker to train")
    for task_type in ("chief", EVALUATOR):
        if len(tasks.get(task_type, ())) > 1:
            raise UserError(f"TF_CONFIG cluster has {len(tasks[task_type])} {task_type}s; at most one is allowed")
    return tasks


def _check_addresses(cluster: Cluster) -> None:
    seen: dict[str, str] = {}
    for task_type, index, address in cluster.all_tasks:
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UserError(f"TF_CONFIG address '{address}' of {task_type} {index} is not host:port")
        if address in seen:
            raise UserError(f"TF_CONFIG lists {address} twice ({seen[address]} and {task_type} {index})")
        seen[address] = f"{task_type} {index}"


def from_environment() -> Cluster:
    """The cluster from TF_CONFIG, else TFDP_WORKERS (Kubernetes), else a Slurm job step."""
    if os.environ.get("TF_CONFIG"):
        return parse_tf_config(os.environ["TF_CONFIG"])
    if os.environ.get("TFDP_WORKERS"):
        return from_worker_list(os.environ["TFDP_WORKERS"], os.environ.get("TFDP_WORKER_INDEX",
                                                                           os.environ.get("JOB_COMPLETION_INDEX")))
    if "SLURM_PROCID" in os.environ and "SLURM_STEP_NODELIST" in os.environ:
        return from_slurm(slurm_port_base())
    raise UserError("distribute.strategy multi_worker needs TF_CONFIG (or TFDP_WORKERS, or a Slurm job step); "
                    "use `tfdp launch --workers=N -- train ...` to start a local cluster")


def from_worker_list(workers: str, index: str | None) -> Cluster:
    """`TFDP_WORKERS=host0:2222,host1:2222` plus this worker's index.

    The index comes from TFDP_WORKER_INDEX or, in a Kubernetes Indexed Job,
    from JOB_COMPLETION_INDEX, so one pod template serves every worker.
    """
    if index is None or not index.strip().isdigit():
        raise UserError(f"TFDP_WORKERS is set but this worker's index is missing or not a number: {index!r} "
                        "(set TFDP_WORKER_INDEX, or run as a Kubernetes Indexed Job)")
    addresses = [a.strip() for a in workers.split(",") if a.strip()]
    return parse_tf_config(workers_tf_config(addresses, int(index)))


def check_consistent(tf_configs: dict[str, str]) -> None:
    """Checks that the TF_CONFIGs handed to each member (name → JSON) describe one cluster.

    Same task lists everywhere, and every task of the cluster claimed by exactly one member.
    """
    clusters = {name: parse_tf_config(text) for name, text in tf_configs.items()}
    first_name, first = next(iter(clusters.items()))
    claimed: dict[tuple[str, int], str] = {}
    for name, c in clusters.items():
        if c.tasks != first.tasks:
            raise UserError(f"{name}'s TF_CONFIG lists a different cluster than {first_name}'s")
        task = (c.task_type, c.task_index)
        if task in claimed:
            raise UserError(f"{name} and {claimed[task]} both claim {c.task_type} {c.task_index}")
        claimed[task] = name
    unclaimed = [f"{t} {i}" for t, i, _ in first.all_tasks if (t, i) not in claimed]
    if unclaimed:
        raise UserError(f"no member runs {', '.join(unclaimed)}")


SLURM_PORT_ENV = "TFDP_SLURM_PORT_BASE"
SLURM_PORT_BASE = 8888  # TensorFlow's SlurmClusterResolver default


def slurm_port_base() -> int:
    """The first worker port on each node under Slurm: TFDP_SLURM_PORT_BASE, else 8888.

    Task i of a node listens on base + i. 8888 is also Jupyter's default, so a
    shared node may have it taken: `TFDP_SLURM_PORT_BASE=9100 sbatch ...` (srun
    hands the job's environment to every task).
    """
    text = os.environ.get(SLURM_PORT_ENV, "").strip()
    if not text:
        return SLURM_PORT_BASE
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise UserError(f"{SLURM_PORT_ENV} must be a port number (1-65535), got {text!r}")
    return int(text)


def from_slurm(port_base: int = SLURM_PORT_BASE) -> Cluster:
    """One worker per Slurm task, through TensorFlow's SlurmClusterResolver (hostlist expansion, ports)."""
    from tensorflow.python.distribute.cluster_resolver.slurm_cluster_resolver import SlurmClusterResolver
    try:
        # GPU counts only matter to the resolver's CUDA_VISIBLE_DEVICES step, which is off; each
        # worker's MirroredStrategy finds its GPUs itself. Non-zero values avoid its range(step=0).
        resolver = SlurmClusterResolver(jobs={"worker": int(os.environ.get("SLURM_NTASKS", "1"))},
                                        port_base=port_base, auto_set_gpu=False,
                                        gpus_per_node=1 << 10, gpus_per_task=1)
        spec = resolver.cluster_spec().as_dict()
    except (RuntimeError, ValueError, KeyError) as e:
        raise UserError(f"cannot read the Slurm allocation: {e}") from None
    return Cluster({"worker": tuple(spec["worker"])}, "worker", resolver.task_id)


def to_tf_config(cluster: Cluster) -> str:
    """The whole cluster as TF_CONFIG JSON, under canonical task names (`chief`, never `master`)."""
    return tf_config_json({t: list(a) for t, a in cluster.tasks.items()}, cluster.task_type, cluster.task_index)


def training_tf_config(cluster: Cluster) -> str:
    """TF_CONFIG for a training member's TensorFlow: the chief and workers only, under canonical names.

    The evaluator is left out: it joins no collective, so the members' servers
    and their coordination service have nothing to say to it, and a cluster
    spec without it cannot make them wait for it or dial it.
    """
    if cluster.is_evaluator:
        raise ValueError("the evaluator does not train: it has no place in the training cluster")
    return tf_config_json({t: list(cluster.tasks[t]) for t in TRAINING_TYPES if t in cluster.tasks},
                          cluster.task_type, cluster.task_index)


def workers_tf_config(addresses: list[str], index: int) -> str:
    """The TF_CONFIG JSON for worker `index` of a cluster of only workers at `addresses`."""
    return tf_config_json({"worker": list(addresses)}, "worker", index)


def tf_config_json(tasks: dict[str, list[str]], task_type: str, index: int) -> str:
    """The TF_CONFIG JSON for task `index` of `task_type` in the cluster `tasks` (type → addresses)."""
    return json.dumps({"cluster": tasks, "task": {"type": task_type, "index": int(index)}})


def check_port_free(cluster: Cluster) -> None:
    """Fails fast when this task's own port is taken, instead of a gRPC error deep in TF.

    Taken means another process listens on it. Connections of a previous
    attempt still in TIME_WAIT (a requeued Slurm job or a restarted pod on the
    same port, seconds later) do not stop gRPC's server, which binds with
    SO_REUSEADDR, so they do not stop this check either.
    """
    port = int(cluster.address.rpartition(":")[2])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            raise UserError(f"port {port} of {cluster.describe(cluster.task_type, cluster.task_index)} "
                            "is already in use") from None


def unreachable(cluster: Cluster, timeout: float = 1.0) -> list[str]:
    """Members that accept no TCP connection: the ones that never came up."""
    missing = []
    for task_type, index, address in cluster.members:
        if (task_type, index) == (cluster.task_type, cluster.task_index):
            continue
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=timeout).close()
        except OSError:
            missing.append(cluster.describe(task_type, index))
    return missing


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (held open together, so they differ)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def evaluator_distribute(cfg: DistributeConfig) -> DistributeConfig:
    """The evaluator task's own strategy: `mirrored` over this host's devices (its GPUs, or
    `distribute.cpu_replicas`). It is no member of the training cluster and joins no collective, so the job's
    `multi_worker` does not apply to it, and TensorFlow must not see the cluster."""
    return dataclasses.replace(cfg, strategy="mirrored")

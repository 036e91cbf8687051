"""Cluster specs from TF_CONFIG and Slurm, checked before TensorFlow sees them."""

import json
import os
import socket
import subprocess
import sys

import pytest

from conftest import REPO, assert_one_line_error
from support.operators import service_address, tfjob_tf_config, tfjob_tf_configs
from tfdp.distribute import cluster as cluster_lib
from tfdp.errors import UserError


def spec(workers, task_type="worker", index=0, chief=None):
    cluster = {"worker": workers}
    if chief:
        cluster["chief"] = chief
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


def test_ranks_put_the_chief_first():
    c = cluster_lib.parse_tf_config(spec(["h1:1", "h2:2"], "worker", 1, chief=["h0:9"]))
    assert c.num_workers == 3 and c.rank == 2 and c.address == "h2:2"
    assert cluster_lib.parse_tf_config(spec(["h0:9"], "chief", 0, chief=["h1:1"])).rank == 0


def test_the_workers_on_a_host_are_those_at_its_address():
    """`tfdp launch`'s workers all listen on 127.0.0.1, a Kubernetes job's pods each on a host of its own, a Slurm
    job's tasks on their node: how many share this task's machine (and its memory); the evaluator trains nothing."""
    launch = cluster_lib.parse_tf_config(spec(["127.0.0.1:2000", "127.0.0.1:2001"], index=1, chief=["127.0.0.1:1999"]))
    assert launch.members_on_host == 3
    mixed = spec(["localhost:2000", "127.0.0.1:2001", "[::1]:2002", "127.0.1.1:2003", "node1:2004"], index=1)
    assert cluster_lib.parse_tf_config(mixed).members_on_host == 4   # loopback, however it is written
    pods = json.dumps({"cluster": {"worker": ["job-worker-0.ns:2222", "job-worker-1.ns:2222"],
                                   "evaluator": ["job-worker-0.ns:2223"]}, "task": {"type": "worker", "index": 0}})
    assert cluster_lib.parse_tf_config(pods).members_on_host == 1
    nodes = spec(["node1:5000", "node1:5001", "node2:5000", "node2:5001", "node2:5002"], index=3)
    assert cluster_lib.parse_tf_config(nodes).members_on_host == 3


def test_round_trip_through_tf_config():
    c = cluster_lib.parse_tf_config(spec(["a:1", "b:2"], index=1))
    assert cluster_lib.parse_tf_config(cluster_lib.to_tf_config(c)) == c


@pytest.mark.parametrize("text, message", [
    ('{"cluster": {"worker": ["a:1"]}, "task": ', "TF_CONFIG is not valid JSON"),
    ('[]', 'must be an object with "cluster" and "task"'),
    (spec(["a:1", "b:2"], index=2), "TF_CONFIG task index 2 is out of range: the cluster has 2 'worker' task(s)"),
    (spec(["a:1"], index=-1), "task index -1 is out of range"),
    (spec(["a:1"], "chief"), "TF_CONFIG task type 'chief' is not in the cluster (it has: worker)"),
    (spec(["a:1", "a:1"]), "TF_CONFIG lists a:1 twice (worker 0 and worker 1)"),
    (spec(["a:1"], chief=["a:1"]), "TF_CONFIG lists a:1 twice (chief 0 and worker 0)"),
    (spec(["a"]), "address 'a' of worker 0 is not host:port"),
    (spec(["a:99999"]), "is not host:port"),
    (spec([]), "cluster.worker must be a non-empty list"),
    (json.dumps({"cluster": {"ps": ["a:1"]}, "task": {"type": "ps", "index": 0}}), "has task type 'ps'"),
    (json.dumps({"cluster": {"tpu_worker": ["a:1"]}, "task": {"type": "tpu_worker"}}),
     "has task type 'tpu_worker'; tfdp runs only chief, worker, evaluator (or master"),
    (json.dumps({"cluster": {"chief": ["a:1"], "master": ["b:1"]}, "task": {"type": "chief"}}),
     "has both 'chief' and 'master'"),
    (json.dumps({"cluster": {"evaluator": ["a:1"]}, "task": {"type": "evaluator"}}), "lists no chief or worker"),
    (json.dumps({"cluster": {"worker": ["a:1"], "evaluator": ["b:1", "c:1"]}, "task": {"type": "worker"}}),
     "has 2 evaluators; at most one is allowed"),
    (json.dumps({"cluster": {"worker": ["a:1"], "evaluator": ["a:1"]}, "task": {"type": "worker"}}),
     "lists a:1 twice (worker 0 and evaluator 0)"),
    # A TFJob with enableDynamicWorker writes a sparse cluster: {"worker": {"1": "host:port"}}.
    (json.dumps({"cluster": {"worker": {"1": "a:1"}}, "task": {"type": "worker", "index": 1}}), "is a sparse map"),
])
def test_bad_tf_config_names_the_problem(text, message):
    with pytest.raises(UserError) as err:
        cluster_lib.parse_tf_config(text)
    assert message in str(err.value)


def test_no_cluster_at_all(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    with pytest.raises(UserError, match="needs TF_CONFIG"):
        cluster_lib.from_environment()


def test_port_in_use_is_detected():
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        c = cluster_lib.parse_tf_config(spec([f"127.0.0.1:{port}"]))
        with pytest.raises(UserError, match=f"port {port} of worker 0 \\(127.0.0.1:{port}\\) is already in use"):
            cluster_lib.check_port_free(c)
    cluster_lib.check_port_free(c)  # released: fine now


def test_unreachable_names_the_missing_workers():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        up = s.getsockname()[1]
        down = cluster_lib.free_ports(1)[0]
        c = cluster_lib.parse_tf_config(spec(["127.0.0.1:1", f"127.0.0.1:{up}", f"127.0.0.1:{down}"], index=0))
        assert cluster_lib.unreachable(c) == [f"worker 2 (127.0.0.1:{down})"]


def test_free_ports_are_distinct():
    ports = cluster_lib.free_ports(8)
    assert len(set(ports)) == 8


def test_slurm_allocation_becomes_one_worker_per_task(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    for key, value in {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_STEP_NODELIST": "node[01-02]",
                       "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NUM_TASKS": "4",
                       "SLURM_JOB_ID": "7"}.items():
        monkeypatch.setenv(key, value)
    c = cluster_lib.from_environment()
    assert c.tasks["worker"] == ("node01:8888", "node01:8889", "node02:8888", "node02:8889")
    assert (c.task_type, c.task_index, c.rank) == ("worker", 3, 3)


SLURM_STEP = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "node01",
              "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_ID": "7"}


def test_slurm_port_base_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.delenv("TFDP_WORKERS", raising=False)
    for key, value in {**SLURM_STEP, "TFDP_SLURM_PORT_BASE": "9100"}.items():
        monkeypatch.setenv(key, value)
    assert cluster_lib.from_environment().tasks["worker"] == ("node01:9100", "node01:9101")


def test_bad_slurm_port_base_is_one_line():
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "TFDP_WORKERS")}
    result = subprocess.run([sys.executable, "-m", "tfdp", "train", "--config=configs/digits.yaml",
                             "--strategy=multi_worker"], cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**env, **SLURM_STEP, "TFDP_SLURM_PORT_BASE": "88x8"})
    assert_one_line_error(result, 2, "TFDP_SLURM_PORT_BASE must be a port number (1-65535), got '88x8'")


def test_a_port_left_in_time_wait_is_free():
    """A requeued job or restarted pod comes back on the same port seconds later; gRPC binds it, so may we."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC's server binds
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        conn.close()  # the server side closes first: its end of the connection stays in TIME_WAIT
        client.close()
    cluster_lib.check_port_free(cluster_lib.parse_tf_config(spec([f"127.0.0.1:{port}"])))


# --- clusters as the Kubernetes operators write them (tests/support/operators.py quotes the operator's Go) ---

TFJOB = {"Chief": 1, "Worker": 2, "Evaluator": 1}


def test_a_tfjob_with_chief_workers_and_evaluator_is_read_on_every_pod():
    """Every pod's TF_CONFIG names the whole job; the chief and workers train (ranks 0-2), the evaluator is
    in the cluster but no member of the training, and TensorFlow is handed the members only."""
    pods = tfjob_tf_configs(TFJOB)
    first = json.loads(pods["Chief", 0])
    assert first["environment"] == "cloud" and first["cluster"]["evaluator"] == ["tfdp-evaluator-0.default.svc:2222"]
    clusters = {pod: cluster_lib.parse_tf_config(text) for pod, text in pods.items()}
    trainers = {pod: c for pod, c in clusters.items() if not c.is_evaluator}
    assert {pod: c.rank for pod, c in trainers.items()} == {("Chief", 0): 0, ("Worker", 0): 1, ("Worker", 1): 2}
    assert {c.num_workers for c in clusters.values()} == {3}
    evaluator = clusters["Evaluator", 0]
    assert evaluator.is_evaluator and evaluator.address == "tfdp-evaluator-0.default.svc:2222"
    assert "evaluator" not in {t for t, _, _ in evaluator.members}
    with pytest.raises(ValueError, match="the evaluator has no rank"):
        evaluator.rank
    for c in trainers.values():
        seen_by_tf = json.loads(cluster_lib.training_tf_config(c))
        assert seen_by_tf["cluster"] == {"chief": ["tfdp-chief-0.default.svc:2222"],
                                         "worker": ["tfdp-worker-0.default.svc:2222", "tfdp-worker-1.default.svc:2222"]}
        assert seen_by_tf["task"] == {"type": c.task_type, "index": c.task_index}
    cluster_lib.check_consistent({f"{rt} {i}": text for (rt, i), text in pods.items()})
    with pytest.raises(UserError, match="no member runs evaluator 0"):
        cluster_lib.check_consistent({f"{rt} {i}": text for (rt, i), text in pods.items() if rt != "Evaluator"})


def test_a_tfjob_master_is_the_chief():
    """TFJob's `Master` replica is its older name for `Chief` ("semantically equivalent", tensorflow_types.go);
    TensorFlow's cluster checks know only `chief`, so tfdp reads it as the chief and hands TensorFlow that name."""
    replicas = {"Master": 1, "Worker": 2}
    master = cluster_lib.parse_tf_config(tfjob_tf_config(replicas, "Master", 0))
    assert (master.task_type, master.rank, master.num_workers) == ("chief", 0, 3)
    assert master.address == "tfdp-master-0.default.svc:2222"
    seen_by_tf = json.loads(cluster_lib.training_tf_config(master))
    assert seen_by_tf == {"cluster": {"chief": ["tfdp-master-0.default.svc:2222"],
                                      "worker": ["tfdp-worker-0.default.svc:2222", "tfdp-worker-1.default.svc:2222"]},
                          "task": {"type": "chief", "index": 0}}
    assert cluster_lib.parse_tf_config(tfjob_tf_config(replicas, "Worker", 1)).rank == 2


@pytest.mark.parametrize("rtype", ["Worker", "PS"])
def test_a_tfjob_with_parameter_servers_is_refused_on_every_pod(rtype):
    with pytest.raises(UserError) as err:
        cluster_lib.parse_tf_config(tfjob_tf_config({"PS": 2, "Worker": 2}, rtype, 0))
    assert str(err.value).startswith("TF_CONFIG cluster has task type 'ps': parameter-server training "
                                     "(ParameterServerStrategy) is not supported")


def test_a_bad_config_exits_2_on_every_pod(tmp_path):
    """The same command on every pod of a TFJob: a config mistake is one line and status 2 on each of them,
    the evaluator's included (2 is below 128: TFJob's ExitCode policy does not restart it)."""
    config = tmp_path / "bad.yaml"
    config.write_text(f"model_dir: {tmp_path / 'run'}\ntrain:\n  epohcs: 3\n")
    ports = iter(cluster_lib.free_ports(4))
    local = {f"{rt}-{i}": f"127.0.0.1:{next(ports)}" for rt, n in TFJOB.items() for i in range(n)}
    pods = tfjob_tf_configs(TFJOB, lambda rt, i: local[f"{rt}-{i}"])
    env = {k: v for k, v in os.environ.items() if k not in ("TFDP_WORKERS", "SLURM_PROCID")}
    procs = {pod: subprocess.Popen([sys.executable, "-m", "tfdp", "train", f"--config={config}"], cwd=REPO,
                                   env={**env, "TF_CONFIG": text}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True)
             for pod, text in pods.items()}
    for pod, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert_one_line_error(subprocess.CompletedProcess(proc.args, proc.returncode, out, err), 2,
                              "unknown config key 'train.epohcs'; did you mean 'train.epochs'?")
    assert not (tmp_path / "run").exists()


def test_the_service_addresses_are_the_operators():
    """genClusterSpec's `<job>-<type>-<i>.<namespace>.svc:<port>`."""
    assert service_address("imagenet", "ml", 2222)("Worker", 3) == "imagenet-worker-3.ml.svc:2222"

"""Cluster specs from TF_CONFIG and Slurm, checked before TensorFlow sees them."""

import json
import os
import socket
import subprocess
import sys

import pytest

from conftest import REPO, assert_one_line_error
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

"""Cluster specs from TF_CONFIG and Slurm, checked before TensorFlow sees them."""

import json
import socket

import pytest

from tfdp import cluster as cluster_lib
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

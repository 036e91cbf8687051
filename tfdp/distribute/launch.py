"""`tfdp launch --workers=N -- train ...`: an N-worker cluster on this host.

Picks N free loopback ports, gives every worker process its own TF_CONFIG and
`--strategy=multi_worker`, writes each worker's output to its own log file and
to the console with a `[worker i]` prefix, forwards SIGINT/SIGTERM, and if any
worker fails, stops the others and exits with a status that says why. Running
the same command again resumes from the last checkpoint in model_dir.

With `--data_workers=N` it also starts a tf.data service on this host: a
dispatcher (its journal in the scratch folder) and N service workers, as
`tfdp data-service` processes with their own logs and `[dispatcher]` /
`[data worker i]` prefixes; every trainer gets `--data_service` pointing at
the dispatcher, and the service is stopped (SIGTERM) once the trainers are
done, whatever ended them. A service process that dies does not end the
launch: the trainers go on with the workers that are left.

Every worker's temporary files (TMPDIR) go to one scratch folder per launch,
`tfdp-launch-PID-*` in the system temp dir, removed once the workers are gone,
whatever ended them; one left by a launcher that was itself killed is removed
by the next launch.

Exit status of `tfdp launch`:

  0    every worker finished
  2    a usage or config error (the launcher's own, or a worker's, passed on)
  3    EXIT_CLUSTER_TIMEOUT: the workers did not all join within
       distribute.startup_timeout (a worker's watchdog ended it)
  4    EXIT_WORKER_KILLED: a worker was ended by a signal the launcher did not
       send (kill -9, the OOM killer); the message names the signal
  N    any other non-zero status of the first worker to fail, passed on
       (1 a crash; 143 stopped with everything saved: preempted, or a peer,
       the tf.data service or a bucket lost; the same command resumes)
  128+N  the launcher was sent signal N (SIGINT, SIGTERM), forwarded it, and
       a worker ended by it

As everywhere in tfdp (tfdp/errors.py, docs/faults.md), 1-127 is permanent
and 128-255 asks for the same command again.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from tfdp.distribute import watchdog
from tfdp.distribute.cluster import free_ports, workers_tf_config
from tfdp.errors import PREEMPTED_EXIT_CODE, UserError
from tfdp.rundir.lease import process_exists
from tfdp.rundir.writable import writable_dir
from tfdp.startup.console import say

GRACE_SECONDS = 10.0
SCRATCH_PREFIX = "tfdp-launch-"

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_CLUSTER_TIMEOUT = 3
EXIT_WORKER_KILLED = 4


def worker_env(addresses: list[str], index: int, scratch: str) -> dict[str, str]:
    """The worker's environment: its TF_CONFIG, and temporary files and watchdog mark in the launch's scratch."""
    return {**os.environ, "TF_CONFIG": workers_tf_config(addresses, index), "PYTHONUNBUFFERED": "1", "TMPDIR": scratch,
            watchdog.MARK_ENV: mark_path(scratch, index)}


def mark_path(scratch: str, index: int) -> str:
    return os.path.join(scratch, f"worker-{index}.startup-timeout")


def _pump(proc: subprocess.Popen, prefix: str, log_path: str, console_lock: threading.Lock) -> None:
    with open(log_path, "w", encoding="utf-8") as log:
        for line in proc.stdout:
            log.write(line)
            log.flush()
            with console_lock:
                sys.stdout.write(f"{prefix}{line}")
                sys.stdout.flush()


def launch(num_workers: int, child_args: list[str], log_dir: str, data_workers: int = 0) -> int:
    if num_workers < 1:
        raise UserError(f"--workers must be at least 1, got {num_workers}")
    if data_workers < 0:
        raise UserError(f"--data_workers must be 0 or more, got {data_workers}")
    if not child_args or child_args[0] != "train":
        raise UserError("launch runs a training command: tfdp launch --workers=N -- train --config=...")
    writable_dir(log_dir, "--launch_logs")   # before any process starts: a log it could not write is one line
    _remove_stale_scratch()
    scratch = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-")
    procs: list[subprocess.Popen] = []
    services: list[subprocess.Popen] = []
    lock = threading.Lock()
    ports = free_ports(num_workers + 1)  # one call, so the dispatcher's port differs from the workers'
    addresses = [f"127.0.0.1:{p}" for p in ports[:num_workers]]
    try:
        if data_workers:
            dispatcher = _start_service(data_workers, ports[-1], log_dir, scratch, services, lock)
            child_args = [*child_args, f"--data_service={dispatcher}"]
        return _run(addresses, child_args, log_dir, scratch, procs, lock)
    finally:
        _stop(procs)  # nothing to do unless the launcher itself failed
        _stop(services)
        shutil.rmtree(scratch, ignore_errors=True)


def _start_service(data_workers: int, port: int, log_dir: str, scratch: str, procs: list,
                   lock: threading.Lock) -> str:
    """Starts a dispatcher and `data_workers` service workers on loopback; returns the dispatcher's address.

    The trainers wait for the dispatcher (data.service_timeout) and the
    service waits for its workers, so nothing here waits for either.
    """
    address = f"127.0.0.1:{port}"
    roles = [("dispatcher", "dispatcher", [f"--port={port}", f"--work_dir={os.path.join(scratch, 'dispatcher')}"])]
    roles += [(f"data worker {i}", "worker", ["--port=0", f"--dispatcher_address={address}"])
              for i in range(data_workers)]
    for name, role, flags in roles:
        command = [sys.executable, "-m", "tfdp", "data-service", role, *flags]
        log = os.path.join(log_dir, f"{name.replace(' ', '-')}.log")
        proc = subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
        procs.append(proc)
        say(f"tfdp: launch: {name} pid {proc.pid}, log {log}")
        threading.Thread(target=_pump, args=(proc, f"[{name}] ", log, lock), daemon=True).start()
    return f"grpc://{address}"


def _run(addresses: list[str], child_args: list[str], log_dir: str, scratch: str, procs: list,
         lock: threading.Lock) -> int:
    """Starts the workers (appending each to `procs` at once, for the caller's cleanup) and waits for them."""
    num_workers = len(addresses)
    command = [sys.executable, "-m", "tfdp", *child_args, "--strategy=multi_worker"]
    pumps = []
    for i in range(num_workers):
        proc = subprocess.Popen(command, env=worker_env(addresses, i, scratch), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
        procs.append(proc)
        say(f"tfdp: launch: worker {i} pid {proc.pid} at {addresses[i]}, "
            f"log {os.path.join(log_dir, f'worker-{i}.log')}")
        pump = threading.Thread(target=_pump, args=(proc, f"[worker {i}] ", os.path.join(log_dir, f"worker-{i}.log"), lock),
                                daemon=True)
        pump.start()
        pumps.append(pump)

    forwarded: set[int] = set()

    def forward(signum, _frame):
        forwarded.add(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)
    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        index, code = _wait(procs)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for pump in pumps:
            pump.join(timeout=5)
    if index is None:
        return EXIT_OK
    status, why = _explain(code, mark_path(scratch, index), forwarded)
    sys.stderr.write(f"tfdp: error: worker {index} {why}; stopped the other workers\n")
    return status


def _wait(procs: list[subprocess.Popen]) -> tuple[int | None, int]:
    """(None, 0) when every worker succeeds; else (index, status) of the first failure, after stopping the rest."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            if failed[0][1] == PREEMPTED_EXIT_CODE:
                _let_exit(procs, GRACE_SECONDS)
            _stop(procs)
            return failed[0]
        if all(c == 0 for c in codes):
            return None, 0
        time.sleep(0.2)


def _let_exit(procs: list[subprocess.Popen], seconds: float) -> None:
    """Waits up to `seconds` for the workers to end on their own. After a save at an agreed step every
    worker is on its way out with the same status; a SIGTERM now would find its preemption handler gone
    and end it before it says where it saved."""
    deadline = time.time() + seconds
    while any(p.poll() is None for p in procs) and time.time() < deadline:
        time.sleep(0.05)


def _explain(code: int, mark: str, forwarded: set[int]) -> tuple[int, str]:
    """The launcher's exit status for a worker's `code` (Popen's: -N for signal N), and the reason in words."""
    if code == PREEMPTED_EXIT_CODE:
        return code, (f"stopped after saving a checkpoint (status {code}: preempted, or lost a peer, the "
                      f"tf.data service or a bucket; run the same command to continue)")
    if code > 0:
        return code, f"exited with status {code}"
    signum = -code
    if signum in forwarded:
        return 128 + signum, f"ended by {_signal_name(signum)}, forwarded by the launcher"
    if os.path.exists(mark):
        with open(mark, encoding="utf-8") as f:
            return EXIT_CLUSTER_TIMEOUT, f"gave up: {f.read().strip()}"
    return EXIT_WORKER_KILLED, f"was killed by {_signal_name(signum)}, which the launcher did not send"


def _signal_name(signum: int) -> str:
    try:
        return f"{signal.Signals(signum).name} (signal {signum})"
    except ValueError:
        return f"signal {signum}"


def _stop(procs: list[subprocess.Popen]) -> None:
    """Ends the workers still running: SIGTERM, then SIGKILL after the grace period."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
            p.send_signal(signal.SIGCONT)  # a stopped worker (SIGSTOP, ^Z) would sit out the whole grace
    deadline = time.time() + GRACE_SECONDS
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.time(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _remove_stale_scratch() -> None:
    """Removes this user's scratch folders whose launcher is gone (it was killed before its cleanup ran)."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        if not name.startswith(SCRATCH_PREFIX):
            continue
        path = os.path.join(root, name)
        pid = name[len(SCRATCH_PREFIX):].split("-", 1)[0]
        with contextlib.suppress(OSError, ValueError):
            if os.stat(path).st_uid == os.getuid() and not process_exists(int(pid)):
                shutil.rmtree(path, ignore_errors=True)

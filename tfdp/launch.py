"""`tfdp launch --workers=N -- train ...`: an N-worker cluster on this host.

Picks N free loopback ports, gives every worker process its own TF_CONFIG and
`--strategy=multi_worker`, writes each worker's output to its own log file and
to the console with a `[worker i]` prefix, forwards SIGINT/SIGTERM, and if any
worker fails, stops the others and exits with that worker's status. Running
the same command again resumes from the last checkpoint in model_dir.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

from tfdp.cluster import free_ports
from tfdp.errors import UserError

GRACE_SECONDS = 10.0


def worker_env(addresses: list[str], index: int) -> dict[str, str]:
    tf_config = {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": index}}
    return {**os.environ, "TF_CONFIG": json.dumps(tf_config), "PYTHONUNBUFFERED": "1"}


def _pump(proc: subprocess.Popen, prefix: str, log_path: str, console_lock: threading.Lock) -> None:
    with open(log_path, "w", encoding="utf-8") as log:
        for line in proc.stdout:
            log.write(line)
            log.flush()
            with console_lock:
                sys.stdout.write(f"{prefix}{line}")
                sys.stdout.flush()


def launch(num_workers: int, child_args: list[str], log_dir: str) -> int:
    if num_workers < 1:
        raise UserError(f"--workers must be at least 1, got {num_workers}")
    if not child_args or child_args[0] != "train":
        raise UserError("launch runs a training command: tfdp launch --workers=N -- train --config=...")
    os.makedirs(log_dir, exist_ok=True)
    addresses = [f"127.0.0.1:{p}" for p in free_ports(num_workers)]
    command = [sys.executable, "-m", "tfdp", *child_args, "--strategy=multi_worker"]
    lock = threading.Lock()
    procs, pumps = [], []
    for i in range(num_workers):
        proc = subprocess.Popen(command, env=worker_env(addresses, i), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
        procs.append(proc)
        print(f"tfdp: launch: worker {i} pid {proc.pid} at {addresses[i]}, "
              f"log {os.path.join(log_dir, f'worker-{i}.log')}", flush=True)
        pump = threading.Thread(target=_pump, args=(proc, f"[worker {i}] ", os.path.join(log_dir, f"worker-{i}.log"), lock),
                                daemon=True)
        pump.start()
        pumps.append(pump)

    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)
    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        status = _wait(procs)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for pump in pumps:
            pump.join(timeout=5)
    return status


def _wait(procs: list[subprocess.Popen]) -> int:
    """0 when every worker succeeds; else the first failure's status, after stopping the rest."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            index, code = failed[0]
            _stop(procs)
            sys.stderr.write(f"tfdp: error: worker {index} exited with status {code}; stopped the other workers\n")
            return code if code > 0 else 128 - code
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.2)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.time() + GRACE_SECONDS
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.time(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

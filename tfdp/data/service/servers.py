"""`tfdp data-service dispatcher|worker`: the processes of a tf.data service.

A training run with `data.service_address` set sends its training pipeline
to a dispatcher, which hands it to every registered worker; the workers read,
decode and crop, and stream finished batches to the trainers
(`tfdp.data.service.client`). Input then scales with the number of worker processes
(or hosts), not with the trainer's own CPUs.

Both processes run until SIGTERM or SIGINT and then exit 0, so a scheduler's
ordinary stop is a clean end. They hide every GPU from TensorFlow: the
pipeline is CPU work, and a worker on a GPU host must not take the trainer's
device memory. The dispatcher keeps a journal in `--work_dir` (TensorFlow's
fault-tolerant mode), so one restarted on the same directory knows the
registered datasets and running jobs again and the trainers carry on.

A worker can be lost at any time: the trainers read from the others
meanwhile. But TensorFlow 2.21's dispatcher never forgets a worker address
it has seen (its journal neither), and gives every job made later a task on
it, which the trainers keep retrying in the background. That costs training
nothing, since its streams are endless, but a finite read through the service
would wait for that task forever. So give workers stable addresses (a
StatefulSet's DNS names, a Compose container's IP): a replaced worker then
registers as the same worker and takes its tasks up again.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time

from tfdp.config import DEFAULT_CACHE_DIR
from tfdp.errors import UserError, first_line
from tfdp.startup.console import say

# Workers heartbeat this often; a heartbeat is how a worker, new or restarted, gets its tasks of the
# running jobs, so with TensorFlow's default (30 s) a replaced worker would idle half a minute.
HEARTBEAT_MS = 1_000
# A job no trainer has read for JOB_GC_TIMEOUT_MS is deleted (checked every JOB_GC_CHECK_MS), its tasks
# with it. TensorFlow keeps `distributed_epoch` jobs forever by default, since one recreated under
# the same name would break its visit-once guarantee; tfdp never reuses a job name (`tfdp.train.task`), and
# its jobs are endless, so without this every finished run would leave its tasks on every worker.
JOB_GC_TIMEOUT_MS = 300_000
JOB_GC_CHECK_MS = 60_000
ROLES = ("dispatcher", "worker")


def dispatcher(port: int, work_dir: str | None) -> None:
    """Runs a dispatcher until SIGTERM/SIGINT; with `work_dir`, one that a restart recovers (its journal)."""
    _check_port_free(port, "dispatcher")
    if work_dir:
        work_dir = os.path.abspath(os.path.expanduser(work_dir))
        try:
            os.makedirs(work_dir, exist_ok=True)
        except OSError as e:
            raise UserError(f"cannot make the dispatcher's --work_dir {work_dir}: {e.strerror or e}") from None
    tf = _cpu_only_tensorflow()
    service = tf.data.experimental.service
    from tensorflow.core.protobuf import service_config_pb2  # the full config: the Python one lacks the GC switch
    config = service_config_pb2.DispatcherConfig(
        port=port, protocol="grpc", work_dir=work_dir or "", fault_tolerant_mode=bool(work_dir),
        gc_dynamic_sharding_jobs=True, job_gc_timeout_ms=JOB_GC_TIMEOUT_MS,
        job_gc_check_interval_ms=JOB_GC_CHECK_MS)
    server = _started(lambda: service.DispatchServer(config), f"dispatcher on port {port}")
    journal = f"journal in {work_dir}" if work_dir else "no --work_dir: a restart forgets every job"
    port = _port(server)
    _serve(server, f"dispatcher at grpc://{socket.gethostname()}:{port} ({journal}), {listening_line(port)}")


def worker(dispatcher_address: str, port: int, worker_address: str | None, mirror: tuple[str, ...] = (),
           cache_dir: str = DEFAULT_CACHE_DIR, dispatcher_timeout: float = 60.0) -> None:
    """Runs a worker of the dispatcher at `dispatcher_address` until SIGTERM/SIGINT.

    `worker_address` is the host name (or host:port) the dispatcher hands to
    trainers to reach this worker: `localhost` only works when all run on one
    host, so a cluster passes the pod's or container's own name or IP, or
    `auto`: the IP address this host's own name resolves to (a container's).
    Each bucket prefix in `mirror` is copied into `cache_dir` before the worker
    registers: trainers training from a bucket send the paths of these copies
    (`data.service_cache_dir`), so the workers, not the trainers, read the data.
    A dispatcher that does not answer within `dispatcher_timeout` s is one line.
    """
    if not dispatcher_address:
        raise UserError("tfdp data-service worker needs --dispatcher_address=HOST:PORT (the dispatcher's)")
    _check_port_free(port, "worker")
    with _dispatcher_channel(dispatcher_address, dispatcher_timeout, "--dispatcher_address"):
        pass
    from tfdp.data import storage
    for url in mirror:
        files, size = storage.mirror(url, cache_dir)
        say(f"tfdp: data-service: mirrored {files} files ({size / 2**20:.1f} MB) of {url} into {cache_dir}")
    tf = _cpu_only_tensorflow()
    service = tf.data.experimental.service
    address = worker_address or "localhost"
    if address == "auto":
        address = socket.gethostbyname(socket.gethostname())
    if ":" not in address:
        address += ":%port%"  # TensorFlow fills in the port it bound
    config = service.WorkerConfig(dispatcher_address=strip_protocol(dispatcher_address), worker_address=address,
                                  port=port, heartbeat_interval_ms=HEARTBEAT_MS)
    server = _started(lambda: service.WorkerServer(config), f"worker on port {port}")
    shown = address.replace("%port%", str(_port(server)))
    _serve(server, f"worker at {shown}, dispatcher {dispatcher_address}, {listening_line(_port(server))}")


def listening_line(port: int) -> str:
    """Where the server on `port` listens, as the kernel says (its TCP listening sockets), for the start-up line.

    TensorFlow's tf.data service binds `0.0.0.0:PORT` whatever it is told
    (`GrpcDataServerBase::Start`; neither DispatcherConfig nor WorkerConfig
    has a bind address), which gRPC turns into every IPv4 and IPv6 interface.
    tfdp cannot narrow that, so it says so: the port must be kept inside the
    job by the network (docs/security.md).
    """
    found = listening_addresses(port) or [f"0.0.0.0:{port}"]
    wildcard = any(a.startswith(("[::]:", "0.0.0.0:")) for a in found)
    return (f"listening on {' and '.join(found)}"
            + (" (every interface: TensorFlow binds no single address; keep the port inside the job, "
               "docs/security.md)" if wildcard else ""))


def listening_addresses(port: int) -> list[str]:
    """host:port of every TCP socket listening on `port` on this host (/proc/net/tcp6 and tcp; [] off Linux)."""
    found = []
    for table, family in (("/proc/net/tcp6", socket.AF_INET6), ("/proc/net/tcp", socket.AF_INET)):
        try:
            with open(table, encoding="ascii") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            address, hex_port = fields[1].rsplit(":", 1)
            if fields[3] != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                continue
            raw = b"".join(bytes.fromhex(address[i:i + 8])[::-1] for i in range(0, len(address), 8))
            host = socket.inet_ntop(family, raw)
            found.append(f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}")
    return list(dict.fromkeys(found))


def strip_protocol(address: str) -> str:
    """host:port of `grpc://host:port` (workers take the dispatcher's address without the protocol)."""
    return address.split("://", 1)[-1]


def check_service(address: str, timeout: float) -> None:
    """Waits up to `timeout` s for the dispatcher at `address` to answer and to have a worker, else one line.

    TensorFlow's own client retries an absent dispatcher for an hour, and a
    trainer would hang in its first step; with no worker it would wait for
    batches forever. This check runs before TensorFlow even loads. It
    retries (the dispatcher and its workers may be starting beside the
    trainer), so only a service short of either for the whole timeout fails
    it. A dispatcher remembers every worker it has seen, so this cannot tell
    that workers which once registered have all gone since.
    """
    deadline = time.monotonic() + timeout
    with _dispatcher_channel(address, timeout, "data.service_address",
                             "or leave data.service_address empty for the local pipeline") as channel:
        get_workers = channel.unary_unary(GET_WORKERS, request_serializer=bytes, response_deserializer=bytes)
        while not _workers_now(get_workers, deadline):
            if time.monotonic() >= deadline:
                raise UserError(f"the tf.data service dispatcher at {address} has no worker after {timeout:g} s "
                                f"(data.service_timeout); start one with `tfdp data-service worker "
                                f"--dispatcher_address={strip_protocol(address)}`")
            time.sleep(0.5)


@contextlib.contextmanager
def _dispatcher_channel(address: str, timeout: float, setting: str, alternative: str = ""):
    """A gRPC channel to the dispatcher once it answers, retried for `timeout` s; else one line naming
    `setting` (TensorFlow's own clients would retry silently for an hour)."""
    import grpc
    options = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000)]
    with grpc.insecure_channel(strip_protocol(address), options=options) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise UserError(f"no tf.data service dispatcher answered at {address} within {timeout:g} s ({setting}); "
                            f"start one with `tfdp data-service dispatcher`"
                            + (f", {alternative}" if alternative else "")) from None
        yield channel


def _workers_now(get_workers, deadline: float) -> int:
    """The dispatcher's worker count; a dispatcher without the RPC (another TensorFlow) passes the check."""
    import grpc
    try:
        return registered_workers(get_workers(b"", timeout=max(deadline - time.monotonic(), 1.0)))
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.UNIMPLEMENTED:
            return 1
        return 0  # restarting, say: asked again until the deadline


# The dispatcher's RPC listing its workers (tensorflow/core/data/service/dispatcher.proto); TensorFlow's
# wheel has no Python stubs for it, so the call is made with raw bytes: the request is the empty message.
GET_WORKERS = "/tensorflow.data.DispatcherService/GetWorkers"


def registered_workers(response: bytes) -> int:
    """Workers in a serialized GetWorkersResponse: entries of its one field, `repeated WorkerInfo workers = 1`.

    Walks the message's top-level fields (protobuf wire format: a varint key
    of field number and type, then a varint length for length-delimited
    fields) and counts field 1.
    """
    def varint(at: int) -> tuple[int, int]:
        value = shift = 0
        while True:
            byte = response[at]
            value |= (byte & 0x7F) << shift
            at, shift = at + 1, shift + 7
            if byte < 0x80:
                return value, at
    count = at = 0
    while at < len(response):
        key, at = varint(at)
        if key & 7 != 2:
            raise ValueError(f"unexpected wire type {key & 7} in GetWorkersResponse")
        length, at = varint(at)
        count, at = count + (key >> 3 == 1), at + length
    return count


def _cpu_only_tensorflow():
    """TensorFlow with no GPU visible: service processes do CPU work only."""
    from tfdp.startup import console
    console.import_tensorflow()
    import tensorflow as tf
    tf.config.set_visible_devices([], "GPU")
    return tf


def _check_port_free(port: int, role: str) -> None:
    """A taken port is an error here: gRPC binds with SO_REUSEPORT, so a second dispatcher on the same port
    would start without complaint and take half of the first one's requests."""
    if not port:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart's old connections in TIME_WAIT are fine
        try:
            s.bind(("", port))
        except OSError:
            raise UserError(f"port {port} for the tf.data service {role} is already in use") from None


def _started(make, what: str):
    """The server `make()` builds and starts, or a one-line error (a port in use, an unreadable journal)."""
    import tensorflow as tf
    try:
        return make()
    except (tf.errors.OpError, ValueError) as e:
        raise UserError(f"could not start the tf.data service {what}: {first_line(e, 200)}") from None


def _port(server) -> int:
    return int(server._address.rsplit(":", 1)[1])  # the bound port (the config may say 0)


def _serve(server, what: str) -> None:
    """Prints one line naming the server, blocks until SIGTERM or SIGINT, then ends the process with status 0.

    The wait is a Python event, not the server's `join()`: a signal handler
    only runs between Python bytecodes, never during a blocking C++ call.
    The server is not stopped first: a worker's `stop()` waits for its
    tasks' input threads, which endless jobs whose trainers are gone never
    end, and it holds the interpreter lock while it waits (measured: a
    worker that served a few runs did not stop within 30 s). Ending the
    process loses nothing: the dispatcher journals every change before it
    answers, and a worker holds no state.
    """
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    say(f"tfdp: data-service: {what}")
    while not stop.wait(1.0):
        pass
    say("tfdp: data-service: stopped")
    os._exit(0)  # not sys.exit: the server's destructor (`server` is still referenced here) would call stop()

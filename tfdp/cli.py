"""The `tfdp` absl application: `tfdp COMMAND [--flags]`.

Flags override the YAML config: the dedicated ones below for common fields,
`--set=section.key=value` (repeatable) for any field. The config is validated
once, here, before any TensorFlow work starts, and a `UserError` from anywhere
becomes one line on stderr with exit status 2 (or its own `exit_code`: a diverged run's 5).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys

from absl import app, flags

from tfdp import config as config_lib
from tfdp.startup import console
from tfdp.errors import PREEMPTED_EXIT_CODE, Preempted, Restartable, UserError
from tfdp.startup.console import say

FLAGS = flags.FLAGS
flags.DEFINE_string("config", None, "YAML config file (see configs/). Defaults apply to anything it leaves out.")
flags.DEFINE_multi_string("set", [], "Override any config field: --set=optimizer.lr=0.2 (value parsed as YAML; repeatable).")
flags.DEFINE_string("model_dir", None, "Override model_dir: checkpoints, logs and the resolved config go here (a local or shared path, gs://... or s3://...).")
flags.DEFINE_integer("epochs", None, "Override train.epochs.")
flags.DEFINE_integer("batch_size_per_replica", None, "Override train.batch_size_per_replica (images per replica per micro-batch; see train.global_batch).")
flags.DEFINE_string("strategy", None, "Override distribute.strategy: one_device | mirrored | multi_worker.")
flags.DEFINE_integer("cpu_replicas", None, "Override distribute.cpu_replicas: logical CPU devices to split a GPU-less host into.")
flags.DEFINE_string("model", None, "Override model.name (a registry name, see tfdp/models).")
flags.DEFINE_string("init_from", None, "Override model.init_from: imagenet, a run directory, a checkpoint folder, a "
                    ".keras, .weights.h5 or .safetensors file or a keras-hub preset folder to start a fresh run from "
                    "(local, or gs://... / s3://..., copied into data.cache_dir first), or a Hugging Face Hub "
                    "repository (hf-hub:timm/NAME, hf://ORG/NAME; fetched into its cache first).")
flags.DEFINE_string("data_dir", None, "Override data.dir.")
flags.DEFINE_string("data_format", None, "Override data.format (a registry name, see tfdp/data).")
flags.DEFINE_integer("workers", 2, "launch: number of worker processes to start on this host.")
flags.DEFINE_string("launch_logs", "tfdp-logs", "launch: directory for one log file per worker.")
flags.DEFINE_integer("max_replicas", 2, "benchmark: measure 1..max_replicas replicas.", lower_bound=1)
flags.DEFINE_integer("steps", 20, "benchmark: timed training steps per measurement.", lower_bound=1)
flags.DEFINE_integer("warmup_steps", 5, "benchmark: untimed steps first (tracing, autotuning).", lower_bound=1)
flags.DEFINE_string("benchmark_dir", None, "benchmark: output directory (default: model_dir/benchmark).")
flags.DEFINE_string("checkpoint", None, "evaluate/export/predict: weights file to load (default: the best checkpoint "
                    "in model_dir); local, or gs://... / s3://..., copied into data.cache_dir first.")
flags.DEFINE_boolean("continuous", False, "evaluate: the evaluator beside a run: evaluate each checkpoint the run in "
                     "model_dir commits, once, as it comes, until its last epoch's (docs/runs.md).")
flags.DEFINE_float("poll_seconds", 10.0, "evaluate --continuous: seconds between looks for a new committed checkpoint.")
flags.DEFINE_float("eval_timeout", 3600.0, "evaluate --continuous: stop when no new checkpoint came for this many "
                   "seconds (0: wait for ever).")
flags.DEFINE_string("input", None, "predict: the images: a folder (recursive), a file, a quoted glob pattern, or a "
                    "gs:// / s3:// prefix.")
flags.DEFINE_string("output", None, "predict: where the rows go: FILE.jsonl or FILE.csv (written atomically).")
flags.DEFINE_integer("top_k", None, "predict: classes (with probabilities) per image (default: 5, or all the "
                     "model's classes when it has fewer).")
flags.DEFINE_string("export_dir", None, "export: output directory (default: model_dir/export).")
flags.DEFINE_string("format", "saved_model,keras", "export: comma list of formats to write: saved_model, keras, "
                    "onnx, onnx_int8, litert, litert_float16, litert_int8 (see docs/export.md).")
flags.DEFINE_boolean("verify", True, "export: load each written format back in its own runtime and compare its "
                     "top-1 and outputs with the Keras model's on the validation split.")
flags.DEFINE_integer("verify_images", 1000, "export: how many validation images --verify runs (0: all).")
flags.DEFINE_string("data_service", None, "Override data.service_address: train through this tf.data service "
                    "dispatcher (grpc://host:port); empty: the local pipeline.")
flags.DEFINE_integer("data_workers", 0, "launch: also start a local tf.data service dispatcher and this many workers, "
                     "and train through them.")
flags.DEFINE_integer("port", None, "data-service: port to listen on (dispatcher default 5050, worker any free one).",
                     lower_bound=0, upper_bound=65535)
flags.DEFINE_string("dispatcher_address", None, "data-service worker: the dispatcher's host:port.")
flags.DEFINE_string("worker_address", None, "data-service worker: host name or IP trainers reach this worker at "
                    "(default localhost: one host only; auto: the IP this host's name resolves to).")
flags.DEFINE_list("mirror", [], "data-service worker: bucket prefixes (gs://..., s3://...) to copy into --cache_dir "
                  "before serving, so trainers training from them send local paths and read none of it themselves.")
flags.DEFINE_float("dispatcher_timeout", 60.0, "data-service worker: seconds to wait for the dispatcher to answer "
                   "at start before stopping with an error.")
flags.DEFINE_string("cache_dir", None, "data-service worker: where --mirror copies go; must be the trainers' "
                    "data.service_cache_dir (default: data.cache_dir's default).")
flags.DEFINE_string("work_dir", None, "data-service dispatcher: directory for its journal, so a restarted dispatcher "
                    "recovers its datasets and jobs (fault-tolerant mode).")


def overrides_from_flags() -> dict:
    overrides = dict(config_lib.parse_assignment(s) for s in FLAGS.set)
    for flag, field in config_lib.FLAG_FIELDS.items():
        value = FLAGS[flag].value
        if value is not None:
            overrides[field] = value
    return overrides


def resolved_config(of_run: bool = False) -> config_lib.Config:
    """--config with the flags over it. `of_run` (evaluate, export, predict): without --config, a local run that
    --model_dir names is read with its own config.yaml, the settings its checkpoints were trained with (the
    defaults would build another model)."""
    path = FLAGS.config
    if of_run and not path and FLAGS.model_dir and "://" not in FLAGS.model_dir:
        own = os.path.join(os.path.expanduser(FLAGS.model_dir), "config.yaml")
        if os.path.isfile(own):
            say(f"tfdp: config: {own}, the run's own (no --config given)")
            path = own
    return config_lib.load_config(path, overrides_from_flags())


def config_and_runtime(args: list[str], training: bool = False):
    """Validated config, a bucket in data.dir known to answer (and, for training, the tf.data service's
    dispatcher), then the strategy: built before Keras is imported, because importing Keras initialises
    TensorFlow's devices and the CPU could no longer be split into replicas."""
    _no_positional(args)
    cfg = resolved_config(of_run=not training)
    from tfdp.data import check_reachable
    check_reachable(cfg.data)
    if training:
        cfg = with_local_teacher(with_local_init_from(cfg))
    else:
        local_checkpoint_flag(cfg)
    if training and cfg.data.service_address:
        from tfdp.data.service.servers import check_service
        check_service(cfg.data.service_address, cfg.data.service_timeout)
    return cfg, started_runtime(cfg)


def with_local_init_from(cfg: config_lib.Config, from_run: bool = True) -> config_lib.Config:
    """`model.init_from` on the Hugging Face Hub (fetched into its cache, `tfdp.rundir.hub`) or in a bucket (copied
    into data.cache_dir, `tfdp.rundir.init_from`), and the config resolved again from the local copy, so the
    weights' own preprocessing applies as from a local path; the run's config.yaml records the bucket URL or the
    handle at its commit, not the copy (`tfdp.rundir.init_from.recorded`). A run that resumes reads neither (its
    checkpoints hold the weights, its config.yaml the preprocessing), so it fetches nothing: a host without a network
    resumes. `from_run` False (evaluate, export, predict from the weights alone): no run is looked for."""
    from tfdp.data.storage import is_remote_url
    from tfdp.rundir import hub
    from tfdp.rundir.init_from import STANDS_FOR, keep_recorded, local_copy, resumes
    spec = cfg.model.init_from
    if from_run and resumes(cfg.model_dir):
        keep_recorded(cfg.model_dir, spec)
        return cfg
    if hub.is_handle(spec):
        say(f"tfdp: init_from: fetching {spec} from the Hugging Face Hub, or its cache")
        local = hub.local_copy(spec, "model.init_from")
        say(f"tfdp: init_from: {spec} is {local}")
        STANDS_FOR[local] = hub.pinned(spec, local)
    elif hub.is_refused_handle(spec):
        raise UserError(hub.refusal(spec, "model.init_from"))
    elif is_remote_url(spec):
        local = local_copy(spec, cfg.data.cache_dir, "model.init_from")
        say(f"tfdp: init_from: {spec} copied to {local}")
        STANDS_FOR[local] = spec
    else:
        return cfg
    return config_lib.load_config(FLAGS.config, {**overrides_from_flags(), "model.init_from": local}, from_run)


def with_local_teacher(cfg: config_lib.Config) -> config_lib.Config:
    """`train.teacher.init_from` on the Hugging Face Hub or in a bucket, fetched or copied as `model.init_from` is, on
    every start, a resumed one too (the teacher is in no checkpoint); the run's config.yaml records what the user
    named (`tfdp.rundir.init_from.recorded`)."""
    from tfdp.data.storage import is_remote_url
    from tfdp.rundir import hub
    from tfdp.rundir.init_from import STANDS_FOR, local_copy
    teacher, what = cfg.train.teacher, "train.teacher.init_from"
    spec = teacher.init_from
    if teacher.distillation == "none" or not spec:
        return cfg
    if hub.is_handle(spec):
        say(f"tfdp: teacher: fetching {spec} from the Hugging Face Hub, or its cache")
        local = hub.local_copy(spec, what)
        STANDS_FOR[local] = hub.pinned(spec, local)
    elif hub.is_refused_handle(spec):
        raise UserError(hub.refusal(spec, what))
    elif is_remote_url(spec):
        local = local_copy(spec, cfg.data.cache_dir, what)
        STANDS_FOR[local] = spec
    else:
        return cfg
    say(f"tfdp: teacher: {spec} is {local}")
    teacher.init_from = local
    return cfg


def local_checkpoint_flag(cfg: config_lib.Config) -> None:
    """`--checkpoint` in a bucket (evaluate, export, predict): the weights copied into data.cache_dir, and the flag
    pointed at the copy, before TensorFlow starts (`tfdp.rundir.init_from`)."""
    from tfdp.data.storage import is_remote_url
    if not FLAGS.checkpoint or not is_remote_url(FLAGS.checkpoint):
        return
    from tfdp.rundir.init_from import local_copy
    local = local_copy(FLAGS.checkpoint, cfg.data.cache_dir, "--checkpoint")
    say(f"tfdp: checkpoint: {FLAGS.checkpoint} copied to {local}")
    FLAGS.checkpoint = local


def started_runtime(cfg: config_lib.Config):
    """TensorFlow imported, the strategy built, the model's name checked: in this order, once per command.

    Where DALI may decode (data.decoder dali or auto), TensorFlow is told to grow its GPU memory rather than take
    the cards at start, before it sees them: DALI allocates its own beside it (`tfdp.data.dali.memory_grows`).
    The user's own TF_FORCE_GPU_ALLOW_GROWTH wins."""
    if cfg.data.decoder != "tf":
        os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
    console.import_tensorflow()
    from tfdp.distribute.strategy import make_runtime
    runtime = make_runtime(cfg.distribute)
    check_model(cfg)
    return runtime


def check_model(cfg: config_lib.Config) -> None:
    """The model's name, checked once here, at the edge, before anything is listed or written (the registry
    is filled by importing the models, which imports Keras: after the strategy, see above)."""
    from tfdp.models import check_model_name
    check_model_name(cfg.model.name)


def cmd_train(args: list[str]) -> None:
    """Trains; on the evaluator task of a cluster (TF_CONFIG), evaluates the run's checkpoints instead, so one
    command serves every pod of a job."""
    cluster = tf_config_cluster()
    if cluster is not None and cluster.is_evaluator:
        run_evaluator(args, evaluator_in_cluster=True)
        return
    cfg, runtime = config_and_runtime(args, training=True)
    from tfdp.train.trainer import train
    train(cfg, runtime, evaluator=has_evaluator(cluster))


def tf_config_cluster():
    """The cluster TF_CONFIG describes (None without one), read before the strategy hands TensorFlow its own."""
    if not os.environ.get("TF_CONFIG"):
        return None
    from tfdp.distribute.cluster import parse_tf_config
    return parse_tf_config(os.environ["TF_CONFIG"])


def has_evaluator(cluster) -> bool:
    return cluster is not None and bool(cluster.tasks.get("evaluator"))


def run_evaluator(args: list[str], evaluator_in_cluster: bool) -> None:
    """`tfdp evaluate --continuous`, and `tfdp train` on a cluster's evaluator task. The evaluator task is no
    member of the training cluster: it evaluates on this host's own devices (mirrored over its GPUs, or its
    distribute.cpu_replicas) and TensorFlow never sees the cluster."""
    _no_positional(args)
    if FLAGS.checkpoint:
        raise UserError("--checkpoint names one checkpoint; --continuous evaluates each one the run commits")
    if not FLAGS.poll_seconds > 0:
        raise UserError(f"--poll_seconds must be above 0, got {FLAGS.poll_seconds:g}")
    if FLAGS.eval_timeout < 0:
        raise UserError(f"--eval_timeout must be 0 (wait for ever) or more seconds, got {FLAGS.eval_timeout:g}")
    cfg = resolved_config()
    from tfdp.data import check_reachable
    check_reachable(cfg.data)
    keep_best = not config_lib.workers_validate(cfg.train, evaluator_in_cluster or has_evaluator(tf_config_cluster()))
    if evaluator_in_cluster:
        os.environ.pop("TF_CONFIG", None)
        from tfdp.distribute.cluster import evaluator_distribute
        runtime = started_runtime(dataclasses.replace(cfg, distribute=evaluator_distribute(cfg.distribute)))
    else:
        runtime = started_runtime(cfg)
    from tfdp.commands.continuous_eval import evaluate_continuously
    evaluate_continuously(cfg, runtime, FLAGS.poll_seconds, FLAGS.eval_timeout, keep_best)


@contextlib.contextmanager
def run_copy(cfg: config_lib.Config, outputs: tuple[str, ...] = ()):
    """`cfg` for a command that reads a run, and what names a path in the messages; for a bucket model_dir,
    with model_dir a local copy of what it reads (the best checkpoint, the config, the metrics), the folders
    in `outputs` it wrote there uploaded afterwards (tfdp/rundir/bucket.py), and every path of that copy
    named, in the lines the command prints and the error it ends with, as the bucket object it stands for."""
    from tfdp.rundir.bucket import place_for
    place = place_for(cfg.model_dir, cfg.scratch_dir, own=False, retry_seconds=cfg.train.upload_retry_seconds)
    if not place.bucket:
        yield cfg, place.shown
        return
    def upload():
        for name in outputs:
            if (where := place.push_folder(name)):
                say(f"tfdp: bucket: uploaded {name}/ to {where}")
    try:
        place.pull_outputs()
        try:
            yield dataclasses.replace(cfg, model_dir=place.local), place.shown
        except UserError as e:  # an export whose other formats were written: they go up too
            upload()
            e.args = (place.shown(str(e)),)
            raise
        upload()
    finally:
        place.close()


def init_from_flag() -> bool:
    """--init_from (or --set=model.init_from=...) on the command line."""
    return bool(FLAGS.init_from) or any(s.split("=", 1)[0].strip() == "model.init_from" for s in FLAGS.set)


def from_weights_alone(cfg: config_lib.Config) -> bool:
    """evaluate, export and predict start from model.init_from's weights, with no run, when --init_from is given
    (and no --checkpoint), or when the config names weights and model_dir holds no best checkpoint to use."""
    if FLAGS.checkpoint or not cfg.model.init_from:
        return False
    if init_from_flag():
        return True
    from tfdp.rundir.checkpoints import CheckpointStore
    return "://" not in cfg.model_dir and not os.path.exists(CheckpointStore(os.path.expanduser(cfg.model_dir)
                                                                            ).best_weights)


def set_in_config(dotted: str) -> bool:
    """Whether the user set `dotted` (section.field): in --config's file or by a flag."""
    if dotted in overrides_from_flags():
        return True
    section, field = dotted.split(".", 1)
    raw = config_lib.read_yaml(FLAGS.config) if FLAGS.config else {}
    return isinstance(raw.get(section), dict) and field in raw[section]


def weights_alone_config() -> config_lib.Config:
    """--config with the flags over it, its preprocessing resolved from model.init_from's weights, not a run."""
    return config_lib.load_config(FLAGS.config, overrides_from_flags(), from_run=False)


def weights_config_and_runtime():
    """The config resolved from the weights alone (not a run in model_dir), fetched first from a bucket or the
    Hub, the runtime, and the weights read (`tfdp.commands.from_weights`)."""
    cfg = with_local_init_from(weights_alone_config(), from_run=False)
    runtime = started_runtime(cfg)
    from tfdp.commands.from_weights import read_pretrained
    return cfg, runtime, read_pretrained(cfg, classes_set=set_in_config("model.num_classes"))


def cmd_evaluate(args: list[str]) -> None:
    if FLAGS.continuous:
        run_evaluator(args, evaluator_in_cluster=False)
        return
    _no_positional(args)
    if from_weights_alone(weights_alone_config()):
        from tfdp.data import check_reachable
        check_reachable(weights_alone_config().data)
        cfg, runtime, weights = weights_config_and_runtime()
        from tfdp.commands.evaluate import evaluate
        evaluate(cfg, runtime, pretrained=weights)
        return
    cfg, runtime = config_and_runtime(args)
    from tfdp.commands.evaluate import evaluate
    with run_copy(cfg) as (cfg, _):
        evaluate(cfg, runtime, FLAGS.checkpoint)


def cmd_export(args: list[str]) -> None:
    _no_positional(args)
    verify_images = FLAGS.verify_images if FLAGS.verify else None
    if from_weights_alone(weights_alone_config()):
        cfg, runtime, weights = weights_config_and_runtime()
        from tfdp.commands.export import export_checkpoint, parse_formats  # imports TensorFlow: after the runtime
        export_checkpoint(cfg, runtime, None, FLAGS.export_dir, parse_formats(FLAGS.format), verify_images,
                          pretrained=weights)
        return
    cfg, runtime = config_and_runtime(args)
    from tfdp.commands.export import export_checkpoint, parse_formats
    formats = parse_formats(FLAGS.format)
    with run_copy(cfg, () if FLAGS.export_dir else ("export",)) as (cfg, shown):
        export_checkpoint(cfg, runtime, FLAGS.checkpoint, FLAGS.export_dir, formats, verify_images, shown=shown)


def cmd_predict(args: list[str]) -> None:
    _no_positional(args)
    cfg = resolved_config(of_run=True)  # the training data need not be here: it only names the classes
    from tfdp.commands.predict import predict, request
    alone = from_weights_alone(cfg)
    # before TensorFlow: a bad request fails at once (the weights' classes, to check --top_k by, come with them)
    job = request(cfg, FLAGS.input, FLAGS.output, FLAGS.top_k, classes_known=not alone)
    if alone:
        cfg, runtime, weights = weights_config_and_runtime()
        predict(cfg, runtime, None, job, pretrained=weights)
        return
    local_checkpoint_flag(cfg)
    runtime = started_runtime(cfg)
    with run_copy(cfg) as (cfg, _):
        predict(cfg, runtime, FLAGS.checkpoint, job)


def cmd_report(args: list[str]) -> None:
    if len(args) != 1:
        raise UserError("usage: tfdp report MODEL_DIR")
    from tfdp.config.model_dir import check_model_dir
    from tfdp.commands.report import report
    check_model_dir(args[0])
    with run_copy(config_lib.Config(model_dir=args[0]), ("report",)) as (cfg, shown):
        path = report(cfg.model_dir)
        say(f"tfdp: report: {shown(path)}")
        say(open(path, encoding="utf-8").read())


def cmd_benchmark(args: list[str]) -> None:
    _no_positional(args)
    from tfdp.commands.benchmark import benchmark, format_table
    cfg = resolved_config()
    check_model(cfg)  # this process only starts the probes: Keras' import here splits no device
    out = FLAGS.benchmark_dir or os.path.join(os.path.expanduser(cfg.model_dir), "benchmark")
    result = benchmark(cfg, FLAGS.max_replicas, FLAGS.steps, FLAGS.warmup_steps, out)
    say(format_table(result))
    say(f"tfdp: benchmark: wrote {out}/benchmark.json and {out}/scaling.png")


def cmd_models(args: list[str]) -> None:
    if len(args) > 1:
        raise UserError("usage: tfdp models [PATTERN] (fnmatch, as timm's list_models: tfdp models '*convnext*')")
    console.import_tensorflow()   # quietly: the listing imports the zoo, which imports Keras
    from tfdp.commands.models import list_models
    for line in list_models(args[0] if args else ""):
        say(line)


def cmd_launch(args: list[str]) -> None:
    from tfdp.distribute.launch import launch
    sys.exit(launch(FLAGS.workers, args, FLAGS.launch_logs, FLAGS.data_workers))


def cmd_data_service(args: list[str]) -> None:
    from tfdp.data.service import servers
    if len(args) != 1 or args[0] not in servers.ROLES:
        raise UserError(f"usage: tfdp data-service {'|'.join(servers.ROLES)} [--port=N] ...")
    if args[0] == "dispatcher":
        servers.dispatcher(5050 if FLAGS.port is None else FLAGS.port, FLAGS.work_dir)
    else:
        servers.worker(FLAGS.dispatcher_address, FLAGS.port or 0, FLAGS.worker_address, tuple(FLAGS.mirror),
                       FLAGS.cache_dir or servers.DEFAULT_CACHE_DIR, FLAGS.dispatcher_timeout)


COMMANDS = {
    "train": cmd_train,
    "evaluate": cmd_evaluate,
    "launch": cmd_launch,
    "export": cmd_export,
    "predict": cmd_predict,
    "report": cmd_report,
    "benchmark": cmd_benchmark,
    "models": cmd_models,
    "data-service": cmd_data_service,
}


def _no_positional(args: list[str]) -> None:
    if args:
        raise UserError(f"unexpected argument(s): {' '.join(args)}")


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[1] not in COMMANDS:
        got = f" '{argv[1]}'" if len(argv) > 1 else ""
        raise app.UsageError(f"expected a command{got}: one of {', '.join(COMMANDS)}")
    console.set_python_logging()
    console.filter_native_stderr()
    try:
        COMMANDS[argv[1]](argv[2:])
    except UserError as e:
        sys.stdout.flush()
        sys.stderr.write(f"tfdp: error: {e}\n")
        sys.stderr.flush()
        # End at once: tf.data threads may still be decoding (say, the next corrupt JPEG), and
        # their C libraries' messages must not follow the one line the user needs.
        os._exit(e.exit_code)   # 2, or a fault's own permanent status (errors.DIVERGED_EXIT_CODE)
    except Restartable as e:
        sys.stdout.flush()
        what = "preempted" if isinstance(e, Preempted) else "stopped"
        sys.stderr.write(f"tfdp: {what}: {e}; exit {PREEMPTED_EXIT_CODE} (run the same command to continue)\n")
        sys.stderr.flush()
        os._exit(PREEMPTED_EXIT_CODE)
    except KeyboardInterrupt:
        sys.stderr.write("tfdp: interrupted\n")
        sys.exit(130)


USAGE = """tfdp COMMAND [--flags]

Commands:
  train      train (or resume) the run in model_dir
  evaluate   top-1/top-5 of a checkpoint on the validation split; --continuous: of each checkpoint a run
             commits, as it comes (the evaluator beside the workers)
  export     the model for serving: --format=saved_model,keras (default; encoded JPEG/PNG bytes in),
             onnx, onnx_int8, litert, litert_float16, litert_int8 (uint8 pixels in); each checked
             against Keras on the validation split
  predict    top-k classes of every image in a folder, file, pattern or bucket prefix, as JSONL or CSV:
             tfdp predict --config=... --input=DIR --output=predictions.jsonl [--top_k=K]
  report     PNG curves and a markdown summary of a run: tfdp report MODEL_DIR
  benchmark  scaling analysis over 1..N replicas: images/s, efficiency, input- or compute-bound
  models     the model zoo: name, parameters, native size, the weights each reads: tfdp models '*convnext*'
  launch     start an N-worker cluster on this host: tfdp launch --workers=2 -- train --config=...
             (--data_workers=N: and a local tf.data service with N workers to feed it)
  data-service dispatcher|worker
             a tf.data service process: tfdp data-service dispatcher --port=5050 --work_dir=DIR,
             tfdp data-service worker --dispatcher_address=HOST:5050; train with --data_service=grpc://HOST:5050

Example:
  tfdp train --config=configs/digits.yaml --epochs=4 --set=optimizer.lr=0.4
"""


def parse_flags(argv: list[str]) -> list[str]:
    """absl's parsing, its errors (an unknown flag, a bad value, a missing --flagfile) in tfdp's one line and
    status 2, as a config's are, instead of absl's two lines and status 1."""
    try:
        return FLAGS(argv)
    except flags.Error as e:
        message = str(e).removeprefix("ERROR:: ")   # absl's own prefix on a --flagfile it cannot open
        sys.stderr.write(f"tfdp: error: {message} (tfdp --helpfull lists every flag)\n")
        sys.exit(2)


def run() -> None:
    """Console-script entry point."""
    sys.modules["__main__"].__doc__ = USAGE  # absl prints the main module's doc as usage
    console.prepare(sys.argv)
    app.run(main, flags_parser=parse_flags)

"""`tfdp report MODEL_DIR`: curves as PNG and a short markdown summary, from metrics.jsonl.

Works on a finished or a running job (it only reads the chief's metrics
file), and needs no TensorFlow.
"""

from __future__ import annotations

import os

from tfdp.errors import UserError
from tfdp.rundir.metrics_file import EVAL_METRICS_FILE, METRICS_FILE, read_metrics, with_evaluations
from tfdp.rundir.writable import writable_dir

# (file, title, y label, [(metrics key, legend label)])
PLOTS = (
    ("loss.png", "Loss", "cross-entropy", [("loss", "train"), ("val_loss", "validation")]),
    ("accuracy.png", "Accuracy", "accuracy", [("top1", "train top-1"), ("val_top1", "validation top-1"),
                                              ("val_top5", "validation top-5")]),
    ("lr.png", "Learning rate (end of epoch)", "learning rate", [("lr", "lr")]),
    ("throughput.png", "Training throughput", "images/s", [("images_per_sec", "images/s")]),
)


def load_rows(model_dir: str) -> list[dict]:
    path = os.path.join(model_dir, METRICS_FILE)
    if not os.path.exists(path):
        raise UserError(f"no {METRICS_FILE} in {model_dir}: is it a tfdp model_dir?")
    rows = read_metrics(path)
    if not rows:
        raise UserError(f"{path} has no epochs yet")
    return with_evaluations(rows, read_metrics(os.path.join(model_dir, EVAL_METRICS_FILE)))


def plot(rows: list[dict], out_dir: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    written = []
    epochs = [r["epoch"] for r in rows]
    for name, title, ylabel, series in PLOTS:
        fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
        for key, label in series:
            if all(key in r for r in rows):
                ax.plot(epochs, [r[key] for r in rows], marker="o", label=label)
        ax.set(title=title, xlabel="epoch", ylabel=ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = os.path.join(out_dir, name)
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def summary_markdown(rows: list[dict]) -> str:
    best = max(rows, key=lambda r: r.get("val_top1", 0.0))
    last = rows[-1]
    timed = rows[1:] if len(rows) > 1 else rows
    rate = sum(r["images_per_sec"] for r in timed) / len(timed)
    seconds = sum(r["seconds"] for r in timed) / len(timed)
    lines = [
        "# Training report",
        "",
        "| | |",
        "| --- | --- |",
        f"| epochs | {last['epoch']} |",
    ]
    lines += validation_lines(last, best)
    lines += [
        f"| throughput | {rate:.1f} images/s, {seconds:.1f} s/epoch (mean over epochs {timed[0]['epoch']}-{timed[-1]['epoch']}) |",
        "",
        "![loss](loss.png) ![accuracy](accuracy.png) ![lr](lr.png) ![throughput](throughput.png)",
        "",
    ]
    return "\n".join(lines)


def validation_lines(last: dict, best: dict) -> list[str]:
    """The summary's validation rows (the workers' or the evaluator's figures); none where neither measured the
    last epoch."""
    if "val_top1" not in last:
        return ["| validation | none for the last epoch (train.validate; no evaluator's row either) |"]
    lines = [f"| final validation top-1 | {100 * last['val_top1']:.2f}% |"]
    if "val_top5" in last:
        lines.append(f"| final validation top-5 | {100 * last['val_top5']:.2f}% |")
    return lines + [f"| best validation top-1 | {100 * best['val_top1']:.2f}% (epoch {best['epoch']}) |",
                    f"| final validation loss | {last['val_loss']:.4f} |"]


def report(model_dir: str) -> str:
    rows = load_rows(model_dir)
    out_dir = writable_dir(os.path.join(model_dir, "report"), "the report folder")
    plot(rows, out_dir)
    path = os.path.join(out_dir, "report.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write(summary_markdown(rows))
    return path

"""What a run writes, and where: `model_dir` checked writable before any work (`writable`), atomic
checkpoints (`checkpoints`), the one-writer lease (`lease`), the metrics log (`metrics_file`), and a run
whose `model_dir` is a bucket (`bucket`)."""

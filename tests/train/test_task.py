"""`tfdp.train.task.ClassificationTask`: one object built from the config builds the model each command needs,
its losses and metrics, and only the inputs asked for."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from tfdp.config import load_config
from tfdp.train.task import ClassificationTask, Plan


def _task(classes: int = 10) -> ClassificationTask:
    return ClassificationTask(load_config("configs/digits.yaml", {"model.name": "simple_cnn",
                                                                   "model.num_classes": classes}))


def test_each_purpose_builds_its_own_model():
    task = _task()
    trained = task.build_model("train", Plan(64, 10, 640, 0, 10))
    evaluated = task.build_model("evaluate")
    served = task.build_model("serve")
    assert trained.optimizer.built and trained.optimizer.iterations.numpy() == 0   # built for restoring into
    assert [m.name for m in task.build_metrics()] == ["top1", "top5"]
    assert not evaluated.optimizer.built and getattr(served, "optimizer", None) is None   # serving: not compiled
    side = task.cfg.data.image_size
    images = np.zeros([2, side, side, 3], np.uint8)
    assert served.predict(images, verbose=0).shape == evaluated.predict(images, verbose=0).shape == (2, 10)


def test_what_a_task_cannot_build_is_said_plainly():
    task = _task(classes=5)
    assert [m.name for m in task.build_metrics()] == ["top1"]   # no top-5 of 5 classes
    assert isinstance(task.build_losses(), keras.losses.Loss)
    with pytest.raises(ValueError, match="needs the run's plan"):
        task.build_model("train")
    with pytest.raises(ValueError, match="purpose must be one of train, evaluate, serve, got 'predict'"):
        task.build_model("predict")
    with pytest.raises(ValueError, match="without the data's source"):
        task.build_validation_inputs()

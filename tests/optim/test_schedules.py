import json
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

from tfdp.config import ScheduleConfig, validate
from tfdp.errors import UserError
from tfdp.optim.schedules import build_schedule, peak_lr, python_floordiv, scaled_lr


def lr_at(schedule, step):
    return float(np.asarray(schedule(step)))


def test_linear_scaling_rule():
    assert peak_lr(0.1, 256) == pytest.approx(0.1)
    assert peak_lr(0.1, 1024) == pytest.approx(0.4)
    assert peak_lr(0.1, 64) == pytest.approx(0.025)


def test_warmup_then_cosine_to_zero():
    s = build_schedule(ScheduleConfig(name="cosine", warmup_epochs=2), lr=0.1, global_batch=512,
                       steps_per_epoch=10, epochs=12)
    peak = 0.2
    assert lr_at(s, 0) == pytest.approx(peak / 20)         # first warmup step
    assert lr_at(s, 9) == pytest.approx(peak / 2)          # halfway through warmup
    assert lr_at(s, 20) == pytest.approx(peak)             # warmup done
    assert lr_at(s, 70) == pytest.approx(peak / 2, rel=1e-5)  # cosine midpoint
    assert lr_at(s, 120) == pytest.approx(0.0, abs=1e-7)
    rates = [lr_at(s, i) for i in range(20, 121)]
    assert all(a >= b for a, b in zip(rates, rates[1:]))  # monotone decay


def test_linear_is_ffcvs_triangular_schedule():
    """FFCV's get_cyclic_lr: np.interp(epoch, [0, lr_peak_epoch, epochs], [~0, lr, 0]), per step: the rate
    rises to the peak over the warmup and falls in a straight line to 0 at the last step."""
    epochs, steps, peak_epoch = 24, 10, 2
    s = build_schedule(ScheduleConfig(name="linear", warmup_epochs=peak_epoch), lr=0.10625,
                       global_batch=4096, steps_per_epoch=steps, epochs=epochs)
    peak = 1.7  # ffcv-imagenet rn50 configs: lr 1.7 at 8 x 512 images
    assert lr_at(s, 0) == pytest.approx(peak / 20)
    ffcv = lambda step: float(np.interp(step / steps, [0, peak_epoch, epochs], [1e-4 * peak, peak, 0]))  # noqa: E731
    for step in (20, 50, 130, 200, 239):
        assert lr_at(s, step) == pytest.approx(ffcv(step), rel=1e-5, abs=1e-6)
    assert lr_at(s, 240) == 0.0


def test_step_decay_at_boundaries():
    s = build_schedule(ScheduleConfig(name="step", decay_epochs=(3, 6), decay_rate=0.1), 0.1, 256, 10, 9)
    assert lr_at(s, 29) == pytest.approx(0.1)
    assert lr_at(s, 30) == pytest.approx(0.01)
    assert lr_at(s, 60) == pytest.approx(0.001)


def test_constant_with_warmup():
    s = build_schedule(ScheduleConfig(name="constant", warmup_epochs=1), 0.1, 256, 4, 3)
    assert [round(lr_at(s, i), 6) for i in range(6)] == [0.025, 0.05, 0.075, 0.1, 0.1, 0.1]


def test_exponential_decays_once_per_epoch_after_warmup():
    s = build_schedule(ScheduleConfig(name="exponential", decay_rate=0.5, warmup_epochs=1), 0.1, 256, 10, 5)
    assert lr_at(s, 10) == pytest.approx(0.1)
    assert lr_at(s, 19) == pytest.approx(0.1)
    assert lr_at(s, 20) == pytest.approx(0.05)
    assert lr_at(s, 35) == pytest.approx(0.025)


def test_one_cycle_rises_peaks_and_anneals_like_torch_one_cycle():
    cfg = ScheduleConfig(name="one_cycle", pct_start=0.25, div_factor=10.0, final_div_factor=100.0)
    s = build_schedule(cfg, lr=0.4, global_batch=256, steps_per_epoch=10, epochs=4)  # 40 steps
    assert lr_at(s, 0) == pytest.approx(0.04)           # peak / div_factor
    assert lr_at(s, 5) == pytest.approx(0.22)           # halfway up
    assert lr_at(s, 10) == pytest.approx(0.4)           # the peak at pct_start
    assert lr_at(s, 40) == pytest.approx(0.4 / 1000)    # peak / (div * final_div)
    rates = [lr_at(s, i) for i in range(41)]
    assert max(rates) == pytest.approx(0.4) and rates.index(max(rates)) == 10


# --- timm's and torchvision's rules, against the references themselves -------------------------------------------

FIXTURE = json.loads((Path(__file__).parents[1] / "fixtures" / "schedule_fixture.json").read_text())
CASES = FIXTURE["cases"]


def reference_schedule(case: dict):
    """tfdp's schedule for a fixture case: its config fields validated as a run's are, over the reference's epochs."""
    cfg = validate({**case["config"], "train": {"epochs": case["epochs"]}})
    return build_schedule(cfg.schedule, cfg.optimizer.lr, case["global_batch"], case["steps_per_epoch"],
                          cfg.train.epochs, cfg.rules, cfg.optimizer)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_every_update_trains_at_the_references_rate(case):
    """tests/fixtures/make_schedule_fixture.py drove timm 1.0.31's schedulers and torchvision's SequentialLR as
    their train.py scripts do and recorded the rate of every optimizer update: tfdp's schedule gives each one."""
    want = np.asarray(case["lrs"])
    got = np.asarray(reference_schedule(case)(np.arange(len(want))), np.float64)
    # tfdp computes in float64 and rounds once to float32: within half a float32 ulp (2**-24 = 6.0e-8 relative)
    # of the reference's float64 rate, at any magnitude (1e-6 at a cosine's end as 0.5 at its peak), on any host.
    np.testing.assert_allclose(got, want, rtol=1e-7, atol=0)


MAIN_PY = {case["name"]: case for case in FIXTURE["main_py"]}


def recipe_rates(case: dict) -> tuple[np.ndarray, np.ndarray, object]:
    """(tfdp's rate at every update of the recipe's own config, the main.py's, the config) at the case's sizes."""
    from tfdp.config import load_config
    cfg = load_config(str(Path(__file__).parents[2] / "configs" / f"{case['recipe']}.yaml"))
    assert cfg.train.epochs == case["epochs"]
    schedule = build_schedule(cfg.schedule, cfg.optimizer.lr, cfg.train.global_batch, case["steps_per_epoch"],
                              cfg.train.epochs, cfg.rules, cfg.optimizer)
    want = np.asarray(case["lrs"])
    return np.asarray(schedule(np.arange(len(want))), np.float64), want, cfg


def test_swin_trains_at_its_main_pys_rates_one_update_earlier():
    """Swin's main.py (timm's CosineLRScheduler, its warmup_lr and min_lr, per update, warmup_prefix) calls
    step_update(k) after update k, so update k + 1 trains at the rate timm's train.py, and tfdp's rules: timm, give
    update k: swin_t_imagenet's config equals it one update shifted, and unshifted differs by at most one warmup
    increment ((lr - warmup_lr) / warmup updates)."""
    case = MAIN_PY["swin_main_py"]
    ours, theirs, cfg = recipe_rates(case)
    # float64 rates rounded once to float32 (see test_every_update_trains_at_the_references_rate)
    np.testing.assert_allclose(ours[:-1], theirs[1:], rtol=1e-7, atol=0)
    assert ours[0] == pytest.approx(theirs[0], rel=1e-7)
    increment = (cfg.optimizer.lr - cfg.schedule.warmup_lr) / (cfg.schedule.warmup_epochs * case["steps_per_epoch"])
    assert np.max(np.abs(ours - theirs)) == pytest.approx(increment, rel=1e-5)


def test_convnext_trains_at_its_main_pys_rates_but_for_its_linspace_warmup():
    """ConvNeXt's main.py warms up by np.linspace(0, lr, W) (the peak at update W - 1), timm's rules by lr x k / W
    (the peak at W); from the peak on, the same cosine to min_lr: equal there, and apart by at most lr / W before."""
    case = MAIN_PY["convnext_main_py"]
    ours, theirs, cfg = recipe_rates(case)
    warmup = int(cfg.schedule.warmup_epochs) * case["steps_per_epoch"]
    np.testing.assert_allclose(ours[warmup:], theirs[warmup:], rtol=1e-7, atol=0)
    gap = np.abs(ours[:warmup] - theirs[:warmup])
    assert ours[0] == theirs[0] == 0.0
    assert np.max(gap) == pytest.approx(cfg.optimizer.lr / warmup, rel=1e-5)


def test_the_fixture_spans_what_the_rules_offer():
    """Warmup inside and before the schedule, per epoch and per update, each timm and torchvision schedule."""
    fields = [dict(c["config"]["schedule"], rules=c["config"]["rules"]) for c in CASES]
    timm = [f for f in fields if f["rules"] == "timm"]
    assert {f.get("name") for f in timm} >= {"cosine", "step", "multistep", "constant"}
    assert {f.get("warmup_prefix", False) for f in timm} == {True, False}
    assert {f.get("on_updates", False) for f in timm} == {True, False}
    assert {f.get("warmup_epochs") for f in timm} >= {0, 2}
    torchvision = [f for f in fields if f["rules"] == "torchvision"]
    assert {(f["name"], f.get("warmup_method", "constant")) for f in torchvision if f.get("warmup_epochs")} == {
        (name, method) for name in ("cosine", "step", "exponential") for method in ("linear", "constant")}


def test_timms_step_divides_as_python_does():
    """timm's StepLRScheduler takes t // decay_t in Python floats: 12 // 0.1 is 119.0, where floor(12 / 0.1) is
    120.0; EfficientNet's recipes decay every 2.4 epochs."""
    got = np.asarray(python_floordiv(ops.convert_to_tensor([12.0, 7.0, 5.0, 0.0], "float64"),
                                     ops.convert_to_tensor([0.1, 2.4, 2.5, 2.4], "float64")))
    assert got.tolist() == [12.0 // 0.1, 7.0 // 2.4, 5.0 // 2.5, 0.0]


@pytest.mark.parametrize("name", ["timm_cosine_prefix_on_updates_warmup_lr_0", "tv_cosine_linear_warmup_lr_min",
                                  "timm_step_fractional_interval"])
def test_rules_schedules_compile_under_xla_and_serialize(name):
    """The optimizer's step counter in, a float32 rate out, in one XLA program; and get_config rebuilds it."""
    case = next(c for c in CASES if c["name"] == name)
    schedule = reference_schedule(case)
    step = tf.Variable(0, dtype=tf.int64)
    compiled = tf.function(lambda: schedule(step), jit_compile=True)
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(schedule))
    for k in (0, 7, len(case["lrs"]) - 1):
        step.assign(k)
        rate = compiled()
        assert rate.dtype == tf.float32
        assert float(rate) == float(np.asarray(schedule(k))) == float(np.asarray(restored(k)))


# --- LR scaling -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rules, optimizer, global_batch, peak", [
    ("keras", {"lr": 0.1}, 1024, 0.4),                                          # per 256 images, linearly
    ("timm", {"lr": 0.1}, 1024, 0.1),                                           # timm's --lr: as given
    ("torchvision", {"lr": 0.5}, 1024, 0.5),                                    # torchvision's --lr: as given
    ("timm", {"lr": 0.1, "lr_scale": "linear"}, 1024, 0.4),                     # --lr-base 0.1 (SGD's linear)
    ("timm", {"name": "adamw", "lr": 1e-3, "lr_scale": "sqrt"}, 1024, 2e-3),    # --lr-base 1e-3 (Adam's sqrt)
    ("timm", {"lr": 0.1, "lr_scale": "linear", "lr_base_size": 512}, 1024, 0.2),  # --lr-base-size 512
    ("keras", {"lr": 0.1, "lr_scale": "none"}, 1024, 0.1),
])
def test_lr_scaling_by_rules(rules, optimizer, global_batch, peak):
    flat = {"name": "constant"} if rules != "torchvision" else {}   # torchvision's default: steplr every 30 epochs
    cfg = validate({"rules": rules, "optimizer": optimizer, "schedule": {**flat, "warmup_epochs": 0},
                    "train": {"epochs": 3}})
    schedule = build_schedule(cfg.schedule, cfg.optimizer.lr, global_batch, 10, 3, cfg.rules, cfg.optimizer)
    assert lr_at(schedule, 15) == pytest.approx(peak, rel=1e-7)
    assert scaled_lr(0.1, 1024, "linear", 256) == pytest.approx(0.4)


def test_auto_scaling_resolves_to_the_rule_sets_own():
    assert validate({}).optimizer.lr_scale == "linear" and validate({}).optimizer.lr_base_size == 256
    timm = validate({"rules": "timm"}).optimizer
    assert (timm.lr_scale, timm.lr_base_size) == ("none", None)


@pytest.mark.parametrize("raw, line", [
    ({"schedule": {"warmup_prefix": True}}, "schedule.warmup_prefix is a field of rules: timm, not of rules: keras"),
    ({"rules": "timm", "schedule": {"warmup_method": "linear"}},
     "schedule.warmup_method is a field of rules: torchvision, not of rules: timm"),
    ({"rules": "torchvision", "schedule": {"on_updates": True}},
     "schedule.on_updates is a field of rules: timm, not of rules: torchvision"),
    ({"schedule": {"min_lr": 1e-5}}, "schedule.min_lr is a field of rules: timm and torchvision, not of rules: keras"),
    ({"rules": "timm", "schedule": {"name": "exponential"}},
     "config field 'schedule.name': exponential is not a schedule of rules: timm (it has cosine, step, multistep, "
     "constant)"),
    ({"rules": "torchvision", "schedule": {"name": "one_cycle"}},
     "config field 'schedule.name': one_cycle is not a schedule of rules: torchvision (it has cosine, step, "
     "exponential)"),
    ({"rules": "timm", "schedule": {"name": "multistep", "decay_epochs": 30}},
     "schedule.decay_epochs must be a list of epochs (milestones) for schedule.name multistep under rules: timm, "
     "got 30.0"),
    ({"rules": "timm", "schedule": {"name": "step", "decay_epochs": [30, 60]}},
     "schedule.decay_epochs must be a number of epochs (the decay interval) for schedule.name step under rules: timm, "
     "got (30, 60)"),
    ({"schedule": {"name": "step", "decay_epochs": 30}},
     "schedule.decay_epochs must be a list of epochs (milestones) for schedule.name step under rules: keras, got 30.0"),
    ({"rules": "timm", "schedule": {"name": "multistep", "decay_epochs": [6, 3]}},
     "schedule.decay_epochs must be in increasing order"),
    ({"rules": "torchvision", "schedule": {"decay_epochs": 2.5}},
     "schedule.decay_epochs must be a whole number of epochs under rules: torchvision (its --lr-step-size), got 2.5"),
    ({"rules": "timm", "schedule": {"warmup_epochs": 1.5}},
     "schedule.warmup_epochs must be a whole number of epochs under rules: timm (its --warmup-epochs is an int), "
     "got 1.5"),
    ({"rules": "timm", "schedule": {"name": "step", "cooldown_epochs": 2}},
     "schedule.cooldown_epochs applies to schedule.name cosine under rules: timm (timm's step schedule ignores "
     "--cooldown-epochs)"),
    ({"rules": "timm", "schedule": {"warmup_prefix": True, "cooldown_epochs": 5}},
     "train.epochs (10) leaves no epoch for timm's cosine after schedule.cooldown_epochs (5) and the prefixed warmup "
     "(5)"),
    ({"rules": "timm", "optimizer": {"lr_base_size": 512}},
     "optimizer.lr_base_size needs optimizer.lr_scale linear or sqrt (rules: timm takes optimizer.lr as given)"),
    ({"schedule": {"warmup_epochs": 10}}, "schedule.warmup_epochs must be smaller than train.epochs"),
    ({"rules": "tf"}, "config field 'rules': input should be 'keras', 'timm' or 'torchvision' (got 'tf')"),
])
def test_a_field_or_value_the_rule_set_lacks_is_one_line(raw, line):
    with pytest.raises(UserError) as e:
        validate(raw)
    assert str(e.value) == line


def test_unset_fields_take_the_rule_sets_defaults():
    """timm's argparse defaults (--sched cosine, --warmup-epochs 5, --warmup-lr 1e-5, --min-lr 0, --decay-epochs 90,
    --decay-milestones 90 180 270), torchvision's (--lr-scheduler steplr, --lr-warmup-method constant,
    --lr-warmup-decay 0.01, --lr-step-size 30), Keras' rules as before."""
    timm = validate({"rules": "timm"}).schedule
    assert (timm.name, timm.warmup_epochs, timm.warmup_lr, timm.min_lr, timm.warmup_prefix, timm.on_updates,
            timm.cooldown_epochs) == ("cosine", 5.0, 1e-5, 0.0, False, False, 0)
    assert validate({"rules": "timm", "schedule": {"name": "step"}}).schedule.decay_epochs == 90.0
    assert validate({"rules": "timm", "schedule": {"name": "multistep"}}).schedule.decay_epochs == (90, 180, 270)
    tv = validate({"rules": "torchvision"}).schedule
    assert (tv.name, tv.warmup_epochs, tv.warmup_method, tv.warmup_decay, tv.decay_epochs, tv.decay_rate,
            tv.min_lr) == ("step", 0.0, "constant", 0.01, 30.0, 0.1, 0.0)
    keras_rules = validate({}).schedule
    assert (keras_rules.name, keras_rules.warmup_epochs, keras_rules.warmup_lr) == ("cosine", 0.0, None)
    assert validate({"schedule": {"name": "step"}}).schedule.decay_epochs == (30, 60, 80)

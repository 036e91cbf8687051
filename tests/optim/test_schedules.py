import numpy as np
import pytest

from tfdp.config import ScheduleConfig
from tfdp.optim.schedules import build_schedule, peak_lr


def lr_at(schedule, step):
    return float(np.asarray(schedule(step)))


def test_linear_scaling_rule():
    assert peak_lr(0.1, 256) == pytest.approx(0.1)
    assert peak_lr(0.1, 1024) == pytest.approx(0.4)
    assert peak_lr(0.1, 64) == pytest.approx(0.025)


def test_warmup_then_cosine_to_zero():
    s = build_schedule(ScheduleConfig(name="cosine", warmup_epochs=2), lr_per_256=0.1, global_batch=512,
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
    s = build_schedule(ScheduleConfig(name="linear", warmup_epochs=peak_epoch), lr_per_256=0.10625,
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
    s = build_schedule(cfg, lr_per_256=0.4, global_batch=256, steps_per_epoch=10, epochs=4)  # 40 steps
    assert lr_at(s, 0) == pytest.approx(0.04)           # peak / div_factor
    assert lr_at(s, 5) == pytest.approx(0.22)           # halfway up
    assert lr_at(s, 10) == pytest.approx(0.4)           # the peak at pct_start
    assert lr_at(s, 40) == pytest.approx(0.4 / 1000)    # peak / (div * final_div)
    rates = [lr_at(s, i) for i in range(41)]
    assert max(rates) == pytest.approx(0.4) and rates.index(max(rates)) == 10

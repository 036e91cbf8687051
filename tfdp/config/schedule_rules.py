"""The schedule and learning-rate scaling fields under each rule set (`rules: keras | timm | torchvision`).

A schedule field left unset (None) means "this rule set's default": timm's `--warmup-lr` is 1e-5, torchvision's
`--lr-warmup-method` is constant, Keras' rules keep tfdp's own. `check_schedule_rules` fills those defaults in,
so what reads the config later (the schedule, the run's config.yaml) sees the values the run uses, and refuses in
one line a field that the run's rule set does not have (timm's `warmup_prefix` under keras) or a value its
reference would not take. tfdp/optim/schedules.py builds the schedules; docs/recipes.md maps the flags.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tfdp.errors import UserError

# The schedule names of each rule set: keras tfdp's own, timm its --sched, torchvision its --lr-scheduler.
SCHEDULES = {
    "keras": ("cosine", "linear", "step", "exponential", "constant", "one_cycle"),
    "timm": ("cosine", "step", "multistep", "constant"),
    "torchvision": ("cosine", "step", "exponential"),
}
# torchvision's --lr-scheduler value for each of its names here, for the messages and docs/recipes.md.
TORCHVISION_NAMES = {"cosine": "cosineannealinglr", "step": "steplr", "exponential": "exponentiallr"}

# Each rule set's defaults for the schedule fields left unset: the reference's argparse defaults (timm 1.0.31's
# train.py, torchvision 0.28's references/classification/train.py). A field absent from a rule set's table is
# not one of its fields; set, it is refused.
DEFAULTS: dict[str, dict[str, Any]] = {
    "keras": {"name": "cosine", "warmup_epochs": 0.0},
    "timm": {"name": "cosine", "warmup_epochs": 5.0, "min_lr": 0.0, "warmup_lr": 1e-5, "warmup_prefix": False,
             "on_updates": False, "cooldown_epochs": 0},
    "torchvision": {"name": "step", "warmup_epochs": 0.0, "min_lr": 0.0, "warmup_method": "constant",
                    "warmup_decay": 0.01},
}
# decay_epochs, by rule set and schedule: a list of milestones or one interval (a number).
DECAY_EPOCHS: dict[tuple[str, str], tuple[int, ...] | float] = {
    ("keras", "step"): (30, 60, 80),
    ("timm", "step"): 90.0,
    ("timm", "multistep"): (90, 180, 270),
    ("torchvision", "step"): 30.0,
}
# Fields some rule set has and another does not (the keys of DEFAULTS beyond the shared name and warmup_epochs).
RULE_FIELDS = ("min_lr", "warmup_lr", "warmup_prefix", "on_updates", "cooldown_epochs", "warmup_method",
               "warmup_decay")
# optimizer.lr_scale auto under each rule set: Keras' rules scale the rate per 256 images, timm's --lr and
# torchvision's --lr are taken as given.
AUTO_LR_SCALE = {"keras": "linear", "timm": "none", "torchvision": "none"}
DEFAULT_LR_BASE_SIZE = 256


def resolve_schedule(schedule, rules: str):
    """`schedule` (a ScheduleConfig) with every unset field that `rules` has set to the rule set's default."""
    defaults = DEFAULTS[rules]
    filled = {name: value for name, value in defaults.items() if getattr(schedule, name) is None}
    name = filled.get("name", schedule.name)
    if schedule.decay_epochs is None and (rules, name) in DECAY_EPOCHS:
        filled["decay_epochs"] = DECAY_EPOCHS[rules, name]
    return dataclasses.replace(schedule, **filled) if filled else schedule


def lr_scaling(optimizer, rules: str) -> tuple[str, int]:
    """(linear | sqrt | none, the batch the rate is given for) for an OptimizerConfig under `rules`."""
    scale = AUTO_LR_SCALE[rules] if optimizer.lr_scale == "auto" else optimizer.lr_scale
    return scale, optimizer.lr_base_size or DEFAULT_LR_BASE_SIZE


def check_schedule_rules(cfg) -> None:
    """Refuses, in one line, a schedule or LR-scaling field the rule set lacks or a value its reference would not
    take; then fills in the rule set's defaults (cfg.schedule, cfg.optimizer.lr_scale and lr_base_size)."""
    rules, s = cfg.rules, cfg.schedule
    _check_foreign_fields(s, rules)
    if s.name is not None and s.name not in SCHEDULES[rules]:
        raise UserError(f"config field 'schedule.name': {s.name} is not a schedule of rules: {rules} (it has "
                        f"{', '.join(SCHEDULES[rules])})")
    s = cfg.schedule = resolve_schedule(s, rules)
    RULE_CHECKS[rules](s, cfg.train.epochs)
    _check_decay_epochs(s, rules)
    scale, _ = lr_scaling(cfg.optimizer, rules)
    if cfg.optimizer.lr_base_size is not None and scale == "none":
        raise UserError(f"optimizer.lr_base_size needs optimizer.lr_scale linear or sqrt (rules: {rules} takes "
                        f"optimizer.lr as given)")
    cfg.optimizer.lr_scale = scale
    if scale != "none":
        cfg.optimizer.lr_base_size = cfg.optimizer.lr_base_size or DEFAULT_LR_BASE_SIZE


def _check_foreign_fields(s, rules: str) -> None:
    for field in RULE_FIELDS:
        if getattr(s, field) is not None and field not in DEFAULTS[rules]:
            owners = " and ".join(r for r in DEFAULTS if field in DEFAULTS[r])
            raise UserError(f"schedule.{field} is a field of rules: {owners}, not of rules: {rules}")


def _check_decay_epochs(s, rules: str) -> None:
    """A list where the rule set's schedule takes milestones, a number where it takes an interval."""
    wanted = DECAY_EPOCHS.get((rules, s.name))
    if wanted is None:
        return
    if isinstance(wanted, tuple) != isinstance(s.decay_epochs, tuple):
        form = ("a list of epochs (milestones)" if isinstance(wanted, tuple)
                else "a number of epochs (the decay interval)")
        raise UserError(f"schedule.decay_epochs must be {form} for schedule.name {s.name} under rules: {rules}, "
                        f"got {s.decay_epochs!r}")
    if isinstance(s.decay_epochs, tuple) and list(s.decay_epochs) != sorted(s.decay_epochs):
        raise UserError("schedule.decay_epochs must be in increasing order")
    if rules == "torchvision" and not float(s.decay_epochs).is_integer():
        raise UserError(f"schedule.decay_epochs must be a whole number of epochs under rules: torchvision (its "
                        f"--lr-step-size), got {s.decay_epochs}")


def _whole_warmup(s, rules: str, flag: str) -> None:
    if not float(s.warmup_epochs).is_integer():
        raise UserError(f"schedule.warmup_epochs must be a whole number of epochs under rules: {rules} (its {flag} "
                        f"is an int), got {s.warmup_epochs}")


def _check_keras(s, epochs: int) -> None:
    if s.warmup_epochs >= epochs:
        raise UserError("schedule.warmup_epochs must be smaller than train.epochs")


def _check_timm(s, epochs: int) -> None:
    _whole_warmup(s, "timm", "--warmup-epochs")
    if s.cooldown_epochs and s.name != "cosine":
        raise UserError(f"schedule.cooldown_epochs applies to schedule.name cosine under rules: timm (timm's "
                        f"{s.name} schedule ignores --cooldown-epochs)")
    if s.name == "cosine" and timm_cosine_epochs(s, epochs) <= 0:
        prefix = f" and the prefixed warmup ({int(s.warmup_epochs)})" if s.warmup_prefix else ""
        raise UserError(f"train.epochs ({epochs}) leaves no epoch for timm's cosine after schedule.cooldown_epochs "
                        f"({s.cooldown_epochs}){prefix}")


def _check_torchvision(s, epochs: int) -> None:
    _whole_warmup(s, "torchvision", "--lr-warmup-epochs")


RULE_CHECKS = {"keras": _check_keras, "timm": _check_timm, "torchvision": _check_torchvision}


def timm_cosine_epochs(s, epochs: int) -> int:
    """timm's --epochs (the cosine's length, t_initial) for a run of `epochs` epochs in all: timm's train.py runs
    --epochs + --cooldown-epochs, plus --warmup-epochs with --warmup-prefix (create_scheduler_v2's num_epochs)."""
    return epochs - s.cooldown_epochs - (int(s.warmup_epochs) if s.warmup_prefix else 0)

import pytest
import yaml

from tfdp import config as config_lib
from tfdp.errors import UserError


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return str(path)


def test_yaml_values_and_overrides_reach_typed_fields(tmp_path):
    path = write(tmp_path, "train:\n  epochs: 7\noptimizer:\n  lr: 0.4\n")
    cfg = config_lib.load_config(path, {"optimizer.lr": 0.2, "distribute.cpu_replicas": 2})
    assert cfg.train.epochs == 7
    assert cfg.optimizer.lr == 0.2          # the override wins over the file
    assert cfg.distribute.cpu_replicas == 2
    assert cfg.model.name == config_lib.ModelConfig().name  # untouched defaults stay


def test_set_values_are_parsed_as_yaml():
    assert config_lib.parse_assignment("optimizer.lr=0.2") == ("optimizer.lr", 0.2)
    assert config_lib.parse_assignment("data.hflip=false") == ("data.hflip", False)
    assert config_lib.parse_assignment("data.mean=[1, 2, 3]") == ("data.mean", [1, 2, 3])
    with pytest.raises(UserError, match="KEY=VALUE"):
        config_lib.parse_assignment("optimizer.lr")


def test_ints_are_accepted_for_float_fields():
    assert config_lib.validate({"optimizer": {"lr": 1}}).optimizer.lr == 1.0


# YAML 1.2's floats, as recipes and papers write them (PyYAML's YAML 1.1 reads all but the last two as strings).
WRITTEN_FLOATS = {"1e-3": 1e-3, "5e-5": 5e-5, "1E-12": 1e-12, "+1e3": 1e3, "1.0e3": 1e3, ".5e-2": 0.005,
                  ".5": 0.5, "2.": 2.0}


@pytest.mark.parametrize("text, number", WRITTEN_FLOATS.items())
def test_floats_read_as_yaml_1_2_reads_them_in_files_and_set(tmp_path, text, number):
    path = write(tmp_path, f"optimizer:\n  lr: {text}\n")
    assert config_lib.load_config(path).optimizer.lr == number
    cfg = config_lib.load_config(None, dict([config_lib.parse_assignment(f"optimizer.lr={text}")]))
    assert cfg.optimizer.lr == number and type(cfg.optimizer.lr) is float   # a plain float: it dumps as YAML
    assert yaml.safe_load(config_lib.dump_yaml(cfg))["optimizer"]["lr"] == number


def test_a_string_field_takes_a_bare_number_as_written(tmp_path):
    """A folder named 1e3 (or 2024) stays that folder where the field is a string."""
    path = write(tmp_path, "model_dir: 1e3\ndata:\n  train_split: 2024\n  val_split: 0x10\n  cache_limit: 1000\n")
    cfg = config_lib.load_config(path, dict([config_lib.parse_assignment("data.tfds_name=1.50")]))
    assert (cfg.model_dir, cfg.data.train_split, cfg.data.val_split) == ("1e3", "2024", "0x10")
    assert cfg.data.tfds_name == "1.50"
    assert cfg.data.cache_limit == 1000 and type(cfg.data.cache_limit) is int   # int | str: the number stays one


@pytest.mark.parametrize("value, message", [
    ("1e-3x", "config field 'optimizer.lr': input should be a valid number (got '1e-3x')"),
    ("1e", "config field 'optimizer.lr': input should be a valid number (got '1e')"),
    ("e-3", "config field 'optimizer.lr': input should be a valid number (got 'e-3')"),
])
def test_what_is_no_number_still_fails_in_one_line(tmp_path, value, message):
    for overrides, path in (({"optimizer.lr": config_lib.parse_assignment(f"x={value}")[1]}, None),
                            ({}, write(tmp_path, f"optimizer:\n  lr: {value}\n"))):
        with pytest.raises(UserError) as e:
            config_lib.load_config(path, overrides)
        assert str(e.value) == message
    with pytest.raises(UserError, match=r"^config field 'train.epochs': input should be a valid integer \(got 1000.0\)$"):
        config_lib.load_config(None, dict([config_lib.parse_assignment("train.epochs=1e3")]))


@pytest.mark.parametrize("raw, message", [
    ({"data": {"imge_size": 32}}, "unknown config key 'data.imge_size'; did you mean 'data.image_size'?"),
    ({"trian": {}}, "unknown config key 'trian'; did you mean 'train'?"),
    ({"train": {"epochs": "ten"}}, "config field 'train.epochs': input should be a valid integer"),
    ({"train": {"epochs": 2.5}}, "config field 'train.epochs': input should be a valid integer"),
    ({"data": {"hflip": "yes"}}, "config field 'data.hflip': input should be a valid boolean"),
    ({"train": {"batch_size_per_replica": 0}}, "config field 'train.batch_size_per_replica': input should be greater than 0"),
    ({"optimizer": {"lr": -0.1}}, "config field 'optimizer.lr': input should be greater than 0"),
    ({"schedule": {"name": "cos"}}, "config field 'schedule.name': input should be 'cosine', 'linear', 'step', 'multistep', 'exponential', 'constant' or 'one_cycle'"),
    ({"data": 5}, "config section 'data' must be a mapping"),
    ({"data": {"min_crop_area": 0.9, "max_crop_area": 0.5}}, "data.min_crop_area must not exceed data.max_crop_area"),
    ({"schedule": {"warmup_epochs": 20}, "train": {"epochs": 10}}, "warmup_epochs must be smaller than train.epochs"),
    ({"augment": {"mixup": 0.2}}, "unknown config key 'augment.mixup'; did you mean 'augment.mixup_alpha'?"),
    ({"augment": {"mix_prob": 1.5}}, "config field 'augment.mix_prob': input should be less than or equal to 1"),
    ({"augment": {"switch_prob": -0.5}}, "config field 'augment.switch_prob': input should be greater than or equal to 0"),
    ({"augment": {"erasing_prob": 2}}, "config field 'augment.erasing_prob': input should be less than or equal to 1"),
    ({"augment": {"mixup_alpha": -1}}, "config field 'augment.mixup_alpha': input should be greater than or equal to 0"),
    ({"augment": {"erasing_mode": "noise"}}, "config field 'augment.erasing_mode': input should be 'pixel', 'rand' or 'const'"),
    ({"augment": {"rand_augment": "augmix-m3"}}, "config field 'augment.rand_augment': must start with 'rand-'"),
    ({"augment": {"rand_augment": "rand-m9-x3"}}, "config field 'augment.rand_augment': unknown RandAugment section 'x3'"),
    ({"augment": {"rand_augment": "rand-n1.5"}}, "config field 'augment.rand_augment': RandAugment section 'n1.5' needs an integer"),
    ({"augment": {"rand_augment": "rand-m9-p2"}}, "config field 'augment.rand_augment': RandAugment section 'p2': p must be in [0, 1]"),
    ({"augment": {"rand_augment": "rand-m9", "rand_augment_ops": ["Rotat"]}},
     "config field 'augment.rand_augment_ops': unknown op 'Rotat'; did you mean 'Rotate'?"),
    ({"augment": {"rand_augment_ops": ["Rotate"]}}, "augment.rand_augment_ops needs augment.rand_augment"),
    ({"augment": {"rand_augment": "rand-m9", "trivial_augment": True}},
     "augment.rand_augment and augment.trivial_augment exclude each other"),
    ({"augment": {"erasing_area": [0.4, 0.1]}}, "augment.erasing_area must be [min, max] with min <= max"),
    ({"model_dir": "hdfs://namenode/run"}, "model_dir hdfs://namenode/run: tfdp keeps runs on a local or shared"),
    ({"model_dir": "az://container/run"}, "gs:// or s3://, not az:// (the one-writer lease needs a store with "
                                          "conditional writes)"),
    ({"model_dir": "file:///data/run"}, "model_dir file:///data/run: give the path without file://"),
    # a union field: one problem, named once, with what each branch takes (no pydantic branch tag in the name)
    ({"model": {"bn_momentum": 1.5}}, "config field 'model.bn_momentum': input should be less than 1, or input "
                                      "should be 'auto' (got 1.5)"),
    ({"train": {"jit_compile": "maybe"}}, "config field 'train.jit_compile': input should be 'auto', or input "
                                          "should be a valid boolean (got 'maybe')"),
    ({"data": {"mean": [1, "x", 3]}}, "config field 'data.mean.1': input should be a valid number"),
])
def test_bad_values_name_the_field(raw, message):
    with pytest.raises(UserError) as err:
        config_lib.validate(raw)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_key_without_a_close_match_lists_valid_keys():
    with pytest.raises(UserError, match=r"valid keys: .*epochs.*batch_size_per_replica"):
        config_lib.validate({"train": {"zzz": 1}})


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(UserError, match="config file not found"):
        config_lib.load_config(str(tmp_path / "nope.yaml"))
    with pytest.raises(UserError, match=r"not valid YAML \(line \d+\)"):
        config_lib.load_config(write(tmp_path, "train:\n  epochs: [1\n"))
    with pytest.raises(UserError, match="must hold a mapping"):
        config_lib.load_config(write(tmp_path, "- a\n- b\n"))


def test_dumped_config_loads_back_identically(tmp_path):
    cfg = config_lib.validate({"data": {"mean": [1.0, 2.0, 3.0]}, "train": {"epochs": 3}})
    again = config_lib.load_config(write(tmp_path, config_lib.dump_yaml(cfg)))
    assert again == cfg


def test_every_shipped_config_is_valid():
    import glob
    import os
    from conftest import REPO
    paths = glob.glob(os.path.join(REPO, "configs", "*.yaml"))
    assert paths
    for path in paths:
        config_lib.load_config(path)


def test_jit_compile_auto_is_on_for_accelerators_and_off_on_cpu():
    from tfdp.keras_patches.train_step import use_xla
    validate = config_lib.validate
    assert validate({}).train.jit_compile == "auto"
    assert use_xla("auto", ["/job:localhost/replica:0/task:0/device:GPU:0"])[0] is True
    assert use_xla("auto", ["/device:TPU:0", "/device:TPU:1"])[0] is True
    assert use_xla("auto", ["/device:CPU:0", "/device:CPU:1"]) == (False, "auto: off on CPU devices")
    assert use_xla("auto", ["/device:GPU:0"], sync_bn=True)[0] is False  # its all-reduce cannot run inside XLA
    assert use_xla(True, ["/device:CPU:0"])[0] is True and use_xla(False, ["/device:GPU:0"])[0] is False
    assert validate({"train": {"jit_compile": True}}).train.jit_compile is True
    with pytest.raises(UserError, match="train.jit_compile"):
        validate({"train": {"jit_compile": "sometimes"}})


def test_augmentations_are_off_by_default_and_a_recipe_loads():
    from tfdp.config import AugmentConfig
    a = config_lib.validate({}).augment
    assert a == AugmentConfig()
    assert not a.rand_augment and not a.trivial_augment and a.erasing_prob == 0 and a.color_jitter == 0
    assert a.mixup_alpha == 0 and a.cutmix_alpha == 0
    timm = config_lib.validate({"augment": {"rand_augment": "rand-m9-mstd0.5-inc1", "mixup_alpha": 0.8,
                                            "cutmix_alpha": 1.0, "erasing_prob": 0.25}}).augment
    assert (timm.rand_augment, timm.mix_prob, timm.switch_prob, timm.erasing_mode) == (
        "rand-m9-mstd0.5-inc1", 1.0, 0.5, "pixel")
    assert config_lib.validate({"augment": {"erasing_area": [0.1, 0.2]}}).augment.erasing_area == (0.1, 0.2)


def test_channel_order_is_rgb_or_bgr_and_the_config_keeps_it():
    with pytest.raises(UserError, match=r"config field 'data.channel_order': .*'rgb' or 'bgr'"):
        config_lib.validate({"data": {"channel_order": "grb"}})
    cfg = config_lib.validate({"data": {"channel_order": "bgr"}})
    assert config_lib.validate(yaml.safe_load(config_lib.dump_yaml(cfg))).data.channel_order == "bgr"


def test_a_bucket_model_dir_is_accepted_as_it_is():
    """gs:// and s3:// runs live in the bucket (tests/rundir/test_bucket_run.py): the URL stays a URL."""
    for url in ("gs://bucket/run", "s3://bucket/run"):
        assert config_lib.validate({"model_dir": url}).model_dir == url

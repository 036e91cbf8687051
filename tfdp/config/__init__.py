"""Typed run configuration: YAML in, validated dataclasses out.

The YAML file and the command-line overrides are merged as plain dicts first,
then validated exactly once (`load_config`), so every later module can trust
the types and ranges it receives. Validation is pydantic's; the messages are
rewritten to one line that names the field (and, for a typo, the nearest
valid key).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from typing import Annotated, Any, Literal

import pydantic
import yaml
from pydantic import BeforeValidator, ConfigDict, Field, Strict

from tfdp.config.rand_augment import RAND_AUGMENT_OP_NAMES, parse_rand_augment
from tfdp.config.model_dir import DEFAULT_SCRATCH_DIR, check_model_dir
from tfdp.config.schedule_rules import check_schedule_rules
from tfdp.errors import UserError
from tfdp.config.image_sizes import ramp_sizes
from tfdp.config.imagenet_stats import IMAGENET_MEAN, IMAGENET_STD  # noqa: F401  (public here too)
from tfdp.config import yaml_floats

_FORBID = ConfigDict(extra="forbid")

PosInt = Annotated[int, Strict(), Field(gt=0)]
NonNegInt = Annotated[int, Strict(), Field(ge=0)]
PosFloat = Annotated[float, Strict(), Field(gt=0)]
NonNegFloat = Annotated[float, Strict(), Field(ge=0)]
Fraction = Annotated[float, Strict(), Field(ge=0, le=1)]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict(), BeforeValidator(yaml_floats.scalar_text)]   # a bare number: its text as written


DEFAULT_CACHE_DIR = "~/.cache/tfdp/remote"


@dataclasses.dataclass
class DataConfig:
    """Where the images are and how they are fed (see tfdp/data)."""
    __pydantic_config__ = _FORBID
    # digits | image_folder | csv (DIR/<split>.csv or .jsonl: image paths and labels) | imagenet (raw ILSVRC2012
    # or Kaggle tree) | tfrecord | wds (WebDataset tar shards: an image and its .cls per sample) | parquet (the
    # Hugging Face Hub's datasets: an image and a label column) | tfds | idx (MNIST-family IDX files:
    # <split>-images-idx3-ubyte[.gz] and its labels, read as pixels; docs/data.md) | synthetic
    format: Str = "digits"
    # a local path, a bucket (gs://bucket/prefix, s3://bucket/prefix) or a Hub dataset (hf://datasets/ORG/NAME)
    dir: Str = "~/.cache/tfdp/digits"
    train_split: Str = "train"   # name of the training split (folder, shard prefix or TFDS split)
    val_split: Str = "val"   # name of the validation split
    # data.format image_folder: the share of each class's images held out for validation from one tree of class
    # folders (data.dir/<class>/<image>, or data.dir/<train_split>/<class>/<image> with no validation folder beside
    # it), decided per image by a hash of its path and data.val_seed, so adding images moves none. 0: off (the
    # train_split and val_split folders).
    val_fraction: Annotated[float, Strict(), Field(ge=0, lt=1)] = 0.0
    # ... the seed of that hash: its own, so that runs of another train.seed validate on the same images
    val_seed: NonNegInt = 0
    # data.format wds: the field of each sample's .json member that holds its class number, a '/' separating
    # nested keys (timm's --target-key); a sample whose number is negative is left out, as timm skips it. "": the
    # sample's .cls member.
    label_key: Str = ""
    tfds_name: Str = ""                 # data.format tfds: the dataset's name, e.g. imagenet2012
    tfds_manual_dir: Str = ""           # ... and where its manually downloaded files are, to prepare it
    cache_dir: Str = DEFAULT_CACHE_DIR        # local copies of files read from a bucket
    # Most bytes of a bucket's files a training stream keeps in data.cache_dir: "20GB", "500MB", "64GiB" or
    # a number of bytes. A share that fits is copied once, as a whole; a larger one is streamed, each file
    # fetched ahead of the reader and deleted once read (docs/data.md, bounded cache). auto: half the free
    # space of data.cache_dir at start.
    cache_limit: Annotated[Annotated[int, Strict()] | Str, Field(union_mode="left_to_right")] = "auto"
    # Through the tf.data service, where its workers keep their copies of a bucket's training files
    # (`tfdp data-service worker --mirror=URL --cache_dir=DIR`): the trainer sends these paths and reads
    # none of the training data itself. "": the same as data.cache_dir.
    service_cache_dir: Str = ""
    # Seconds a bucket's endpoint may take to answer the first request before the run stops.
    remote_timeout: PosFloat = 20.0
    synthetic_examples: PosInt = 1_281_167    # data.format synthetic: examples per "epoch"
    # Training stops once more than this fraction of the records read could not be decoded.
    max_bad_fraction: Annotated[float, Strict(), Field(ge=0, le=1)] = 0.001
    image_size: PosInt = 32   # training crop side in pixels (the last size with progressive resizing)
    # Random-resized-crop window for training (fraction of the image area).
    min_crop_area: Annotated[float, Strict(), Field(gt=0, le=1)] = 0.08
    max_crop_area: Annotated[float, Strict(), Field(gt=0, le=1)] = 1.0   # ... its largest fraction
    hflip: Bool = True   # random horizontal flip in training, on the device
    # Evaluation crops this fraction of the shorter side around the centre. Unset, with model.init_from:
    # the weights' own where they carry one (a timm pretrained cfg's crop_pct, a tfdp run's).
    eval_crop_fraction: Annotated[float, Strict(), Field(gt=0, le=1)] = 0.875
    # Test-time crop side (FixRes: evaluate above the training size, e.g. train 176, test 224); 0 = image_size.
    eval_image_size: NonNegInt = 0
    # How evaluation, prediction and export resize: fast (the central crop decoded alone, then resized bilinearly
    # without antialiasing: the cheapest), or bilinear | bicubic (timm's and torchvision's evaluation: the shorter
    # side resized to the crop side / eval_crop_fraction, antialiased as Pillow's, then the central crop). Unset,
    # with model.init_from: the weights' own (a timm pretrained cfg's interpolation; torchvision's bilinear).
    eval_interpolation: Literal["fast", "bilinear", "bicubic"] = "fast"
    # Progressive resizing (FFCV): train at progressive_min_size up to progressive_start_epoch (0-based), then
    # at sizes rising to image_size at progressive_end_epoch, rounded to multiples of progressive_step
    # (FFCV's get_resolution, tfdp/config/image_sizes.py); 0 = off, every epoch at image_size.
    progressive_min_size: NonNegInt = 0
    progressive_start_epoch: NonNegInt = 0   # last 0-based epoch at progressive_min_size
    progressive_end_epoch: NonNegInt = 0   # first 0-based epoch at image_size
    progressive_step: PosInt = 32   # ramp sizes rounded to multiples of this (FFCV: 32)
    shuffle_buffer: PosInt = 10_000   # examples in the training shuffle buffer
    cache: Bool = False   # keep the encoded images in memory after the first epoch (refused if the share cannot fit)
    deterministic: Bool = False   # crop windows from train.seed and the stream position: runs repeat them
    # Who decodes and crops the training and validation images: tf (TensorFlow, on the host's CPUs), dali (NVIDIA
    # DALI on each replica's GPU, or its CPU operators on CPU replicas; the examples and their order stay tfdp's,
    # the training crop windows are DALI's: docs/data.md, decoders) or auto (dali where DALI is installed and every
    # replica is a GPU of its own, else tf). `tfdp predict` decodes the same way.
    decoder: Literal["tf", "dali", "auto"] = "tf"
    # data.decoder dali: CPU threads of each replica's DALI pipeline (they parse each JPEG and feed the GPU's
    # decoders; on CPU replicas they decode); 0: auto, the host's cores shared among its replicas, at most 3 per
    # GPU replica: on one H200 more threads cost more host CPU and fed the card slower (docs/benchmarks.md).
    dali_threads: NonNegInt = 0
    # data.decoder dali on a GPU: the share of the JPEGs sent to the card's hardware JPEG decoders (A100, H100 and
    # later), the rest decoded on its CUDA cores after a Huffman pass on the host's CPUs (DALI's hw_decoder_load).
    # 0.95, not DALI's 0.65: on one H200 ResNet-18 trained at 8,099 images/s against 7,132, with less host CPU
    # (docs/benchmarks.md); a card with slower engines (A100, not measured) may want DALI's 0.65.
    dali_hw_decoder_load: Annotated[float, Strict(), Field(ge=0, le=1)] = 0.95
    # Repeated augmentation (DeiT's RASampler, torchvision's --ra-reps): every data epoch shows 1/k of
    # the images k times each, each copy cropped and augmented on its own, the copies of one image dealt
    # to different replicas of a step; an epoch keeps its length. 1: off.
    repeated_augmentation: PosInt = 1
    # Per-channel (R, G, B) statistics in 0..255 pixel units, applied on the device. Unset, with
    # model.init_from: those the weights were trained with (Keras' per family, a tfdp run's, a timm file's,
    # torchvision's), else ImageNet's; see docs/pretrained-weights.md.
    mean: tuple[Annotated[float, Strict()], ...] = IMAGENET_MEAN
    std: tuple[PosFloat, ...] = IMAGENET_STD   # ... and their standard deviations
    # The channel order the model's first layer sees, after normalisation: rgb, or bgr (Keras' caffe-style
    # ResNet ImageNet weights). Unset, with model.init_from: the weights' order.
    channel_order: Literal["rgb", "bgr"] = "rgb"
    # A tf.data service dispatcher (grpc://host:port, see `tfdp data-service`) that runs the training
    # pipeline on its workers, so input scales past this host's CPUs; "" = the local pipeline.
    # Evaluation always reads locally.
    service_address: Str = ""
    # distributed_epoch: all trainers share one job over the whole split, every example once per data
    # epoch; parallel_epochs: every service worker streams this trainer's share in its own order.
    service_mode: Literal["distributed_epoch", "parallel_epochs"] = "distributed_epoch"
    # Seconds the dispatcher may take at start to answer and to have a service worker before the run stops
    # with an error.
    service_timeout: PosFloat = 60.0
    # How the service sends batches: none (raw uint8, ~150 KB per 224 px image: the trainer only copies them;
    # far less trainer CPU than decoding locally, docs/benchmarks.md) or auto (TensorFlow compresses them with
    # snappy and the trainer decompresses: less saved; for a network slower than the images' bytes per second).
    service_compression: Literal["auto", "none"] = "none"


@dataclasses.dataclass
class ModelConfig:
    __pydantic_config__ = _FORBID
    name: Str = "resnet18_small"   # a model registry name (tfdp/models/registry.py)
    num_classes: PosInt = 10   # classifier outputs; must match the data's classes
    # Dropout rate before the classifier; None: the model's own default (0.5 for VGG and SqueezeNet as
    # their papers, 0.2 for EfficientNetV2 and MobileNetV3 as keras.applications, else 0); 0: none.
    dropout: Annotated[float, Strict(), Field(ge=0, lt=1)] | None = None
    # Batch-norm statistics over the global batch (all replicas) instead of each replica's share, as
    # Model Garden's use_sync_bn and PyTorch's SyncBatchNorm: for small per-replica batches.
    sync_bn: Bool = False
    # Every batch-norm layer's moving-average momentum, in Keras' sense: the share of the old statistic kept per
    # step (torch's momentum 0.1 is 0.9 here). auto: 0.9 when training from scratch (timm's, torch's default,
    # and Model Garden's ImageNet ResNet), the architecture's own with model.init_from (keras.applications'
    # 0.99): the statistics keep the pace the weights were trained at. docs/models.md.
    bn_momentum: Annotated[float, Strict(), Field(ge=0, lt=1)] | Literal["auto"] = "auto"
    # Stochastic depth: residual branches dropped per sample, the rate rising linearly to this at the last
    # block (timm's drop_path_rate); the ResNet family, ConvNeXt, the transformers and the EfficientNets.
    drop_path: Annotated[float, Strict(), Field(ge=0, lt=1)] = 0.0
    # Weights a fresh run starts from (a resumed run continues from its own checkpoint): imagenet (Keras' own
    # files, keras.applications models), a tfdp run directory, a checkpoint folder, a .keras or .weights.h5
    # file, a torchvision/timm .safetensors state dict, or a keras-hub preset folder (ViT, ResNet); local or in a
    # bucket (gs://, s3://: `tfdp train` copies it into data.cache_dir first); or a Hugging Face Hub repository
    # (hf-hub:timm/NAME, hf://ORG/NAME, @REVISION optional: fetched into the Hub's cache first); see
    # docs/pretrained-weights.md. "": random init.
    init_from: Str = ""
    # fnmatch patterns over layer names and layer/variable paths (e.g. "logits", "stage4_*", "*/bias") that
    # model.init_from leaves as initialised.
    init_exclude: tuple[Str, ...] = ()


@dataclasses.dataclass
class OptimizerConfig:
    __pydantic_config__ = _FORBID
    # sgd (momentum) | adamw | lamb | lars (layer-wise trust ratio, for very large batches) | rmsprop (TensorFlow 1's,
    # as the EfficientNet recipes) | muon | lion | schedule_free_adamw | adafactor (Keras' own); under rules timm
    # and torchvision sgd, adamw and lamb take torch's and timm's forms; see tfdp/optim/optimizers.py
    name: Literal["sgd", "adamw", "lamb", "lars", "rmsprop", "muon", "lion", "schedule_free_adamw",
                  "adafactor"] = "sgd"
    # The learning rate, scaled with the global batch as optimizer.lr_scale says: under rules keras the rate per
    # 256 images; under rules timm and torchvision the rate as given (their --lr).
    lr: PosFloat = 0.1
    # How optimizer.lr scales with the global batch G: linear (lr x G / lr_base_size), sqrt (lr x sqrt(G /
    # lr_base_size)) or none (as given). auto: linear under rules keras, none under timm and torchvision.
    # timm's --lr-base X: optimizer.lr X with linear (its default for SGD-like optimizers) or sqrt (its default
    # for names holding "ada" or "lamb"), as its --lr-base-scale says.
    lr_scale: Literal["auto", "linear", "sqrt", "none"] = "auto"
    # The batch optimizer.lr is given for, with lr_scale linear or sqrt (timm's --lr-base-size). None: 256.
    lr_base_size: PosInt | None = None
    momentum: Fraction = 0.9               # sgd, lars, rmsprop, muon
    nesterov: Bool = False                 # sgd, muon
    rho: Fraction = 0.9                    # rmsprop: decay of the mean squared gradient
    beta1: Fraction = 0.9                  # adamw, lamb, lion, schedule_free_adamw, muon (its adam steps)
    beta2: Fraction = 0.999                # adamw, lamb, lion (Lion's paper: 0.99), schedule_free_adamw, muon
    epsilon: PosFloat = 1e-8               # adamw, lamb, rmsprop (EfficientNet: 1e-3), schedule_free_adamw, muon
    weight_decay: NonNegFloat = 0.0   # sgd/lars: L2 through the gradient; adamw/lamb: decoupled
    # Most ImageNet recipes decay only conv/dense kernels, not batch-norm scale/shift or biases.
    decay_norm_and_bias: Bool = True
    # With decay_norm_and_bias false, whether biases are decayed all the same, norm layers alone spared:
    # torchvision's --norm-weight-decay 0.0 without --bias-weight-decay. None: as decay_norm_and_bias.
    decay_bias: Bool | None = None
    # Clip the global gradient norm to this (0: off).
    clip_norm: NonNegFloat = 0.0
    # Exponential moving average of the weights with this decay (0: off). rules keras: warmed up as
    # (1 + t) / (10 + t), trainable weights only; timm: ModelEmaV3 (--model-ema-decay), torchvision:
    # ExponentialMovingAverage (--model-ema-decay), both averaging the batch-norm statistics too.
    ema_decay: Annotated[float, Strict(), Field(ge=0, lt=1)] = 0.0
    # rules timm only: ModelEmaV3's decay warmup (--model-ema-warmup), min(decay, 1 - (1 + t) ** (-2/3)).
    ema_warmup: Bool = False
    # rules torchvision only: update the average every this many steps (--model-ema-steps; 0: its default, 32),
    # with the decay adjusted as torchvision does for the global batch and the epochs.
    ema_every_steps: NonNegInt = 0
    # Layer-wise learning-rate decay (timm's --layer-decay): a variable in layer group i of n (the stem 0, one per
    # block, the head n-1) trains at lr * layer_decay ** (n - 1 - i), its decoupled weight decay scaled alike;
    # 0 or 1 = off. Needs a model with a layer grouping (the ResNet family, VGG, simple_cnn, the transformers,
    # ConvNeXt, the EfficientNets, RegNet); docs/fine-tuning.md.
    layer_decay: Annotated[float, Strict(), Field(ge=0, le=1)] = 0.0
    # The classifier head's learning rate (and decoupled weight decay) times this, on top of layer_decay.
    head_lr_multiplier: PosFloat = 1.0


@dataclasses.dataclass
class ScheduleConfig:
    __pydantic_config__ = _FORBID
    # The rate's shape after the warmup. rules keras: cosine, linear (from the peak straight down to 0 at the last
    # step; with warmup, FFCV's triangular "cyclic" schedule), step, exponential, constant or one_cycle; rules timm
    # (its --sched): cosine, step, multistep or constant; rules torchvision (its --lr-scheduler): cosine
    # (cosineannealinglr), step (steplr) or exponential (exponentiallr). None: the rule set's default (cosine;
    # torchvision: step). docs/recipes.md.
    name: Literal["cosine", "linear", "step", "multistep", "exponential", "constant", "one_cycle"] | None = None
    # Epochs of warmup (timm's --warmup-epochs, torchvision's --lr-warmup-epochs; whole epochs for both). keras:
    # per step from peak/W to the peak. None: the rule set's default (0; timm: 5).
    warmup_epochs: NonNegFloat | None = None
    # step and multistep decay. A list: the epochs at which the rate is multiplied by decay_rate (keras step, timm
    # multistep's --decay-milestones); a number: decay every this many epochs (timm step's --decay-epochs,
    # torchvision's --lr-step-size). None: the rule set's default (keras [30, 60, 80]; timm 90 or [90, 180, 270];
    # torchvision 30).
    decay_epochs: tuple[PosInt, ...] | PosFloat | None = None
    # step, multistep: factor at each decay; exponential: factor per epoch (timm's --decay-rate, torchvision's
    # --lr-gamma).
    decay_rate: Annotated[float, Strict(), Field(gt=0, le=1)] = 0.1
    # rules timm and torchvision: the rate cosine ends at (timm's --min-lr, torchvision's --lr-min). None: 0.
    min_lr: NonNegFloat | None = None
    # rules timm: the rate warmup starts from (--warmup-lr). None: timm's 1e-5.
    warmup_lr: NonNegFloat | None = None
    # rules timm: warmup before the schedule rather than inside its epochs (--warmup-prefix). None: false.
    warmup_prefix: Bool | None = None
    # rules timm: the rate changes every optimizer update, not once an epoch (--sched-on-updates). None: false.
    on_updates: Bool | None = None
    # rules timm, cosine: last epochs held at min_lr after the cosine (--cooldown-epochs); train.epochs counts
    # them. None: 0.
    cooldown_epochs: NonNegInt | None = None
    # rules torchvision: warmup linear (rising from lr x warmup_decay) or constant (lr x warmup_decay)
    # (--lr-warmup-method). None: torchvision's constant.
    warmup_method: Literal["linear", "constant"] | None = None
    # rules torchvision: the warmup's factor on the rate (--lr-warmup-decay). None: torchvision's 0.01.
    warmup_decay: Annotated[float, Strict(), Field(gt=0, le=1)] | None = None
    # `one_cycle` (Smith & Topin 2019, as torch's OneCycleLR): rise from peak/div_factor over
    # pct_start of the run, then cosine down to peak/(div_factor*final_div_factor).
    pct_start: Annotated[float, Strict(), Field(gt=0, lt=1)] = 0.3
    div_factor: Annotated[float, Strict(), Field(ge=1)] = 25.0   # one_cycle: start at peak / this
    final_div_factor: Annotated[float, Strict(), Field(ge=1)] = 1e4   # one_cycle: end at start / this


@dataclasses.dataclass
class TeacherConfig:
    __pydantic_config__ = _FORBID
    # Knowledge distillation (docs/distillation.md): none, or the teacher's logits teach the student's: soft (KL
    # divergence at temperature tau) or hard (cross-entropy on the teacher's top class, DeiT's).
    distillation: Literal["none", "soft", "hard"] = "none"
    model: Str = ""   # the teacher's model name (`tfdp models`); built beside the student on every replica, frozen
    # The teacher's weights: any source model.init_from reads (a tfdp run, .safetensors, .weights.h5, a keras-hub
    # preset, a Hub handle). Every layer must load, its classifier with model.num_classes classes.
    init_from: Str = ""
    alpha: Fraction = 0.5   # loss = (1 - alpha) x the labels' loss + alpha x the teacher's (DeiT's)
    tau: PosFloat = 1.0   # soft: the softmax temperature (the term is multiplied by tau^2)
    # soft: the summed KL divergence divided by the batch (`batch`, timm's batchmean) or by batch x classes
    # (`logits`, DeiT's numel).
    soft_reduction: Literal["batch", "logits"] = "batch"
    # The teacher's input side in px (0: what its weights say, else data.image_size); the batch is resized to it on
    # the device.
    image_size: NonNegInt = 0
    # The teacher's per-channel mean, 0..255 units, R, G, B (empty: what its weights say, else data.mean).
    mean: tuple[Annotated[float, Strict()], ...] = ()
    std: tuple[PosFloat, ...] = ()   # ... and standard deviation (empty: its weights', else data.std)
    # true: the student must have DeiT's distillation head (the recipe's teacher teaches that token only); false: a
    # student with one learns from the teacher there, any other on its one head.
    dist_token: Bool = False


@dataclasses.dataclass
class TrainConfig:
    __pydantic_config__ = _FORBID
    epochs: PosInt = 10   # epochs to train
    # Images per replica per micro-batch (what must fit in memory). With train.global_batch set and
    # train.grad_accum_steps 1 it is the largest one: the accumulation is derived (docs/global-batch.md).
    batch_size_per_replica: PosInt = 64
    # Micro-batches per optimizer step, their gradients summed inside the compiled step and all-reduced and
    # applied once. With train.global_batch set above 1 it fixes the accumulation and the per-replica batch is
    # derived. Batch norm normalises each micro-batch on its own.
    grad_accum_steps: PosInt = 1
    # The images per optimizer step on any hardware (the recipe's batch; the learning rate scales with it):
    # replicas x per-replica batch x accumulation is derived from it on the devices found. 0: the global batch
    # is batch_size_per_replica x replicas x grad_accum_steps, and a resumed run keeps its checkpoint's
    # (cut on the devices found, whatever their number; docs/global-batch.md).
    global_batch: NonNegInt = 0
    label_smoothing: Annotated[float, Strict(), Field(ge=0, lt=1)] = 0.0   # mass spread evenly over all classes
    # softmax: cross-entropy over the classes; bce: a sigmoid per class (one-vs-all binary cross-entropy, timm's
    # BinaryCrossEntropy, as ResNet strikes back trains), its targets smoothed by label_smoothing as timm does.
    loss: Literal["softmax", "bce"] = "softmax"
    # bce only: targets above this become 1, the rest 0 (timm's --bce-target-thresh; RSB uses 0.2, so both images
    # of a Mixup/CutMix pair count as present); null = the soft targets as they are.
    bce_target_threshold: Annotated[float, Strict(), Field(ge=0, lt=1)] | None = None
    seed: NonNegInt = 0   # seeds weights, shuffling, crops and augmentations
    # Keep the best checkpoint by this validation metric.
    best_metric: Literal["val_top1", "val_loss", "val_ema_top1", "val_ema_loss"] = "val_top1"
    # The workers' own pass over the validation split each epoch. `auto`: skipped when TF_CONFIG's cluster has an
    # evaluator task (it evaluates every checkpoint and keeps the best one, docs/clusters.md), else run; `never`:
    # skipped (`tfdp evaluate --continuous` beside the run does it); `always`: run, evaluator or not.
    validate: Literal["auto", "always", "never"] = "auto"
    # Compute dtype policy; logits and loss stay float32, float16 gets dynamic loss scaling.
    precision: Literal["float32", "mixed_bfloat16", "mixed_float16"] = "float32"
    # Training steps per tf.function call (fewer host round trips for small models).
    steps_per_execution: PosInt = 1
    # Compile the whole training step with XLA, optimizer update included (tfdp/keras_patches/train_step.py);
    # works with any number of replicas, where Keras' own jit_compile fails (it compiles the cross-replica step).
    # `auto`: on where the strategy's devices are GPUs or TPUs (their fast path; docs/benchmarks.md),
    # off on CPUs, and off with model.sync_bn; true/false force it.
    jit_compile: Literal["auto"] | Bool = "auto"
    # Mid-epoch checkpoints every this many global steps (0: epoch checkpoints only). A kill loses at
    # most this many steps; a preemption notice (SIGTERM) loses none. The default keeps a checkpoint
    # a small share of step time on the ImageNet recipes (docs/benchmarks.md, benchmarks/checkpoint_cost.py).
    checkpoint_every_steps: NonNegInt = 1000
    # Bit-identical runs: TensorFlow op determinism and seeded input (implies data.deterministic), so a
    # run killed and resumed any number of times ends with exactly the weights of an uninterrupted one.
    deterministic: Bool = False
    # Seconds the chief's lease on model_dir (tfdp/rundir/lease.py, docs/one-writer.md) stays valid without a renewal
    # (it renews every quarter of this). A run on another host finding a lease older than this takes it over;
    # a dead holder on the same host is taken over at once. Hosts' clocks must agree to well within it.
    lease_timeout: PosFloat = 60.0
    # A model_dir in a bucket: seconds an upload or download retries (with backoff) while the bucket does not
    # answer, before the run stops with the restart status 143 (the same command resumes from the newest
    # committed checkpoint).
    upload_retry_seconds: PosFloat = 120.0
    # Layers that do not train (fine-tuning): `backbone` (everything but the model's classifier head), stage or
    # layer names (stage1 = every layer named stage1_*) or fnmatch patterns of layer names. Frozen batch norm runs
    # in inference mode (its moving statistics stay as loaded). Empty = everything trains.
    freeze: tuple[Str, ...] = ()
    # With train.freeze: 0 = frozen for the whole run; N = frozen for the first N epochs, then everything trains
    # (the head first, then all, as Keras' transfer-learning guide).
    freeze_epochs: NonNegInt = 0
    # A teacher beside the student (knowledge distillation, docs/distillation.md).
    teacher: TeacherConfig = dataclasses.field(default_factory=TeacherConfig)


# train.validate -> whether the workers run their own validation pass, given whether the cluster has an evaluator task.
WORKERS_VALIDATE = {"auto": lambda evaluator: not evaluator, "always": lambda evaluator: True,
                    "never": lambda evaluator: False}


def workers_validate(train: TrainConfig, evaluator: bool) -> bool:
    """Whether the workers validate each epoch (`train.validate`); where they do not, the evaluator keeps the best
    checkpoint (tfdp/commands/continuous_eval.py), so it has one writer either way."""
    return WORKERS_VALIDATE[train.validate](evaluator)


@dataclasses.dataclass
class DistributeConfig:
    __pydantic_config__ = _FORBID
    strategy: Literal["one_device", "mirrored", "multi_worker"] = "mirrored"   # the tf.distribute strategy (tfdp/distribute/strategy.py)
    # On a host without GPUs, split the CPU into this many logical devices so
    # `mirrored` really runs that many replicas. 0 keeps one CPU device.
    cpu_replicas: NonNegInt = 0
    # multi_worker on hosts without GPUs: each worker mirrors over this many logical CPUs, as it mirrors over a
    # host's GPUs (a cluster of multi-GPU hosts at CPU scale). 1: TensorFlow's one CPU device per worker.
    cpu_replicas_per_worker: PosInt = 1
    # multi_worker: the all-reduce implementation across hosts.
    communication: Literal["auto", "ring", "nccl"] = "auto"
    # multi_worker: seconds to wait for every worker to join before giving up.
    startup_timeout: PosFloat = 120.0


@dataclasses.dataclass
class LogConfig:
    """What the chief records besides metrics.jsonl (see tfdp/train/callbacks.py)."""
    __pydantic_config__ = _FORBID
    tensorboard: Bool = True   # TensorBoard event files under model_dir/tensorboard
    # Profile training steps [first, last] (1-based, first epoch) into the TensorBoard logs; [0, 0] = off.
    profile_steps: tuple[NonNegInt, NonNegInt] = (0, 0)
    # Weights & Biases project; empty = off. `wandb_mode: offline` logs without a network.
    wandb_project: Str = ""
    wandb_mode: Literal["online", "offline", "disabled"] = "online"   # Weights & Biases' mode


@dataclasses.dataclass
class AugmentConfig:
    """Batch augmentations run on the device inside the training step (tfdp/augment/); all off by default.

    Each follows its reference implementation (timm or torchvision) and draws its randomness per image.
    """
    __pydantic_config__ = _FORBID
    # timm RandAugment string, "" = off: "rand" and dash-separated sections m<magnitude 0-10> n<ops per image>
    # mstd<magnitude noise> mmax<magnitude cap> inc<0|1> p<chance per op>; timm's ImageNet recipes use
    # "rand-m9-mstd0.5-inc1" (n2, p0.5 by default).
    rand_augment: Str = ""
    # Restrict RandAugment to these ops (timm names, config.rand_augment.RAND_AUGMENT_OP_NAMES); empty: timm's 15 (inc1: its
    # increasing variants).
    rand_augment_ops: tuple[Str, ...] = ()
    # torchvision TrivialAugmentWide: one op per image, its magnitude uniform over 31 bins. Excludes rand_augment.
    trivial_augment: Bool = False
    # timm Mixup/CutMix: on where alpha > 0; lambda ~ Beta(alpha, alpha), the partner is the batch reversed.
    mixup_alpha: NonNegFloat = 0.0
    cutmix_alpha: NonNegFloat = 0.0   # CutMix's alpha (0: off)
    mix_prob: Fraction = 1.0        # chance that an image (mix_mode batch: the batch) is mixed at all
    switch_prob: Fraction = 0.5     # with both alphas > 0: chance of CutMix instead of Mixup
    # elem: each image its own lambda, box and mixup/cutmix choice (timm mode='elem'); batch: one for the whole
    # per-replica batch (timm's default mode='batch').
    mix_mode: Literal["elem", "batch"] = "elem"
    # timm RandomErasing: chance per image; pixel: per-pixel normal noise, rand: one normal colour per box,
    # const: the mean colour (noise and colour in normalized units, i.e. data.mean + data.std * N(0, 1)).
    erasing_prob: Fraction = 0.0
    erasing_mode: Literal["pixel", "rand", "const"] = "pixel"   # what fills an erased box (see erasing_prob)
    erasing_area: tuple[Fraction, Fraction] = (0.02, 1 / 3)   # erased fraction of the image, [min, max]
    erasing_min_aspect: Annotated[float, Strict(), Field(gt=0, le=1)] = 0.3   # log-uniform in [this, 1/this]
    # torchvision ColorJitter: brightness, contrast and saturation factors drawn from [max(0, 1-x), 1+x]
    # (timm's --color-jitter), hue shift from [-h, h]; 0 = off.
    color_jitter: NonNegFloat = 0.0
    color_jitter_hue: Annotated[float, Strict(), Field(ge=0, le=0.5)] = 0.0   # hue shift bound h (0 = off)
    color_jitter_random_order: Bool = True   # torchvision applies the four in a random order per call (here per image)


@dataclasses.dataclass
class Config:
    __pydantic_config__ = _FORBID
    # Checkpoints, metrics, TensorBoard logs, config.yaml: a local or shared file system path, or a bucket
    # (gs://bucket/run, s3://bucket/run; docs/cloud.md).
    model_dir: Str = "runs/default"
    # A bucket model_dir's local working copy (the newest checkpoints and the logs, uploaded as written).
    scratch_dir: Str = DEFAULT_SCRATCH_DIR
    # Whose training rules the run follows, so a recipe trains step for step as the trainer it quotes:
    # keras (Keras' optimizers and tfdp's per-step schedules: Model Garden, google/automl), timm (timm's
    # train.py: its schedulers, torch's SGD momentum and Adam epsilon, ModelEmaV3) or torchvision (its
    # references/classification/train.py). docs/recipes.md lists what each changes.
    rules: Literal["keras", "timm", "torchvision"] = "keras"
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    distribute: DistributeConfig = dataclasses.field(default_factory=DistributeConfig)
    log: LogConfig = dataclasses.field(default_factory=LogConfig)
    augment: AugmentConfig = dataclasses.field(default_factory=AugmentConfig)


_ADAPTER = pydantic.TypeAdapter(Config)


def read_yaml(path: str) -> dict[str, Any]:
    """Reads a config file into a plain dict (no validation yet)."""
    if not os.path.isfile(path):
        raise UserError(f"config file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml_floats.load_config_text(f)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise UserError(f"config file {path} is not valid YAML{where}") from None
    except UnicodeDecodeError:
        raise UserError(f"config file {path} is not UTF-8 text: is it a config?") from None
    except OSError as e:
        raise UserError(f"cannot read config file {path}: {e.strerror or e}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise UserError(f"config file {path} must hold a mapping of sections, not {type(raw).__name__}")
    return raw


def apply_override(raw: dict[str, Any], dotted: str, value: Any) -> None:
    """Sets `raw[a][b][c] = value` for `dotted == "a.b.c"`, creating sections."""
    keys = dotted.split(".")
    node = raw
    for i, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise UserError(f"cannot set {dotted}: {'.'.join(keys[:i + 1])} is not a section")
        node = child
    node[keys[-1]] = value


def parse_assignment(text: str) -> tuple[str, Any]:
    """Parses `a.b=value` as given to `--set`, the value read as YAML (so 0.2 is a float)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise UserError(f"--set expects KEY=VALUE (for example optimizer.lr=0.2), got {text!r}")
    try:
        parsed = yaml_floats.load_config_text(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value
    return key.strip(), parsed


# The command line's dedicated flags (tfdp.cli) and the field each sets: `--epochs=4` is `--set=train.epochs=4`.
# Here, below the command line, so that what reads flags as the CLI does needs no absl flags defined.
FLAG_FIELDS = {
    "model_dir": "model_dir",
    "epochs": "train.epochs",
    "batch_size_per_replica": "train.batch_size_per_replica",
    "strategy": "distribute.strategy",
    "cpu_replicas": "distribute.cpu_replicas",
    "model": "model.name",
    "init_from": "model.init_from",
    "data_dir": "data.dir",
    "data_format": "data.format",
    "data_service": "data.service_address",
}


def validate(raw: dict[str, Any], from_run: bool = True) -> Config:
    """Turns a merged dict into a `Config`, or raises a one-line `UserError`. `from_run` False: a command that
    starts from model.init_from's weights, not the run in model_dir, takes their preprocessing, not the run's."""
    try:
        cfg = _ADAPTER.validate_python(raw)
    except pydantic.ValidationError as e:
        raise UserError(_describe_first(e.errors())) from None
    from tfdp.config.pretrained import resolve  # imports this module
    data = raw.get("data") or {}
    # the weights' preprocessing (their image size too), where the user set none (a DataConfig given whole counts
    # as set); before the cross-field checks, which read the image size
    resolve(cfg, set_by_user=set(data) if isinstance(data, dict)
            else {f.name for f in dataclasses.fields(cfg.data)}, from_run=from_run)
    _check_cross_field(cfg)
    return cfg


def load_config(path: str | None, overrides: dict[str, Any] | None = None, from_run: bool = True) -> Config:
    """The edge of the program: file + overrides → validated `Config` (`from_run`: see `validate`)."""
    raw = read_yaml(path) if path else {}
    for dotted, value in (overrides or {}).items():
        apply_override(raw, dotted, value)
    return validate(raw, from_run)


def to_dict(cfg: Config) -> dict[str, Any]:
    """Plain-data view of a config, with tuples as lists, for YAML and logs."""
    return _listify(dataclasses.asdict(cfg))


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def _listify(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _listify(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [_listify(v) for v in node]
    return node


def _check_cross_field(cfg: Config) -> None:
    check_model_dir(cfg.model_dir)
    d = cfg.data
    byte_size(d.cache_limit)
    if d.min_crop_area > d.max_crop_area:
        raise UserError("data.min_crop_area must not exceed data.max_crop_area")
    if len(d.mean) != 3 or len(d.std) != 3:
        raise UserError("data.mean and data.std must each have 3 values (R, G, B)")
    _check_progressive(d)
    check_schedule_rules(cfg)   # schedule and LR-scaling fields against cfg.rules, the rule set's defaults filled in
    first, last = cfg.log.profile_steps
    if (first or last) and not 0 < first <= last:
        raise UserError("log.profile_steps must be [first, last] with 0 < first <= last, or [0, 0] for off")
    if cfg.model.sync_bn and cfg.train.jit_compile is True:
        raise UserError("model.sync_bn needs train.jit_compile: false (its all-reduce cannot run inside the "
                        "per-replica XLA step)")
    t = cfg.train
    if t.global_batch and t.global_batch % t.grad_accum_steps:
        raise UserError(f"train.global_batch ({t.global_batch}) is not a multiple of train.grad_accum_steps "
                        f"({t.grad_accum_steps})")
    _check_ema_rules(cfg)
    if cfg.optimizer.decay_bias is not None and cfg.optimizer.decay_norm_and_bias:
        raise UserError("optimizer.decay_bias applies with optimizer.decay_norm_and_bias: false (with true every "
                        "variable is decayed)")
    if cfg.train.best_metric.startswith("val_ema_") and not cfg.optimizer.ema_decay:
        raise UserError(f"train.best_metric {cfg.train.best_metric} needs optimizer.ema_decay above 0")
    if cfg.train.best_metric.startswith("val_ema_") and cfg.train.validate == "never":
        raise UserError(f"train.best_metric {cfg.train.best_metric} is measured by the workers' validation, which "
                        f"train.validate: never skips (an evaluator measures the weights, not their moving average)")
    if cfg.train.bce_target_threshold is not None and cfg.train.loss != "bce":
        raise UserError("train.bce_target_threshold applies to train.loss: bce only")
    _check_fine_tuning(cfg)
    _check_teacher(cfg)
    if cfg.model.init_exclude and not cfg.model.init_from:
        raise UserError("model.init_exclude needs model.init_from (the weights it leaves out)")
    _check_augment(cfg.augment)
    if d.val_fraction and d.format != "image_folder":
        raise UserError(f"data.val_fraction splits one tree of class folders (data.format image_folder), not "
                        f"data.format {d.format}'s splits")
    if d.label_key and d.format != "wds":
        raise UserError(f"data.label_key names a field of WebDataset samples' .json (data.format wds), not of "
                        f"data.format {d.format}'s labels")
    if d.service_address:
        _check_service(cfg)
    if d.decoder == "dali":
        _check_dali(cfg)
    if cfg.train.deterministic:
        d.deterministic = True  # seeded crops are part of a deterministic run


def _check_teacher(cfg: Config) -> None:
    """A distillation needs its teacher and its weights; a teacher's fields without a distillation are a mistake."""
    t = cfg.train.teacher
    if t.distillation == "none":
        if t.model or t.init_from:
            raise UserError("train.teacher.model and train.teacher.init_from need train.teacher.distillation "
                            "soft or hard")
        return
    if not t.model or not t.init_from:
        raise UserError(f"train.teacher.distillation {t.distillation} needs train.teacher.model and "
                        f"train.teacher.init_from (the teacher's weights)")
    if len(t.mean) not in (0, 3) or len(t.std) not in (0, 3):
        raise UserError("train.teacher.mean and train.teacher.std must each have 3 values (R, G, B) or none")


# EMA fields that only one rule set has: (field, the rules that have it).
_EMA_RULE_FIELDS = (("ema_warmup", "timm"), ("ema_every_steps", "torchvision"))


def _check_ema_rules(cfg: Config) -> None:
    """An EMA setting of one trainer's rules, set under another's: one line naming both."""
    for field, rules in _EMA_RULE_FIELDS:
        if getattr(cfg.optimizer, field) and cfg.rules != rules:
            raise UserError(f"optimizer.{field} is a rules: {rules} setting (this config has rules: {cfg.rules})")


def _check_fine_tuning(cfg: Config) -> None:
    """Freezing that can happen; what needs the model itself (patterns, a head) is checked in tfdp/optim/finetune.py."""
    t = cfg.train
    if t.freeze_epochs and not t.freeze:
        raise UserError("train.freeze_epochs needs train.freeze (the layers to keep frozen for those epochs)")
    if t.freeze_epochs and t.freeze_epochs >= t.epochs:
        raise UserError(f"train.freeze_epochs ({t.freeze_epochs}) must be smaller than train.epochs ({t.epochs}); "
                        f"0 keeps train.freeze for the whole run")
    if any(not p.strip() for p in t.freeze):
        raise UserError("train.freeze: an empty pattern names no layer")


def _check_progressive(d: DataConfig) -> None:
    """A ramp that rises (or stays) from progressive_min_size to image_size, over epochs in order, and whose
    rounding (FFCV's, to multiples of progressive_step) leaves every epoch a real image size."""
    if not d.progressive_min_size:
        if d.progressive_start_epoch or d.progressive_end_epoch:
            raise UserError("data.progressive_start_epoch and data.progressive_end_epoch need "
                            "data.progressive_min_size above 0 (progressive resizing is off)")
        return
    if d.progressive_min_size > d.image_size:
        raise UserError(f"data.progressive_min_size ({d.progressive_min_size}) must not exceed data.image_size "
                        f"({d.image_size}): the training size rises to data.image_size")
    if d.progressive_start_epoch > d.progressive_end_epoch:
        raise UserError(f"data.progressive_start_epoch ({d.progressive_start_epoch}) must not exceed "
                        f"data.progressive_end_epoch ({d.progressive_end_epoch})")
    sizes = ramp_sizes(d)
    if min(sizes) < 1:
        raise UserError(f"data.progressive_step ({d.progressive_step}) rounds the ramp from data.progressive_min_size "
                        f"({d.progressive_min_size}) to data.image_size ({d.image_size}) down to 0 px at epoch "
                        f"{sizes.index(min(sizes)) + 1}; use a smaller step")


def _check_augment(a: AugmentConfig) -> None:
    if a.rand_augment:
        try:
            parse_rand_augment(a.rand_augment)
        except ValueError as e:
            raise UserError(f"config field 'augment.rand_augment': {e} (got {a.rand_augment!r})") from None
    elif a.rand_augment_ops:
        raise UserError("augment.rand_augment_ops needs augment.rand_augment (e.g. rand-m9-mstd0.5)")
    for name in a.rand_augment_ops:
        if name not in RAND_AUGMENT_OP_NAMES:
            close = difflib.get_close_matches(name, RAND_AUGMENT_OP_NAMES, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f" (known: {', '.join(RAND_AUGMENT_OP_NAMES)})"
            raise UserError(f"config field 'augment.rand_augment_ops': unknown op '{name}'{hint}")
    if a.rand_augment and a.trivial_augment:
        raise UserError("augment.rand_augment and augment.trivial_augment exclude each other (each is a whole "
                        "per-image op policy); keep one")
    if a.erasing_area[0] > a.erasing_area[1]:
        raise UserError("augment.erasing_area must be [min, max] with min <= max")


def _check_dali(cfg: Config) -> None:
    """What DALI cannot promise or do, refused before anything starts (docs/data.md, decoders)."""
    d = cfg.data
    if cfg.train.deterministic or d.deterministic:
        which = "train.deterministic" if cfg.train.deterministic else "data.deterministic"
        raise UserError(f"{which} cannot use data.decoder: dali: DALI draws its own crop windows, not tfdp's "
                        f"seeded ones, so runs would not repeat (use data.decoder: tf)")
    if d.format == "synthetic":
        raise UserError("data.decoder: dali has nothing to decode in data.format: synthetic (use data.decoder: tf)")
    if d.eval_interpolation != "fast":
        raise UserError(f"data.decoder: dali crops evaluation images as data.eval_interpolation fast, not "
                        f"{d.eval_interpolation} (use data.decoder: tf, or data.eval_interpolation: fast)")


def _check_service(cfg: Config) -> None:
    """A dispatcher address TensorFlow can parse (its own error comes late, as a traceback), and no
    promise of a replayable input, which the service cannot keep (see tfdp/data/service/client.py)."""
    address = cfg.data.service_address
    protocol, _, rest = address.rpartition("://")
    host, _, port = rest.rpartition(":")
    if protocol not in ("", "grpc") or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"data.service_address must be grpc://HOST:PORT (a tf.data service dispatcher), "
                        f"got {address!r}")
    if cfg.train.deterministic:
        raise UserError("train.deterministic cannot train through the tf.data service (data.service_address): "
                        "the service decides which worker reads what, so the input cannot be replayed")
    if cfg.data.format in ("wds", "parquet"):
        raise UserError(f"data.format {cfg.data.format} cannot be read through the tf.data service "
                        f"(data.service_address): its workers would read tar shards the trainer indexes; read it "
                        f"without the service")
    if cfg.data.repeated_augmentation > 1:
        raise UserError("data.repeated_augmentation needs the local input pipeline: through the tf.data service "
                        "(data.service_address) the copies of an image could not be dealt to different replicas")


AUTO_SIZE = "auto"
# Decimal units as disks are sold, binary ones as `df -h` counts; case does not matter.
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def byte_size(value: int | str, field: str = "data.cache_limit") -> int | None:
    """A size such as "20GB", "500 MB", "64GiB" or 1000000 in bytes; None for "auto", which only the
    cache's own disk can settle. Anything else is a one-line error naming `field`."""
    if isinstance(value, str) and value.strip().lower() == AUTO_SIZE:
        return None
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(value))
    unit = match and SIZE_UNITS.get(match.group(2).upper())
    if not unit or float(match.group(1)) * unit < 1:
        raise UserError(f"config field '{field}': expected a size such as 20GB, 500MB or 64GiB, a number of "
                        f"bytes, or {AUTO_SIZE} (got {value!r})")
    return int(float(match.group(1)) * unit)


def _section_at(loc: tuple[str, ...]) -> type | None:
    """The dataclass that holds the field at `loc`, to list its valid keys."""
    node: Any = Config
    for key in loc[:-1]:
        node = typing.get_type_hints(node).get(key)
        if not dataclasses.is_dataclass(node):
            return None
    return node


def _field_path(loc: tuple[str, ...]) -> tuple[str, ...]:
    """An error's location without pydantic's union branch tags. A union field fails once per branch, each under
    its own tag (`model.bn_momentum.constrained-float`, `train.jit_compile.literal['auto']`): not the user's words."""
    node: Any = Config
    for depth, key in enumerate(loc):
        hints = typing.get_type_hints(node) if dataclasses.is_dataclass(node) else {}
        if key not in hints:
            return loc
        node = hints[key]
        if _tagged_union(node):
            return loc[:depth + 1] + loc[depth + 2:]
    return loc


def _tagged_union(hint: Any) -> bool:
    """Whether pydantic tags this field's errors by branch: a union of two or more types besides None."""
    if typing.get_origin(hint) is typing.Annotated:
        hint = typing.get_args(hint)[0]
    if typing.get_origin(hint) not in (typing.Union, types.UnionType):
        return False
    return sum(arg is not type(None) for arg in typing.get_args(hint)) >= 2


def _describe_first(errors: list[dict[str, Any]]) -> str:
    """The first problem, in one line. A value no branch of a union field takes fails once per branch: those
    failures are one problem, whose line names the field once and says what each branch wanted ("input should be
    less than 1, or input should be 'auto'")."""
    first = errors[0]
    field = _field_path(tuple(str(part) for part in first["loc"]))
    same = [e for e in errors if _field_path(tuple(str(p) for p in e["loc"])) == field]
    if len(same) == 1:
        return _describe({**first, "loc": field})
    wanted = ", or ".join(dict.fromkeys(e["msg"].lower() for e in same))
    return _describe({**first, "loc": field, "msg": wanted})


def _describe(err: dict[str, Any]) -> str:
    loc = tuple(str(part) for part in err["loc"])
    where = ".".join(loc) or "config"
    kind = err["type"]
    if kind == "unexpected_keyword_argument":
        section = _section_at(loc)
        valid = [f.name for f in dataclasses.fields(section)] if section else []
        close = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.5)
        hint = f"; did you mean '{'.'.join(loc[:-1] + (close[0],))}'?" if close else ""
        listed = f" (valid keys: {', '.join(valid)})" if valid and not close else ""
        return f"unknown config key '{where}'{hint}{listed}"
    if kind == "dataclass_type":
        return f"config section '{where}' must be a mapping of keys, got {err.get('input')!r}"
    return f"config field '{where}': {err['msg'].lower()} (got {err.get('input')!r})"

#!/usr/bin/env bash
# A short GPU lease, step 1 (here, with network): TensorFlow 2.21 (CUDA 12 build) and NVIDIA DALI 2.4 with its
# TensorFlow plugin, installed for Python 3.12 into two folders, xz-compressed and cut into 60 MiB pieces for a
# GPU host with Python 3.12, no TensorFlow and no network (../shared/gpu/README.md describes such a host).
#   usage: benchmarks/gpu_lease/pack.sh OUTDIR      (OUTDIR git-ignored, e.g. .gpu; needs .venv with the plugin)
# OUTDIR gets p00, p01, ...: TensorFlow's archive, then DALI's, one byte stream (bg.sh's sizes and hashes are
# printed at the end: put them in bg.sh). Each device call carries one piece (`carry: [".gpu/p03"]`), while
# bg.sh, started in the first call, writes the JPEGs and unpacks each archive once its pieces are in.
set -euo pipefail
out=${1:?usage: pack.sh OUTDIR}
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d)
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d "$@"; }
put() { python3 -m pip install -q --no-deps --no-compile --only-binary=:all: --python-version 3.12 --implementation cp \
        "${plat[@]}" --target "$1" "$2"/*.whl; }
get "$work/whl-tf" tensorflow==2.21.0 nvidia-cublas-cu12==12.5.3.2 nvidia-cuda-cupti-cu12==12.5.82 \
  nvidia-cuda-nvcc-cu12==12.5.82 nvidia-cuda-nvrtc-cu12==12.5.82 nvidia-cuda-runtime-cu12==12.5.82 \
  nvidia-nvjitlink-cu12==12.5.82 keras==3.15.1 namex==0.1.0 optree==0.20.0 pydantic==2.14.3 pydantic_core==2.50.4 \
  annotated-types==0.8.0 typing-inspection==0.4.5 astunparse==1.6.3 gast==0.7.0 google-pasta==0.2.0 \
  termcolor==3.3.0 protobuf==7.36.2 ml_dtypes==0.6.0 tensorboard==2.21.0 absl-py==2.5.1 h5py==3.14.0 \
  google-crc32c==1.9.0   # the converter's checksums (pipelines.convert_imagenet imports no TensorFlow)
# DALI and what its mixed JPEG decoder loads (nvImageCodec, nvJPEG); nvCOMP, nvJPEG2000 and nvTIFF are left out
get "$work/whl-dali" nvidia-dali-cuda120==2.4.0 "nvidia-nvimgcodec-cu12>=0.9.0,<0.10.0" nvidia-nvjpeg-cu12 nvtx \
  makefun "libcst~=1.8"
put "$work/site-tf" "$work/whl-tf"
put "$work/site-dali" "$work/whl-dali"
rm -rf "$work/site-tf/tensorflow/include" "$work"/site-*/bin   # headers (custom-op builds only), entry scripts
# The TensorFlow plugin: the one pip built here against TensorFlow 2.21 (the .so does not depend on Python's
# version), and DALI's own prebuilt one as the loader's second choice.
plugin=$(ls -d "$repo"/.venv/lib/python3*/site-packages/nvidia/dali_tf_plugin)
mkdir -p "$work/site-dali/nvidia/dali_tf_plugin"
cp "$plugin"/{__init__.py,dali_tf_plugin.py,libdali_tf_current.so} "$work/site-dali/nvidia/dali_tf_plugin/"
(cd "$work" && python3 -m pip download -q --no-deps --no-binary=:all: nvidia-dali-tf-plugin-cuda120==2.4.0 -d sdist \
  && tar xzf sdist/*.tar.gz && cp nvidia_dali_tf_plugin_cuda120-2.4.0/prebuilt/libdali_tf_2_21.so site-dali/nvidia/dali_tf_plugin/)
# TCMalloc, which every tfdp process preloads where the system has it (tfdp/startup/allocator.py); a PyTorch
# image's host may not: without it the host CPU figures include glibc's page faults on every large buffer
mkdir -p "$work/site-dali/tcmalloc" && cp /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 "$work/site-dali/tcmalloc/"
(cd "$work" && tar -cf - site-tf | xz -T0 -6 > tf.tar.xz && tar -cf - site-dali | xz -T0 -6 > dali.tar.xz)
mkdir -p "$out" && rm -f "$out"/p??
cat "$work/tf.tar.xz" "$work/dali.tar.xz" | split -b 60M -d -a 2 - "$out/p"
echo "TF_BYTES=$(stat -c %s "$work/tf.tar.xz") TF_SHA=$(sha256sum < "$work/tf.tar.xz" | cut -d' ' -f1)"
echo "DALI_SHA=$(sha256sum < "$work/dali.tar.xz" | cut -d' ' -f1) pieces: $(ls "$out" | grep -c '^p[0-9][0-9]$')"
rm -rf "$work"

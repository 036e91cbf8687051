"""tfdp: data-parallel training of image classifiers with TensorFlow and Keras 3."""

import os as _os

# Both must be set before TensorFlow is first imported, so they live here, at
# the top of the package. TensorFlow enables its oneDNN CPU kernels only on some
# CPUs; on others (AMD EPYC, docs/benchmarks.md) convolution training runs several times slower
# without them. The C++ log noise drowns tfdp's one-line errors. The user's own
# environment wins in both cases.
_os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
TF_LOG_LEVEL_DEFAULTED = "TF_CPP_MIN_LOG_LEVEL" not in _os.environ  # --verbosity may lift ours (tfdp.startup.console)
_os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

__version__ = "0.1.0"

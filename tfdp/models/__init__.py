"""The model zoo: importing the model files fills the registry (`tfdp.models.registry`).

Re-exports the public names, so `from tfdp.models import build_model` etc. work.
"""

from tfdp.models import convnext, d2l, eva, keras_apps, regnet, resnet, simple, squeezenet, swin, vgg, vit  # noqa: F401
from tfdp.models.batch_norm import use_batch_norm_rule
from tfdp.models.build import Standardize, build_model
from tfdp.models.registry import DEFAULT_DROPOUT, FIXED_SIZE, MIN_INPUT_SIZE, MODELS, check_model_name, register

__all__ = ["DEFAULT_DROPOUT", "FIXED_SIZE", "MIN_INPUT_SIZE", "MODELS", "Standardize", "build_model",
           "check_model_name", "register", "use_batch_norm_rule"]

"""ImageNet's per-channel pixel statistics, in a module of their own: the config's defaults and the weight
readers' (tfdp.config.pretrained) both need them, and pretrained is imported by the config package."""

# The mean and standard deviation in 0..255 pixel units (timm's IMAGENET_DEFAULT_MEAN/STD times 255):
# data.mean/data.std's defaults, torch-layout weights' preprocessing, and the augmentations' when called without them.
IMAGENET_MEAN = (123.675, 116.28, 103.53)
IMAGENET_STD = (58.395, 57.12, 57.375)

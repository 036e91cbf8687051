"""Layers that compute what a Keras layer computes, in a form every export runtime takes.

Keras' TensorFlow backend runs a grouped convolution (`Conv2D(groups>1)`,
ResNeXt's 3x3 convolutions) inside an XLA-compiled `tf.function`, because
TensorFlow's own grouped convolution is broken on CPU without XLA. tf2onnx
cannot inline that function (it leaves a `StatefulPartitionedCall` that
onnxruntime refuses), and TF Serving builds without XLA cannot run it.
`SplitGroupsConv2D` computes the same convolution as one ordinary convolution
per group on the input's and the kernel's channel slices, concatenated: plain
Split/Conv/Concat ops that ONNX, LiteRT and TensorFlow all run. It keeps
Conv2D's variables and their shape (`(k, k, cin / groups, cout)`), so a
checkpoint or torchvision weights load into either layer alike.

Training keeps Keras' grouped convolution (one fused kernel on a GPU, where
`groups` convolutions would be slower); `split_grouped_convolutions` swaps
the layer in only for the network that is exported.
"""

from __future__ import annotations

import keras


@keras.saving.register_keras_serializable(package="tfdp")
class SplitGroupsConv2D(keras.layers.Conv2D):
    """Conv2D whose grouped convolution runs as `groups` ordinary convolutions on channel slices."""

    def convolution_op(self, inputs, kernel):
        if self.groups == 1:
            return super().convolution_op(inputs, kernel)
        axis = -1 if self.data_format == "channels_last" else 1
        parts = zip(keras.ops.split(inputs, self.groups, axis=axis), keras.ops.split(kernel, self.groups, axis=-1))
        return keras.ops.concatenate(
            [super(SplitGroupsConv2D, self).convolution_op(x, k) for x, k in parts], axis=axis)


def split_grouped_convolutions(layer: keras.layers.Layer) -> keras.layers.Layer:
    """`layer` with every grouped Conv2D in it (at any depth of nested functional models) replaced by a
    `SplitGroupsConv2D` holding a copy of its weights; every other layer is the same object (its weights shared).
    A layer without grouped convolutions comes back as it is."""
    if isinstance(layer, keras.layers.Conv2D) and layer.groups > 1 and not isinstance(layer, SplitGroupsConv2D):
        split = SplitGroupsConv2D.from_config(layer.get_config())
        split.build(layer.input.shape)
        split.set_weights(layer.get_weights())
        return split
    if isinstance(layer, keras.Model) and _has_grouped_convolution(layer):
        return keras.models.clone_model(layer, clone_function=split_grouped_convolutions)
    return layer


def _has_grouped_convolution(model: keras.Model) -> bool:
    return any((isinstance(layer, keras.layers.Conv2D) and layer.groups > 1)
               or (isinstance(layer, keras.Model) and _has_grouped_convolution(layer)) for layer in model.layers)

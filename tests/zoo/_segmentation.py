"""Semantic segmentation entries of the zoo: per-pixel class logits at a dynamic image
size, with the upsampling sized by the input at run time (torchvision's FCN
interpolates to the image's own size, SegFormer's decoder to its first stage's).
Small widths, random weights, 10 classes."""

from __future__ import annotations

import torch
import transformers as hf

from tests.zoo._vision import CLASSES, EXPORT_POINT, POINTS
from tests.zoo._zoo import Built, ZooEntry, dim, generator


class _Logits(torch.nn.Module):
    """The model's logits tensor: torchvision's dict output under "out", HF's `.logits`."""

    def __init__(self, model: torch.nn.Module, key: str | None) -> None:
        super().__init__()
        self.model = model
        self.key = key

    def forward(self, images):
        out = self.model(images)
        return out[self.key] if self.key is not None else out.logits


def _fcn() -> torch.nn.Module:
    # FCN's head on a one-block-per-stage ResNet (torchvision's fcn_resnet50 has the same
    # head on ResNet-50 with dilations); bilinear upsampling back to the image's size.
    from torchvision.models._utils import IntermediateLayerGetter
    from torchvision.models.resnet import BasicBlock, ResNet
    from torchvision.models.segmentation.fcn import FCN, FCNHead

    backbone = IntermediateLayerGetter(ResNet(BasicBlock, [1, 1, 1, 1]), {"layer4": "out"})
    return _Logits(FCN(backbone, FCNHead(512, CLASSES)), "out")


def _segformer() -> torch.nn.Module:
    # Two Mix Transformer stages (overlapping patch embeddings, attention over a spatially
    # reduced sequence, Mix-FFN's depthwise convolution) and the all-MLP decoder.
    config = hf.SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                                hidden_sizes=[16, 32], patch_sizes=[7, 3], strides=[4, 2],
                                num_attention_heads=[1, 2], mlp_ratios=[2, 2],
                                decoder_hidden_size=32, num_labels=CLASSES)
    return _Logits(hf.SegformerForSemanticSegmentation(config), None)


def _segmenter(name: str, library: str, make) -> ZooEntry:
    def build() -> Built:
        torch.manual_seed(0)
        module = make().eval()
        shape = {0: dim("batch", 1, 8), 2: dim("height", 64, 160), 3: dim("width", 64, 160)}
        return Built(module, (shape,), lambda point, seed: (torch.randn(
            point["batch"], 3, point["height"], point["width"], generator=generator(seed)),))

    return ZooEntry(name, library, build, EXPORT_POINT, POINTS,
                    note="segmentation: logits per pixel, upsampled to a size taken from "
                    "the input at run time")


ENTRIES = (
    _segmenter("fcn", "torchvision", _fcn),
    _segmenter("segformer", "transformers", _segformer),
)

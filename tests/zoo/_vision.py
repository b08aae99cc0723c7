"""Convolutional image classifiers of the zoo, from torchvision and timm: small widths,
random weights, 10 classes. All are fully convolutional up to a global pooling, so
the image's height and width are dynamic along with the batch."""

from __future__ import annotations

import timm
import torch
import torchvision

from tests.zoo._zoo import Built, ZooEntry, dim, generator

CLASSES = 10
# At 32 px a stride-32 net's last feature map is 1x1, and torch.export specializes a
# dim it sees as 1 (broadcasting), so images start at 64 px (a 2x2 last map).
POINTS = ({"batch": 1, "height": 72, "width": 72}, {"batch": 3, "height": 96, "width": 80},
          {"batch": 2, "height": 67, "width": 101})
EXPORT_POINT = {"batch": 2, "height": 64, "width": 64}


def _convnet(name: str, library: str, make, note: str = "", static_width: bool = False):
    def build() -> Built:
        torch.manual_seed(0)
        module = make().eval()
        shape = {0: dim("batch", 1, 8), 2: dim("height", 64, 160)}
        if not static_width:
            shape[3] = dim("width", 64, 160)
        return Built(module, (shape,), lambda point, seed: (torch.randn(
            point["batch"], 3, point["height"], point.get("width", 64),
            generator=generator(seed)),))

    points = tuple({k: v for k, v in p.items() if k != "width" or not static_width}
                   for p in (EXPORT_POINT, *POINTS))
    return ZooEntry(name, library, build, points[0], points[1:], note=note)


# Note [Derived resolution]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# The entries below declare their resolution as torch.export's docs tell a user to
# declare a CNN's: a multiple of the net's total stride, `32 * Dim(...)` (Note [Derived
# dims] in dynvm.vm.input_check). Issue 30 found VGG, SqueezeNet, ShuffleNet, GoogLeNet
# and GhostNet running only at a static resolution before dynvm took such dims. A point
# names the multiples: {"kh": 3} is 96 px high.
DERIVED_POINTS = ({"batch": 1, "kh": 3, "kw": 2}, {"batch": 3, "kh": 2, "kw": 4},
                  {"batch": 2, "kh": 5, "kw": 3})
DERIVED_EXPORT_POINT = {"batch": 2, "kh": 2, "kw": 2}


def _derived_convnet(name: str, library: str, make, note: str = ""):
    def build() -> Built:
        torch.manual_seed(0)
        module = make().eval()
        shape = {0: dim("batch", 1, 8), 2: 32 * dim("kh", 1, 5), 3: 32 * dim("kw", 1, 5)}
        return Built(module, (shape,), lambda point, seed: (torch.randn(
            point["batch"], 3, 32 * point["kh"], 32 * point["kw"],
            generator=generator(seed)),))

    return ZooEntry(name, library, build, DERIVED_EXPORT_POINT, DERIVED_POINTS,
                    note=note or "resolution 32*k (Note [Derived resolution])")


def _vgg():
    # VGG-11's layout (conv stages, 2x2 max pools, adaptive 7x7 pool, two hidden fully
    # connected layers) at 8..64 channels and a 64-wide classifier.
    from torchvision.models.vgg import VGG, make_layers

    model = VGG(make_layers([8, "M", 16, "M", 32, "M", 32, "M", 64, "M"], batch_norm=True),
                num_classes=CLASSES)
    model.classifier = torch.nn.Sequential(
        torch.nn.Linear(64 * 7 * 7, 64), torch.nn.ReLU(True), torch.nn.Dropout(),
        torch.nn.Linear(64, 64), torch.nn.ReLU(True), torch.nn.Dropout(),
        torch.nn.Linear(64, CLASSES))
    return model


def _googlenet():
    # GoogLeNet's stages and inception blocks (1x1, 3x3, 5x5 and pool branches, ceil-mode
    # pools) at an eighth of each width: every width it names divides by 8. Its `blocks`
    # argument is torchvision's own hook for the convolution and inception modules.
    from torchvision.models.googlenet import BasicConv2d, GoogLeNet, Inception

    def conv(in_channels, out_channels, **options):
        return BasicConv2d(in_channels if in_channels == 3 else in_channels // 8,
                           out_channels // 8, **options)

    def inception(in_channels, *branches):
        return Inception(in_channels // 8, *(width // 8 for width in branches))

    model = GoogLeNet(num_classes=CLASSES, aux_logits=False, init_weights=False,
                      blocks=[conv, inception, None])
    model.fc = torch.nn.Linear(1024 // 8, CLASSES)
    return model


def _resnet():
    from torchvision.models.resnet import BasicBlock, ResNet

    return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=CLASSES)


def _mobilenet_v3():
    # mobilenet_v3_small's block kinds (squeeze-excite, hardswish, strides to 32) at a
    # third of its depth.
    from torchvision.models.mobilenetv3 import InvertedResidualConfig as Block
    from torchvision.models.mobilenetv3 import MobileNetV3

    blocks = [Block(16, 3, 16, 16, True, "RE", 2, 1, 1.0),
              Block(16, 3, 48, 24, False, "RE", 2, 1, 1.0),
              Block(24, 5, 64, 32, True, "HS", 2, 1, 1.0),
              Block(32, 5, 96, 48, True, "HS", 2, 1, 1.0)]
    return MobileNetV3(blocks, last_channel=128, num_classes=CLASSES)


def _efficientnet():
    # efficientnet_b0's MBConv blocks (expansion, squeeze-excite, stochastic depth, SiLU)
    # one per stage, five stages.
    from torchvision.models.efficientnet import EfficientNet, MBConvConfig

    stages = [MBConvConfig(1, 3, 1, 16, 16, 1), MBConvConfig(4, 3, 2, 16, 24, 1),
              MBConvConfig(4, 5, 2, 24, 32, 1), MBConvConfig(4, 3, 2, 32, 48, 1),
              MBConvConfig(4, 5, 2, 48, 64, 1)]
    return EfficientNet(stages, dropout=0.2, num_classes=CLASSES)


def _densenet():
    return torchvision.models.DenseNet(growth_rate=8, block_config=(2, 2, 2),
                                       num_init_features=16, bn_size=2, num_classes=CLASSES)


ENTRIES = (
    _convnet("resnet", "torchvision", _resnet),
    _convnet("mobilenet-v3", "torchvision", _mobilenet_v3),
    _convnet("efficientnet", "torchvision", _efficientnet),
    _convnet("densenet", "torchvision", _densenet),
    _convnet("convnext", "timm",
             lambda: timm.create_model("convnext_atto", pretrained=False, num_classes=CLASSES),
             note="width static (64): with width declared as a range torch.export "
             "rejects its own guard 1 % (C*(W//4)) != 0, which it cannot prove (true for "
             "W >= 4); Dim.AUTO exports but dynvm's frontend then fails on torch's "
             "unbounded int_oo (vm/frontend/dims.py _bounds)", static_width=True),
    _convnet("regnet", "timm",
             lambda: timm.create_model("regnetx_002", pretrained=False, num_classes=CLASSES)),
    _derived_convnet("vgg", "torchvision", _vgg),
    _derived_convnet("squeezenet", "torchvision",
                     lambda: torchvision.models.squeezenet1_1(num_classes=CLASSES)),
    _derived_convnet("shufflenet-v2", "torchvision",
                     lambda: torchvision.models.ShuffleNetV2([1, 1, 1], [8, 16, 32, 64, 128],
                                                             num_classes=CLASSES)),
    _derived_convnet("googlenet", "torchvision", _googlenet,
                     note="resolution 32*k (Note [Derived resolution]); an eighth of the "
                     "released widths, through GoogLeNet's own blocks argument"),
    _derived_convnet("ghostnet", "timm",
                     lambda: timm.create_model("ghostnet_050", pretrained=False,
                                               num_classes=CLASSES)),
    _derived_convnet("resnet-32k", "torchvision", _resnet,
                     note="the zoo's resnet with its resolution declared as 32*k "
                     "(Note [Derived resolution]) instead of a free range"),
)

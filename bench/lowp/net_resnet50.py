"""A ResNet-50-like classifier (7 x 7 stem, max pool, bottleneck stages of 3, 4, 6 and 3 blocks with
batch norm in eval mode, global average pool, linear head): 32 images of 224 x 224; output the 1000 logits.
About 0.26 TFLOP per forward; the largest tensors are the 32 x 256 x 56 x 56 stage-1 activations."""

import torch
import torch.nn as nn

VARIANTS = ("bf16", "fp16", "autocast-bf16")
BATCH, IMAGE, WIDTH, BLOCKS, CLASSES = 32, 224, 64, (3, 4, 6, 3), 1000
SMALL = {"BATCH": 2, "IMAGE": 32, "WIDTH": 8, "BLOCKS": (1, 1, 1, 1), "CLASSES": 10}


def _conv_bn(cin, cout, kernel, stride=1):
    bn = nn.BatchNorm2d(cout)
    # Statistics as a trained network has them, so eval-mode batch norm is not the identity.
    bn.running_mean.normal_(0, 0.1)
    bn.running_var.uniform_(0.5, 1.5)
    bn.weight.data.uniform_(0.5, 1.0)
    bn.bias.data.normal_(0, 0.1)
    return nn.Sequential(nn.Conv2d(cin, cout, kernel, stride, kernel // 2, bias=False), bn)


class _Bottleneck(nn.Module):
    def __init__(self, cin, width, stride):
        super().__init__()
        cout = 4 * width
        self.body = nn.Sequential(_conv_bn(cin, width, 1), nn.ReLU(inplace=True), _conv_bn(width, width, 3, stride),
                                  nn.ReLU(inplace=True), _conv_bn(width, cout, 1))
        self.skip = _conv_bn(cin, cout, 1, stride) if stride != 1 or cin != cout else nn.Identity()
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.relu(self.body(x) + self.skip(x))


class Model(nn.Module):
    def __init__(self, width, blocks, classes):
        super().__init__()
        layers = [_conv_bn(3, width, 7, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
        cin = width
        for stage, count in enumerate(blocks):
            w = width * 2 ** stage
            for i in range(count):
                layers.append(_Bottleneck(cin, w, 2 if i == 0 and stage > 0 else 1))
                cin = 4 * w
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(cin, classes)

    def forward(self, images):
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(self.features(images), 1), 1))


def get_inputs():
    return [torch.randn(BATCH, 3, IMAGE, IMAGE)]


def get_init_inputs():
    return [WIDTH, BLOCKS, CLASSES]

"""LeNet (LeCun et al. 1998) as Dive into Deep Learning (d2l) trains it: conv 20@3x3,
avgpool 2, conv 50@5x5, avgpool 2, fc 128, fc 10.

Written with nn layers (ReLU after each conv and the first fc). Sized for 28x28 inputs (MNIST,
Fashion-MNIST: flatten = 50*5*5 = 1250) and accepts any input size via a lazily computed flatten
width (the 8x8 scikit-learn digits are upsampled to 28x28 by the data loader instead).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class LeNet(nn.Module):
    def __init__(self, num_classes: int = 10, image_size: int = 28):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 20, kernel_size=3)
        self.conv2 = nn.Conv2d(20, 50, kernel_size=5)
        side = ((image_size - 2) // 2 - 4) // 2      # 28 -> 26 -> 13 -> 9 -> 4
        self.fc1 = nn.Linear(50 * side * side, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.avg_pool2d(F.relu(self.conv1(x)), 2)   # (B, 20, 13, 13)
        x = F.avg_pool2d(F.relu(self.conv2(x)), 2)   # (B, 50, 4, 4)
        x = F.relu(self.fc1(x.flatten(1)))           # (B, 128)
        return self.fc2(x)                           # (B, 10)


def classification_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, targets)

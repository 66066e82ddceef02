"""Sparse layers and models; the same modules run single-process and spatially distributed.

    from sparsepipe_hpc.nn import SparseUNet
    net = SparseUNet(in_channels=3, num_classes=8, width=16, depth=3)
"""

from sparsepipe_hpc.nn.conv import ConvError, SparseConv3d, SparseInverseConv3d, SubMConv3d
from sparsepipe_hpc.nn.layers import (BatchNorm, GlobalPool, Linear, ReLU, commit_batchnorm,
                                      set_deferred_batchnorm)
from sparsepipe_hpc.nn.models import (MODELS, Block, BlockSequence, SparseResNet, SparseUNet,
                                      build_model)

__all__ = ["ConvError", "SubMConv3d", "SparseConv3d", "SparseInverseConv3d", "BatchNorm",
           "set_deferred_batchnorm", "commit_batchnorm",
           "GlobalPool", "Linear", "ReLU", "Block", "BlockSequence", "SparseResNet", "SparseUNet",
           "build_model", "MODELS"]

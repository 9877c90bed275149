"""Neural-network modules."""
from .module import Module
from .layers import Linear, LayerNorm, RMSNorm, Embedding, manual_seed
from .bitlinear import BitLinear, StoredBitLinear
from .bitconv import BitConv1d, BitConv2d
from .conv import Conv1d, Conv2d, Conv3d, BatchNorm1d, BatchNorm2d, MaxPool2d, AvgPool2d, Flatten
from .syncbn import SyncBatchNorm
from .ssm import SelectiveSSM, MambaBlock
from .stored import StoredTable, StoredEmbedding, StoredLinear, quantize_rows

__all__ = ["Module", "Linear", "LayerNorm", "RMSNorm", "Embedding", "manual_seed", "BitLinear", "StoredBitLinear",
           "SelectiveSSM", "MambaBlock", "StoredTable", "StoredEmbedding", "StoredLinear",
           "quantize_rows", "Conv1d", "Conv2d", "Conv3d", "BatchNorm1d", "BatchNorm2d", "MaxPool2d",
           "AvgPool2d", "Flatten", "SyncBatchNorm", "BitConv1d", "BitConv2d"]

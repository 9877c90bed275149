"""Neural-network modules."""
from .module import Module
from .layers import Linear, LayerNorm, RMSNorm, Embedding, manual_seed

__all__ = ["Module", "Linear", "LayerNorm", "RMSNorm", "Embedding", "manual_seed"]

"""The tiny hybrid model, one TP rank's shard: `HybridModel` and its layers."""

from transfer.engine.model.model import HybridModel

__all__ = ["HybridModel"]

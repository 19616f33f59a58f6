"""monarch-sky: fault-tolerant TorchTitan training with Monarch and TorchFT."""

__version__ = "0.1.0"

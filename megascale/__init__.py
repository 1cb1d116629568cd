"""megascale: fault-tolerant LLM pretraining on Megatron-Core, in the style of MegaScale (NSDI'24)."""

__version__ = "0.1.0"

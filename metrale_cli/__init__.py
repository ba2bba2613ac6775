"""metrale: audit, lay out, pack and benchmark multi-LoRA adapter pools."""

__version__ = "0.1.0"

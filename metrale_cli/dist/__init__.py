"""Tensor-parallel packing under torchrun and peer slot transfer over torch.distributed. Imports
image/ and earlier stages."""

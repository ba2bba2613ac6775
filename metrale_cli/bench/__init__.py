"""Benchmarks: packing, the delta and expert kernels, the slot manager. Imports every earlier
stage it measures."""

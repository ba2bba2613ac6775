"""The Python side of the CUDA kernels in the top-level kernels/: source loading, launch planning,
the CuPy launchers, the host harness and the torch reference. Imports pool/ and earlier stages."""

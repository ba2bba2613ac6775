"""What a serving engine does with adapters, answered offline from configs and headers.

One module per engine, each pinned to the engine version its rules were read from and tested
against (`vllm.py`: vLLM 0.32.0). Each takes the audit's `AdapterReport`s and the
`ModelConfig` and returns the same engine-neutral records (`verdict.py`), so a second engine
is a new module beside vLLM's, not a change to the audit. `metrale` is the project's own pool,
whose answers are the audit's and the layout's.
"""

from __future__ import annotations

ENGINES = ("metrale", "vllm")

"""Answering "what will vLLM do with these N adapters" two ways, in one run: `metrale inspect
--engine vllm` (offline, from configs and headers) against finding out with vLLM itself
(start the engine, load each adapter, ask it one token). The ratio is the result.

    .venv/bin/python scripts/bench_engine_vllm.py [--adapters N] [--runs R]

Needs the vLLM venv (`make vllm`). Builds a tiny Qwen3 with weights and N PEFT adapters
(tests/support/engine_cases.py), so the vLLM side is its floor: a real model only starts
slower. Prints one JSON record; docs/benchmarks.md keeps the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.engine_cases import PROMPT, make_case, write_model  # noqa: E402

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
RUNNER = ROOT / "tests" / "support" / "vllm_runner.py"
METRALE = Path(sys.executable).with_name("metrale")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--runs", type=int, default=5, help="metrale runs (best of)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = write_model("qwen3", root / "base")
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                   "down_proj"]
        # Every fourth adapter is one vLLM refuses (DoRA), so both sides answer a refusal too.
        cases = [make_case("qwen3", base, root, f"a{i}", r=8, lora_alpha=16,
                           target_modules=targets, use_dora=i % 4 == 3)
                 for i in range(args.adapters)]
        paths = [f"{c.name}={c.path}" for c in cases]
        best = float("inf")
        for _ in range(args.runs):
            started = time.perf_counter()
            done = subprocess.run([str(METRALE), "inspect", *paths, "--engine", "vllm",
                                   "--max-rank", "16", "--max-loras", "2", "--json"],
                                  capture_output=True, text=True)
            best = min(best, time.perf_counter() - started)
        verdicts = [a["engine"]["verdict"] for a in json.loads(done.stdout)["adapters"]]
        job = {"model": str(base), "engine": {"max_lora_rank": 16, "max_loras": 2,
                                              "dtype": "float32"},
               "prompt": PROMPT, "logprobs": 1,
               "adapters": [{"name": c.name, "path": str(c.path)} for c in cases]}
        (root / "job.json").write_text(json.dumps(job))
        started = time.perf_counter()
        subprocess.run([str(VLLM_PYTHON), str(RUNNER), str(root / "job.json"),
                        str(root / "report.json")], capture_output=True, check=True,
                       env={**os.environ})
        engine_s = time.perf_counter() - started
        report = json.loads((root / "report.json").read_text())
        outcomes = ["serves" if a["loaded"] else "refuses" for a in report["adapters"]]
    print(json.dumps({
        "adapters": args.adapters, "metrale_s": round(best, 3), "vllm_s": round(engine_s, 2),
        "vllm_start_s": report.get("start_s"), "ratio": round(engine_s / best, 1),
        "agree": verdicts == outcomes, "verdicts": verdicts, "cpus": os.cpu_count(),
        "load_average": round(os.getloadavg()[0], 2),
    }))


if __name__ == "__main__":
    main()

"""How long `metrale --help` takes against a bare `python -c "import typer, rich"`, measured in
one run: the best of N fresh interpreters of each, so the ratio is the result.

    .venv/bin/python scripts/bench_startup.py [--runs N]

Prints one JSON record. The aim is a ratio within 1.5 (docs/benchmarks.md: 1.40 and 1.42 in
two runs, 1.82 before the commands' annotations were evaluated at import, which
tests/test_help.py holds); tests/test_cli.py holds the import list that keeps it there (no
numpy, no torch, nothing typer and rich do not import).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def best_of(runs: int, *args: str) -> float:
    """The fastest of `runs` wall times of `python ARGS`, in seconds."""
    best = float("inf")
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run([sys.executable, *args], stdout=subprocess.DEVNULL, check=True)
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    runs = parser.parse_args().runs
    # Interleaved, so that a noisy neighbour slows both alike.
    python = typer_rich = help_ = float("inf")
    for _ in range(runs):
        python = min(python, best_of(1, "-c", "pass"))
        typer_rich = min(typer_rich, best_of(1, "-c", "import typer, rich"))
        help_ = min(help_, best_of(1, "-m", "metrale_cli", "--help"))
    print(json.dumps({
        "bench": "startup", "runs": runs, "python": sys.version.split()[0],
        "cpus": os.cpu_count(), "bare_python_s": python, "import_typer_rich_s": typer_rich,
        "metrale_help_s": help_, "help_vs_typer_rich": help_ / typer_rich,
    }))


if __name__ == "__main__":
    main()

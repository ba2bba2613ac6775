"""How long `read_trace` takes on a large trace, against a plain columnar CSV reader on the same
rows (NumPy's `loadtxt`; pandas' and pyarrow's CSV readers too where they are installed).

    .venv/bin/python scripts/bench_trace_read.py [--rows N] [--runs R] [--dir DIR]

Writes one seeded zipf(1.0) workload over 1,000 adapters (`GeneratorSpec`, seed 1) as CSV and as
JSON lines with `Workload.save` (`--dir` keeps them), then per run and per file a fresh process:
numba imported first (as `simulate` imports it for its replay), CPU seconds of `read_trace`
(`time.process_time`), its resident peak (`VmHWM`), then CPU seconds of each columnar reader
on the CSV's numeric columns in the same process. Validates before it reports: the columns
read equal the reference's (timestamps to the bit, tokens). One JSON record per run and file.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time
from pathlib import Path
import numpy as np
from metrale_cli.sim import core  # noqa: F401  numba, imported before the clock starts
from metrale_cli.sim.workload import read_trace

def peak_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) / 1024

trace, csv = Path(sys.argv[1]), sys.argv[2]
started = time.process_time()
w = read_trace(trace)
out = {"file": trace.name, "rows": w.requests, "read_trace_s": time.process_time() - started,
       "read_trace_peak_mib": peak_mib()}
started = time.process_time()
ref = np.loadtxt(csv, delimiter=",", skiprows=1, usecols=(0, 2, 3))
out["loadtxt_s"] = time.process_time() - started
order = np.argsort(ref[:, 0], kind="stable")
assert np.array_equal(ref[order, 0], w.arrival), "timestamps differ from loadtxt's"
assert np.array_equal(ref[order, 1], w.input_tokens), "input tokens differ"
for name, read in (("pandas", lambda: __import__("pandas").read_csv(
                        csv, usecols=["timestamp", "input_tokens", "output_tokens"])),
                   ("pyarrow", lambda: __import__("pyarrow.csv").csv.read_csv(csv))):
    try:
        __import__(name)
    except ImportError:
        continue
    started = time.process_time()
    read()
    out[f"{name}_s"] = time.process_time() - started
out["ratio_to_loadtxt"] = out["read_trace_s"] / out["loadtxt_s"]
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=None,
                        help="write (or reuse) the traces here; default a temporary directory")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        where = args.dir or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        csv, jsonl = where / f"t{args.rows}.csv", where / f"t{args.rows}.jsonl"
        if not (csv.exists() and jsonl.exists()):
            from metrale_cli.sim.workload import GeneratorSpec, generate

            w = generate(GeneratorSpec("zipf", args.rows, adapters=1000, zipf_s=1.0, seed=1))
            w.save(csv, force=True)
            w.save(jsonl, force=True)
        for run in range(args.runs):
            for trace in (csv, jsonl):
                done = subprocess.run([sys.executable, "-c", CHILD, str(trace), str(csv)],
                                      capture_output=True, text=True)
                if done.returncode:
                    raise SystemExit(f"{trace.name}: {done.stderr.strip()}")
                record = json.loads(done.stdout)
                record["run"] = run + 1
                print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()

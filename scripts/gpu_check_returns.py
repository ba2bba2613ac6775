"""What scripts/gpu_check.sh hands back from a lent device, which returns at most 8 files from
its output folder (16 MiB each, 64 MiB in all, two folders deep): two files in OUT_DIR, both
rewritten atomically after every step, so that a run cut short returns what it finished.

- ARCHIVE (gpu-check.tar.gz): every file the steps wrote in the work folder (NAME.log,
  NAME.json, pytest's XML, JSON lines, reports), flat; should it pass 15 MiB, the logs are cut
  to their last 2 MiB first.
- summary.json: each step's status, rc, seconds, budget and key figures (pytest's counts; the
  records', targets missed and median modelled and measured-to-expected times; a report's
  scalars).

  python3 scripts/gpu_check_returns.py WORK OUT ARCHIVE DRY QUICK TOTAL "STEP..."
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tarfile
from pathlib import Path
from typing import Any

LIMIT = 15 * 2**20  # below the device's 16 MiB a file
LOG_TAIL = 2 * 2**20


def figures(step: dict[str, Any]) -> dict[str, Any]:
    """The key figures of one step's record (record() in gpu_check.sh)."""
    found: dict[str, Any] = {}
    if "counts" in step:
        found["tests"] = step["counts"]
    records = step.get("records")
    if records:
        found["records"] = len(records)
        found["missing_target"] = sum(r.get("meets_target") is False for r in records)
        expected = [r["expected_us"] for r in records if "expected_us" in r]
        if expected:
            found["median_expected_us"] = round(statistics.median(expected), 3)
        ratios = [r["measured_vs_expected"] for r in records
                  if isinstance(r.get("measured_vs_expected"), int | float)]
        if ratios:
            found["median_measured_vs_expected"] = round(statistics.median(ratios), 3)
    report = step.get("report")
    if isinstance(report, dict):
        found["report"] = {k: v for k, v in list(report.items())[:12]
                           if isinstance(v, str | int | float | bool)}
    return found


def steps(work: Path, order: list[str]) -> list[dict[str, Any]]:
    """The finished steps' summaries, in the run's order."""
    done = []
    for name in order:
        path = work / f"{name}.json"
        if not path.is_file():
            continue
        step = json.loads(path.read_text())
        state = "timed_out" if step["timed_out"] else "passed" if step["rc"] == 0 else "failed"
        done.append({"name": name, "status": state, "rc": step["rc"],
                     "seconds": step["seconds"], "budget_s": step["budget_s"],
                     "timed_out": step["timed_out"], "figures": figures(step)})
    return done


def archive(work: Path, target: Path) -> None:
    """Every file of `work` into the gzipped tar `target`, atomically, under LIMIT."""
    partial = target.with_name(f".{target.name}.partial")
    for cut in (False, True):
        if cut:
            for log in work.glob("*.log"):
                if log.stat().st_size > LOG_TAIL:
                    with log.open("rb") as f:
                        f.seek(-LOG_TAIL, os.SEEK_END)
                        tail = f.read()
                    log.write_bytes(b"[... cut to its last 2 MiB ...]\n" + tail)
        with tarfile.open(partial, "w:gz") as tar:
            for path in sorted(work.iterdir()):
                if path.is_file():
                    tar.add(path, arcname=path.name)
        if partial.stat().st_size <= LIMIT:
            break
    os.replace(partial, target)


def main(argv: list[str]) -> None:
    work, out, name, dry, quick, total, order = argv
    work_dir, out_dir = Path(work), Path(out)
    archive(work_dir, out_dir / name)
    summary = {"dry_run": dry == "1", "quick": quick == "1", "total_budget_s": int(total),
               "archive": name, "steps": steps(work_dir, order.split())}
    partial = out_dir / ".summary.json.partial"
    partial.write_text(json.dumps(summary, indent=1) + "\n")
    os.replace(partial, out_dir / "summary.json")


if __name__ == "__main__":
    main(sys.argv[1:])

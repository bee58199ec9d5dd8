"""Run every bench module present (`bench/*_bench.py`), each in its own process.

`python -m bench.run_all [--only rollout rewards]` runs `python -m bench.<name>_bench` for each
module found, in name order, and writes bench/results/run_all.json with each module's exit status
and wall time. A failing bench makes the run exit non-zero (after the others have run).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent


def discover() -> list[str]:
    return sorted(p.stem for p in BENCH_DIR.glob("*_bench.py"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None,
                        help="bench names without the _bench suffix (default: all found)")
    args = parser.parse_args(argv)
    modules = discover()
    if args.only:
        wanted = {f"{name}_bench" for name in args.only}
        unknown = sorted(wanted - set(modules))
        if unknown:
            parser.error(f"unknown bench {unknown}; found {modules}")
        modules = [m for m in modules if m in wanted]
    summary = {}
    for module in modules:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", f"bench.{module}"], cwd=BENCH_DIR.parent)
        summary[module] = {"returncode": proc.returncode,
                           "seconds": round(time.perf_counter() - t0, 1)}
        print(f"[run_all] {module}: rc={proc.returncode} in {summary[module]['seconds']}s",
              flush=True)
    (BENCH_DIR / "results").mkdir(exist_ok=True)
    (BENCH_DIR / "results" / "run_all.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if all(s["returncode"] == 0 for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

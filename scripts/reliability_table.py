"""Run the fault-injection tests and print the reliability table (issue: reliability).

    python scripts/reliability_table.py [--repeats 1]

Each fault test appends one row (fault, times injected, completed, rows lost, rows duplicated,
outputs identical to an undisturbed run) to a log; the table sums the rows per fault.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict

TESTS = ["tests/test_reliability.py", "tests/test_runner.py::test_bad_rows_and_unreadable_shard"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    log = tempfile.mktemp(suffix=".jsonl")
    env = {**os.environ, "BATCHSPEC_RELIABILITY_LOG": log}
    for _ in range(args.repeats):
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:logging", *TESTS], env=env, check=True)
    table = defaultdict(lambda: {"runs": 0, "injected": 0, "completed": 0, "rows_lost": 0, "rows_duplicated": 0,
                                 "identical": 0})
    for line in open(log):
        r = json.loads(line)
        t = table[r["fault"]]
        t["runs"] += 1
        t["injected"] += r["injected"]
        t["completed"] += r["completed"]
        t["rows_lost"] += r["rows_lost"]
        t["rows_duplicated"] += r["rows_duplicated"]
        t["identical"] += r["identical"]
    print("\n| fault | injected | runs completed | rows lost | rows duplicated | outputs identical |")
    print("|---|---|---|---|---|---|")
    for fault, t in table.items():
        print(f"| {fault} | {t['injected']} | {t['completed']}/{t['runs']} | {t['rows_lost']} | {t['rows_duplicated']} | "
              f"{t['identical']}/{t['runs']} |")


if __name__ == "__main__":
    main()

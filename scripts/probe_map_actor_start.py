"""How long Ray Data's map actor takes to reach its constructor on a fresh local Ray, against the
same class as a plain Ray actor, and what its process spent on the CPU before it (issue 40's fixed
cost, docs/benchmarks.md "Ray Data's fixed cost on the demo job"). No model: the constructor only
records the time, so what is measured is Ray Data's own start.

    python scripts/probe_map_actor_start.py --repeats 3             # Ray Data and plain, in turn
    python scripts/probe_map_actor_start.py --repeats 3 --renice     # also renice Ray Data's helpers to 15

Each run is its own process (a fresh Ray). Prints one line per run: seconds from the start of the
execution (or the actor's request) to the constructor, the actor process's age and CPU seconds at
the constructor, and with --renice which helpers were found by their process title, and when.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

HELPERS = (b"ray::_StatsActor", b"ray::_AutoscalingCoordinatorActor", b"ray::ActorLocationTracker")


class Probe:
    def __init__(self):
        import psutil

        proc = psutil.Process()
        cpu = proc.cpu_times()
        self.seen = {"ctor": time.time(), "process_start": proc.create_time(), "cpu_s": cpu.user + cpu.system}

    def __call__(self, batch):
        batch["probe"] = [json.dumps(self.seen)] * len(batch["x"])
        return batch

    def read(self):
        return self.seen


def _renice_helpers(found: dict, t0: float, stop: threading.Event) -> None:
    """Renice Ray Data's helper actors to 15 as soon as their process titles name them."""
    while not stop.is_set():
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or pid in found:
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            name = next((h for h in HELPERS if cmd.startswith(h)), None)
            if name is not None:
                os.setpriority(os.PRIO_PROCESS, int(pid), 15)
                found[pid] = (name.decode(), round(time.time() - t0, 2))
        time.sleep(0.02)


def one_run(arm: str, renice: bool) -> dict:
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    import ray.data

    found: dict = {}
    stop = threading.Event()
    t0 = time.time()
    if arm == "plain":
        seen = ray.get(ray.remote(Probe).remote().read.remote())
    else:
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False
        if renice:
            threading.Thread(target=_renice_helpers, args=(found, t0, stop), daemon=True).start()
        ds = ray.data.from_items([{"x": i} for i in range(3)]).map_batches(Probe, compute=ray.data.ActorPoolStrategy(size=1),
                                                                          batch_size=None)
        seen = json.loads(ds.take_all()[0]["probe"])
    stop.set()
    ray.shutdown()
    return {"arm": arm, "to_constructor_s": round(seen["ctor"] - t0, 2),
            "process_age_at_constructor_s": round(seen["ctor"] - seen["process_start"], 2),
            "process_cpu_at_constructor_s": round(seen["cpu_s"], 2), "reniced": found}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--renice", action="store_true", help="also a Ray Data arm that renices its helpers to 15")
    ap.add_argument("--one", choices=["data", "plain", "data-renice"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_run(args.one.split("-")[0], args.one.endswith("renice"))))
        return
    arms = ["data", "plain"] + (["data-renice"] if args.renice else [])
    for _ in range(args.repeats):
        for arm in arms:
            out = subprocess.run([sys.executable, __file__, "--one", arm], capture_output=True, text=True, check=True)
            print(out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()

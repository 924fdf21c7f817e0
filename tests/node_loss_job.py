"""Run a job on a 3-node Ray cluster on this machine and remove a worker node mid-job.

    python tests/node_loss_job.py SPEC_JSON FAULT_FILE  ->  prints {"ok": ..., "removed": ...}

The head has no CPUs, so both generation actors run on the two 1-CPU worker nodes; the fault
file holds the first shard of each actor for a few seconds, and one worker node is removed while
they are held. A separate process because a Ray cluster cannot be started inside a process that
is already connected to another (the test session's).
"""

import json
import os
import sys
import threading
import time
from pathlib import Path

spec_path, fault_file = sys.argv[1], sys.argv[2]
os.environ["BATCHSPEC_FAULT_FILE"] = fault_file

from ray.cluster_utils import Cluster  # noqa: E402

from batchspec.runner.cluster import init_ray  # noqa: E402
from batchspec.runner.job import submit  # noqa: E402
from batchspec.spec import spec_from_dict  # noqa: E402

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
workers = [cluster.add_node(num_cpus=1) for _ in range(2)]
cluster.wait_for_nodes()
init_ray(cluster.address)
spec = spec_from_dict(json.loads(Path(spec_path).read_text()))
removed = {}


def remove_when_busy():
    # Both held shards are being generated once the marker files of the "sleep" faults exist.
    out = Path(spec.output.path)
    deadline = time.time() + 120
    while time.time() < deadline:
        held = list(Path(fault_file).parent.glob(Path(fault_file).name + ".*.started"))
        if len(held) >= 2:
            break
        time.sleep(0.1)
    removed["parts_before"] = len(list((out / "data").glob("part-*.parquet")))
    cluster.remove_node(workers[0])
    removed["node"] = True


threading.Thread(target=remove_when_busy, daemon=True).start()
result = submit(spec)
print(json.dumps({"ok": result.ok, "failed": result.failed, "done": sorted(result.done), "removed": removed}))
cluster.shutdown()

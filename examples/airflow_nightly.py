"""Airflow: one batchspec night per logical date, and a consumer that waits for the night's _SUCCESS.

Copy into your DAGs folder; set the job (a spec with `{ds}` in its input and output paths, as
examples/nightly.yaml) and the output root through the DAG's params or the environment.

- `batchspec_nightly` runs `batchspec submit JOB --param ds={{ ds }}`: the logical date of the
  run (data_interval_start), never the clock, so a backfill or a clear of last Tuesday rewrites
  last Tuesday. A task is a transaction: `submit` commits whole shards and skips committed ones,
  so Airflow's retry of a run that left failed shards (exit 1) or was killed at its timeout
  (SIGTERM, exit 143) redoes only what is not done. Exit 2 (a spec error, a changed spec) will
  not pass on a retry either; exit 3 is a crash of batchspec or Ray (docs/operations.md).
- `summaries_consumer` waits for `out/dt={{ ds }}/_batchspec/_SUCCESS`, written last, when every
  shard of the night is committed (it holds the run's summary as JSON). The FileSensor reads
  through the `fs_default` connection: `airflow connections create-default-connections`, or
  AIRFLOW_CONN_FS_DEFAULT='{"conn_type": "fs"}'. On S3 use the Amazon
  provider's sensor instead (`apache-airflow-providers-amazon`):
      S3KeySensor(task_id="wait_for_summaries",
                  bucket_key="s3://lake/summaries/dt={{ ds }}/_batchspec/_SUCCESS")

tests/test_examples.py runs both DAGs for one logical date with `dag.test()`.
"""

from __future__ import annotations

import os

import pendulum
from airflow.providers.standard.operators.bash import BashOperator
from airflow.providers.standard.operators.python import PythonOperator
from airflow.providers.standard.sensors.filesystem import FileSensor
from airflow.sdk import DAG

JOB = os.environ.get("BATCHSPEC_JOB", "examples/nightly.yaml")
OUT = os.environ.get("BATCHSPEC_OUT", "out")  # where the job's output.path puts dt=<ds>/
START = pendulum.datetime(2026, 12, 1, tz="UTC")

with DAG("batchspec_nightly", schedule="@daily", start_date=START, catchup=False, max_active_runs=1,
         params={"job": JOB}, tags=["batchspec"]) as nightly:
    BashOperator(
        task_id="summarize",
        # --log-format json: one JSON object per stderr line in the task's log; stdout stays empty.
        bash_command="batchspec submit {{ params.job }} --param ds={{ ds }} --log-format json",
        retries=2, retry_delay=pendulum.duration(minutes=10),
        execution_timeout=pendulum.duration(hours=6),  # SIGTERM at the timeout: committed shards stay
    )


def _read_summary(path: str) -> dict:
    """What a downstream task reads: the night's _SUCCESS summary (rows, error rows, job id)."""
    import json

    with open(path) as f:
        summary = json.load(f)
    print(f"night complete: {summary['rows']} rows ({summary['error_rows']} error rows), job {summary['job_id']}")
    return summary


with DAG("summaries_consumer", schedule="@daily", start_date=START, catchup=False, tags=["batchspec"]) as consumer:
    marker = OUT + "/dt={{ ds }}/_batchspec/_SUCCESS"
    wait = FileSensor(task_id="wait_for_summaries", filepath=marker, poke_interval=60, timeout=12 * 3600,
                      mode="reschedule")
    wait >> PythonOperator(task_id="use_summaries", python_callable=_read_summary, op_args=[marker])

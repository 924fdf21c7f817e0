"""Shared fixtures: tiny random-weight checkpoints built once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Each test's job starts from nothing, whatever ran before it (runner/memory.py); the tests of
# the memory itself point it at a directory of their own.
os.environ["BATCHSPEC_POLICY_MEMORY"] = "off"


def pytest_collection_modifyitems(items):
    """Run the vllm backend's tests first. vLLM's CPU platform scans every loaded module's globals
    when an engine starts, and trips over flask's context proxies (raising RuntimeError from
    hasattr) once moto's S3 server has imported flask; before that, the scan is harmless."""
    items.sort(key=lambda item: "test_vllm_backend" not in item.nodeid)


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    """tokenizer/, <family>-target/ and <family>-other/ (an unrelated random draft) per family."""
    from batchspec.testing import build_model, build_tokenizer

    root = tmp_path_factory.mktemp("models")
    tok = build_tokenizer(root / "tokenizer")
    for family in ("llama", "gpt2"):
        build_model(root / f"{family}-target", family, tok, seed=0)
        build_model(root / f"{family}-other", family, tok, seed=1)
    return root


@pytest.fixture(scope="session")
def prompts() -> list[str]:
    """Ragged prompts: from one word to a few dozen tokens."""
    from batchspec.testing import synthetic_text

    lines = synthetic_text(8, seed=7)
    return ["a"] + [line[: 10 + 17 * i] for i, line in enumerate(lines[1:])]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 endpoint on loopback: moto's server mode, as s3fs tests itself."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise

    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(k, v)
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


def _new_bucket(endpoint: str):
    """(storage_options, fs, bucket URL): a fresh bucket on the S3 endpoint."""
    import uuid

    import s3fs

    opts = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    fs = s3fs.S3FileSystem(**opts)
    bucket = f"bs-{uuid.uuid4().hex[:10]}"
    fs.mkdir(bucket)
    return opts, fs, f"s3://{bucket}"


@pytest.fixture()
def s3(s3_endpoint):
    """(storage_options, fs, bucket URL) with a fresh bucket per test."""
    return _new_bucket(s3_endpoint)


@pytest.fixture()
def s3_apart():
    """As s3, on a moto server in a process of its own. The s3 fixture runs moto in this process,
    which imports Flask; after that every vLLM engine started here fails (its CPU kernel
    registration scans every module's globals with hasattr and trips on Flask's context proxies:
    "Working outside of application context"). For the vllm backend's tests."""
    import shutil
    import socket
    import subprocess
    import time

    port = _free_port()
    server = subprocess.Popen([shutil.which("moto_server") or "moto_server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        yield _new_bucket(f"http://127.0.0.1:{port}")
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture(scope="session")
def fault_file(tmp_path_factory) -> Path:
    """Where reliability tests describe faults for the actors (see runner.faults).
    Its path is in the actors' environment from the start; the file exists only during a test."""
    return tmp_path_factory.mktemp("faults") / "faults.json"


@pytest.fixture(scope="session")
def ray_session(fault_file):
    """One local Ray for the whole session (starting Ray costs seconds), its workers born with what
    `batchspec submit`'s own local Ray gives them for a vllm job (init_ray's worker_env)."""
    import ray

    from batchspec.runner.cluster import actor_env_vars, init_ray

    os.environ["BATCHSPEC_FAULT_FILE"] = str(fault_file)
    init_ray(num_cpus=2, worker_env=actor_env_vars("vllm", 2))
    yield ray
    ray.shutdown()


def result_of(code: str, *args: str, env: dict | None = None, timeout: int = 600) -> dict:
    """Run `code` in a Python process of its own and return the JSON it printed after RESULT: for
    what must not meet this session's Ray or engines. On CPU, a vLLM engine started in a process
    where an n-gram engine started fails (VLLMBackend.load)."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], env=env, timeout=timeout)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
    assert lines, proc.stderr[-3000:]
    return json.loads(lines[0][6:])


def write_prompt_shards(write, n_shards: int, rows: int, prefix: str = "prompts", seed: int = 0) -> list[str]:
    """Write n_shards Parquet files of synthetic prompts with ids through write(name, table)."""
    import pyarrow as pa

    from batchspec.testing import synthetic_text

    names = []
    for s in range(n_shards):
        texts = synthetic_text(rows, seed=seed + s)
        table = pa.table({"prompt": texts, "doc_id": [f"{prefix}{s}-{i}" for i in range(rows)]})
        name = f"{prefix}-{s:04d}.parquet"
        write(name, table)
        names.append(name)
    return names


def local_writer(folder: Path):
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    return lambda name, table, **kw: pq.write_table(table, folder / name, **kw)


def s3_writer(fs, prefix: str):
    import pyarrow.parquet as pq

    def write(name, table, **kw):
        with fs.open(f"{prefix}/{name}", "wb") as f:
            pq.write_table(table, f, **kw)
    return write


def part_ids(output: str, storage_options: dict | None = None) -> list[str]:
    """Every id in every committed part (a list, so duplicates show)."""
    from batchspec.runner.store import OutputStore

    store = OutputStore(output, storage_options)
    return [i for s, m in store.manifests().items() if m["status"] == "done"
            for i in store.read_part(s).column("id").to_pylist()]


def record_fault(fault: str, injected: int, completed: bool, expected_ids, got_ids: list[str], identical: bool) -> None:
    """One row of the reliability table (scripts/reliability_table.py sets BATCHSPEC_RELIABILITY_LOG)."""
    import json

    path = os.environ.get("BATCHSPEC_RELIABILITY_LOG")
    if not path:
        return
    row = {"fault": fault, "injected": injected, "completed": bool(completed),
           "rows_lost": len(set(expected_ids) - set(got_ids)), "rows_duplicated": len(got_ids) - len(set(got_ids)),
           "identical": bool(identical)}
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")

"""Pack the shards to run into actor calls, and the calls into Ray Data blocks (one task each).

A shard stays whole on one actor; a call is one or more shards an actor runs together (on vLLM, in
one continuous batch); a block is one or more consecutive calls Ray Data hands one task.
"""

from __future__ import annotations

from .plan import Shard

CALL_SHARDS = 8  # on vllm, the shards a call takes at least (where the job has that many per actor)


def plan_calls(todo: list[Shard], backend: str, res, vllm_args: dict) -> list[list[Shard]]:
    """The shards of each actor call, in order. hf: one shard a call. vllm: consecutive shards until
    the call holds at least CALL_SHARDS of them and as many rows as vLLM runs at once (max_num_seqs,
    256 unless vllm_args says), never more than an equal share of the job per actor (of the most
    actors the pool may grow to), so no actor idles while another holds a backlog. Shards with one
    decision share an engine call, and a job of many small files still fills vLLM's batch (200
    files of 2 rows: two calls of 256 and 144 rows, not 25 of 16).
    resources.shards_per_call: that many shards a call, always."""
    if res.shards_per_call or backend != "vllm":
        n = res.shards_per_call or 1
        return [todo[i:i + n] for i in range(0, len(todo), n)]
    share, rows_wanted = -(-len(todo) // res.most_actors), int(vllm_args.get("max_num_seqs", 256))
    calls, call, rows = [], [], 0
    for shard in todo:
        call.append(shard)
        rows += shard.rows
        if len(call) >= share or (len(call) >= CALL_SHARDS and rows >= rows_wanted):
            calls.append(call)
            call, rows = [], 0
    return calls + ([call] if call else [])


BLOCK_ROWS = 256  # a Ray Data block (one task) holds calls until it has this many rows
BLOCKS_PER_ACTOR = 4  # ... and the job has at least this many blocks per actor


def calls_per_block(calls: list[list[Shard]], actors: int) -> int:
    """How many consecutive calls one Ray Data task takes. Each task costs Ray Data ~8 ms to
    schedule here (2 cores), so calls of a few rows go several to a task: until a task holds
    BLOCK_ROWS rows (vLLM's calls already do), while the job keeps BLOCKS_PER_ACTOR tasks per actor
    for the pool to balance. 10,000 shards of 2 rows on one actor: 128 calls a task, not 1."""
    if not calls:
        return 1
    mean_rows = sum(s.rows for call in calls for s in call) / len(calls)
    wanted = max(1, round(BLOCK_ROWS / max(1.0, mean_rows)))
    return max(1, min(wanted, len(calls) // (BLOCKS_PER_ACTOR * max(1, actors))))

"""What a run ends as: refused before it starts, interrupted, or a result with every shard counted."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import BatchspecError


class JobRefused(BatchspecError, RuntimeError):
    """The run cannot start: it would mix outputs of different specs or inputs (or overlap input
    and output), another run holds the output, or the Ray cluster named cannot be joined."""


@dataclass
class JobResult:
    job_id: str
    output: str
    shards: int
    done: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # shard -> error
    skipped: list[str] = field(default_factory=list)  # already done before this run
    rows: int = 0
    error_rows: int = 0
    completion_tokens: int = 0
    accepted_tokens: int = 0
    draft_tokens: int = 0
    wall_s: float = 0.0
    # Start-up: seconds to start or join Ray (None when this process had it up already), and each
    # actor start this run paid for (ShardWorker.start: worker, load_s, ready_s after the run began;
    # a restarted actor loads again and counts again).
    ray_s: float | None = None
    actor_starts: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def startup(self) -> dict | None:
        """The first engine's start: seconds from the run's start until an actor could generate
        (ready_s), with Ray's share and that actor's engine load; None when no actor started."""
        if not self.actor_starts:
            return None
        first = min(self.actor_starts, key=lambda a: a["ready_s"])
        return {"ready_s": first["ready_s"], "ray_s": self.ray_s, "engine_load_s": first["load_s"]}

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s else 0.0


class JobInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM: terminated) during a run; `status` is status() of the output at that
    moment. recorded: False when the run stopped before it was recorded (while joining Ray), so a
    new output has no job.json."""

    def __init__(self, job_id: str, status: dict, recorded: bool = True, terminated: bool = False):
        super().__init__(job_id)
        self.job_id, self.status, self.recorded, self.terminated = job_id, status, recorded, terminated

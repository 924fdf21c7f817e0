"""An actor's backend: the one the driver chose for the job, loaded with the job's checkpoints
(s3:// ones copied to local disk first), or the hf engine when auto chose vLLM and vLLM cannot
serve the model. Under speculation.mode off it loads no draft."""

from __future__ import annotations

import functools
import gc
import logging

from ..engine.api import Backend
from ..spec import JobSpec
from .logs import log_event

log = logging.getLogger("batchspec.worker")


def load_actor_backend(spec: JobSpec, job_id: str, backend: str | None = None) -> tuple[Backend, str | None]:
    """The actor's backend (the driver's choice, or the spec's), and why it is another one when
    auto had to fall back (None otherwise)."""
    from ..engine.api import ModelLoadError
    from ..engine.backend import HF_DRAFT_KINDS, backend_for, load_backend
    from .checkpoints import local_checkpoints

    m = spec.model
    if spec.speculation.mode == "off":
        # No call speculates: the target alone, as a plain run would load it (on vLLM one engine
        # without speculation, not a speculative one held at k = 0 beside a plain one).
        m = m.model_copy(update={"draft": m.draft.model_copy(update={"kind": "none", "path": None})})
    backend = backend or backend_for(spec).name
    load = functools.partial(load_backend, spec_model=m, k_default=spec.speculation.num_speculative_tokens,
                             sampled=spec.generation.temperature > 0, local_paths=local_checkpoints(m),
                             plain_calls=spec.speculation.mode != "on")
    try:
        return load(backend), None
    except ModelLoadError as e:
        # auto promises the backend that can serve the job. Which models vLLM serves shows only
        # when an engine starts (an architecture it lacks, or on CPU attention heads of 16), so the
        # actor falls back to the hf engine, which serves any transformers model, and says so in
        # its log and every manifest it writes.
        if backend != "vllm" or m.backend != "auto" or m.draft.kind not in HF_DRAFT_KINDS:
            raise
        note = f"auto: {str(e).splitlines()[0][:400]}; batchspec's own engine serves it"
        log_event(log, f"backend: {note}", logging.WARNING, job=job_id)
        gc.collect()  # the failed engine's memory, before the hf engine loads
        return load("hf"), note

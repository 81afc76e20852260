"""A stage as a Prefect task, made from its registry entry: the same task for every stage, so the
flows are a loop over the registry (flows/session.py run_stages).

The task runs the stage through run_stage (key, reuse or build, track), then lets the stage's
module publish what it shows in Prefect (an optional ``publish(record)``), and ends in a state
that says whether the output was reused.
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import Any

from prefect import Task, task
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from cpuforge.tasks.infra import live
from cpuforge.tasks.infra.publish import finish_stage
from cpuforge.tasks.infra.stage import (
    SERVICE_RETRIES,
    TRAINING_RETRIES,
    TRAINING_TAG,
    StageContext,
    StageSpec,
    run_stage,
)
from cpuforge.tasks.infra.store import StageRecord

# What a retry can help with, by the registry's `kind`: training resumes from its last checkpoint
# (a crashed torchrun, memory pressure); a service (a hub download) may answer the second time.
TASK_OPTIONS: dict[str, dict[str, Any]] = {
    "plain": {},
    "training": {**TRAINING_RETRIES, "tags": [TRAINING_TAG]},
    "service": SERVICE_RETRIES,
}


@cache
def stage_task(spec: StageSpec) -> Task:
    """The Prefect task that runs this stage (one per stage, made once)."""
    module = importlib.import_module(spec.module)

    def run(ctx: StageContext, inputs: dict[str, StageRecord], extra_key: Any = None, source: Any = None) -> State:
        with live.live_stage(spec.name) as report:  # progress in the UI while it runs (nothing if reused)
            record = run_stage(spec, ctx, module.work, inputs, extra_key=extra_key, source=source, report=report)
        publish = getattr(module, "publish", None)
        if publish is not None:
            publish(record)
        return finish_stage(record, ctx)

    run.__doc__ = (module.__doc__ or "").strip().split("\n\n")[0]
    run.__qualname__ = run.__name__ = f"{spec.name}_stage"  # Prefect keys task runs by the function's name
    return task(run, name=spec.name, cache_policy=NO_CACHE, **TASK_OPTIONS[spec.kind])

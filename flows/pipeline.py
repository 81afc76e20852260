"""The cpuforge pipeline as a Prefect flow: the stages of the registry (tasks/stages/__init__.py PIPELINE) in
order, then the final model through the champion gate."""

from __future__ import annotations

from typing import Any

from prefect import flow

from cpuforge.flows.session import (
    DEFAULT_WORKDIR,
    Profile,
    PruneStrategy,
    check_before_opening,
    flow_session,
    rebuild_set,
    register_final,
    resolve_flow_run,
    run_stages,
    stages_to_run,
)
from cpuforge.tasks import stages
from cpuforge.tasks.release.lineage import HF_PREFIX, find_init_task


@flow(name="cpuforge-pipeline", log_prints=True)
def pipeline(
    profile: Profile = "demo",
    data_source: str = "",
    pretrain_minutes: float = 0,
    init_from: str = "",
    keep_ratio: float = 0,
    prune_strategy: PruneStrategy = "",
    recover_minutes: float = 0,
    config_file: str = "",
    overrides: tuple[str, ...] = (),
    workdir: str = DEFAULT_WORKDIR,
    summary_path: str = "",
    rebuild: str = "",
    stop_after: str = "",
    registered_model: str = "",
) -> dict[str, Any]:
    """Raw text to a small, fast, registered model: the registry's stages in order (tasks/stages/__init__.py
    PIPELINE; `cpuforge plan` lists them), then the final model is registered in MLflow and promoted to champion if
    it beats the current one.

    Args:
        profile: named profile: tiny (about a minute), demo (10-15 minutes), full (hours).
        data_source: the corpus: 'stdlib' (built in, no download), a folder or file of text, or a Hugging Face dataset id.
            Empty: the profile's (stdlib).
        pretrain_minutes: wall-clock budget of pretraining. 0: the profile's (demo: 5).
        init_from: continue pretraining from 'champion' (the registered champion's pretrained weights; from scratch
            while there is none), a model folder, runs:/RUN_ID/model, or hf:DIR_OR_ID (a transformers Llama checkpoint:
            its shape and tokenizer are used). Empty: a new model.
        keep_ratio: fraction of parameters pruning keeps, in (0, 1]. 0: the profile's (0.5).
        prune_strategy: width (heads, MLP and embedding channels), depth (whole layers) or width_then_depth.
            Empty: the profile's (demo: width_then_depth).
        recover_minutes: wall-clock budget of distillation after pruning. 0: the profile's (demo: 3).
        config_file: a YAML file of config sections on the worker, applied over the profile. Empty: none.
        overrides: more `section.key=value` settings, applied last, e.g. `train.lr=0.001`.
        workdir: folder (on the worker) for stage outputs, run summaries and, without an MLflow server, the MLflow store.
        summary_path: also write the summary JSON to this file.
        rebuild: build this stage and every stage that reads its output again, even where the store has them (e.g. prune).
            Empty: reuse what is there.
        stop_after: run the stages up to and including this one, then stop (e.g. prune); the model is registered
            only when evaluate ran. Empty: every stage.
        registered_model: the MLflow registry name the model is registered under, and whose champion 'champion'
            means. Empty: the profile's (cpuforge-lm). Smoke runs keep their own (prefect.yaml's tiny deployment:
            cpuforge-lm-smoke), so a smoke model never becomes the champion real runs start from.
    """
    run = resolve_flow_run(profile, config_file, overrides, workdir, data_source=data_source,
                           pretrain_minutes=pretrain_minutes, init_from=init_from, keep_ratio=keep_ratio,
                           prune_strategy=prune_strategy, recover_minutes=recover_minutes,
                           registered_model=registered_model)
    find = find_init_task if run.cfg.train.init_from else None
    # A transformers checkpoint brings its own shape (as compress adopts it); cpuforge's own weights must match model.*
    adopt_shape = (run.cfg.train.init_from or "").startswith(HF_PREFIX)
    # a stage name that does not exist, or widths the GGUF files cannot hold, fail before the run opens
    check_before_opening(stages_to_run(stages.PIPELINE, stop_after), run.cfg)
    with flow_session("pipeline", run, workdir, summary_path, find_pretrained=find, adopt_shape=adopt_shape,
                      rebuild=rebuild_set(rebuild, stages.PIPELINE)) as (summary, ctx):
        records = run_stages(stages.PIPELINE, summary, ctx, run, stop_after)
        register_final(summary, ctx, records, run.source)
    return summary.as_json()

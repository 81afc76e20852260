"""The compression half as a flow of its own: an existing pretrained model -> prune -> recover -> export
-> quantize -> evaluate -> register. For trying another keep ratio or strategy without pretraining again."""

from __future__ import annotations

from functools import partial
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
from cpuforge.tasks.release.lineage import CHAMPION, find_source_task


@flow(name="cpuforge-compress", log_prints=True)
def compress(
    pretrained: str = CHAMPION,
    profile: Profile = "demo",
    data_source: str = "",
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
    """Compress an existing pretrained model: the registry's COMPRESS stages (adopt in pretrain's place;
    tasks/stages/__init__.py), then register it through the champion gate. The model's own shape and tokenizer
    are used; model.* settings are ignored.

    Args:
        pretrained: the model to compress: 'champion' (the pretrained weights behind the registered champion),
            runs:/RUN_ID/model (a pretrain stage's MLflow run), a pretrain stage output or model folder on the worker,
            or hf:DIR_OR_ID: a transformers Llama checkpoint with its own tokenizer.json (a folder on the worker, or a
            Hugging Face Hub id, downloaded once). Its eos token becomes the end-of-document token.
        profile: named profile for the other settings: tiny, demo or full.
        data_source: the corpus for recovery and evaluation; it is tokenized with the model's tokenizer.
            Empty: the profile's (stdlib).
        keep_ratio: fraction of parameters pruning keeps, in (0, 1]. 0: the profile's (0.5).
        prune_strategy: width (heads, MLP and embedding channels), depth (whole layers) or width_then_depth.
            Empty: the profile's (demo: width_then_depth).
        recover_minutes: wall-clock budget of distillation after pruning. 0: the profile's (demo: 3).
        config_file: a YAML file of config sections on the worker, applied over the profile. Empty: none.
        overrides: more `section.key=value` settings, applied last, e.g. `recover.lr=0.001`.
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
    run = resolve_flow_run(profile, config_file, overrides, workdir, pretrained,
                           data_source=data_source, keep_ratio=keep_ratio, prune_strategy=prune_strategy,
                           recover_minutes=recover_minutes,
                           registered_model=registered_model)
    find = partial(find_source_task, pretrained)
    # a stage name that does not exist, or widths the GGUF files cannot hold, fail before the run opens
    check_before_opening(stages_to_run(stages.COMPRESS, stop_after), run.cfg)
    with flow_session("compress", run, workdir, summary_path, find_pretrained=find, adopt_shape=True,
                      rebuild=rebuild_set(rebuild, stages.COMPRESS)) as (summary, ctx):
        records = run_stages(stages.COMPRESS, summary, ctx, run, stop_after)
        register_final(summary, ctx, records, run.source)
    return summary.as_json()

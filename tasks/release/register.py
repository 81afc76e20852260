"""The MLflow model registry: the final int8 ONNX model as a registered version, and the
champion gate.

Every pipeline run registers its final model (once per distinct model: a rerun that reuses
the quantize stage reuses its version) and points the alias ``candidate`` at it. The alias
``champion`` moves to it only when there is no champion yet, or when it has fewer bits per
byte than the current champion on the same validation text, each model reading that text
with its own tokenizer (so the comparison holds across tokenizers). The decision and its
reason are logged on the ``register`` run, tagged on the version, and returned for the summary.

A version is a text model (tasks/infra/text_model.py: prompts in, generated text out, so
``mlflow models serve`` answers prompts) with a description that summarises its model card, and
every alias move is recorded with who, when and why (tasks/infra/model_registry.py).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext

from cpuforge.models.runtime import LanguageModel, ModelLoadError, load_language_model
from cpuforge.tasks import stages
from cpuforge.tasks.engine.data import open_shards
from cpuforge.tasks.engine.scoring import Score, score_text
from cpuforge.tasks.infra import model_registry, tracking
from cpuforge.tasks.infra.model_registry import (
    TAG_DECISION,
    TAG_DECODE,
    TAG_FILE_BYTES,
    TAG_PARAMS,
    TAG_REASON,
    TAG_SOURCE_KEY,
    TAG_VAL_BPB,
)
from cpuforge.tasks.infra.stage import SERVICE_RETRIES, StageContext
from cpuforge.tasks.infra.store import StageRecord
from cpuforge.tasks.records.errors import DataError, ModelError

log = logging.getLogger("cpuforge.registry")

CANDIDATE, CHAMPION = "candidate", "champion"
DECODE_METRIC = "onnx-int8/decode_tok_s"  # the evaluate stage's figure for the registered (final) variant


def gate_text(tokenized: StageRecord, lm: LanguageModel, max_tokens: int) -> str:
    """The validation text every contender is scored on: the first max_tokens val tokens, as text."""
    val = open_shards(Path(tokenized.output_dir), lm.cfg.block_size).val[: max_tokens + 1]
    return lm.tokenizer.decode(np.asarray(val).tolist(), skip_special_tokens=False)


def decide(candidate: Score, champion: Score | None, champion_version: str | None,
           champion_error: str | None) -> tuple[bool, str]:
    """(promote?, why) — the champion gate, as a pure function of the two scores."""
    if champion_version is None:
        return True, "there is no champion yet"
    if champion is None:
        return False, f"the champion (version {champion_version}) could not be scored on this validation set " \
                      f"({champion_error}); it stays champion"
    if candidate.val_bpb < champion.val_bpb:
        return True, (f"{candidate.val_bpb:.4f} bits per byte beats champion version {champion_version}'s "
                      f"{champion.val_bpb:.4f} on the same validation text")
    return False, (f"{candidate.val_bpb:.4f} bits per byte does not beat champion version {champion_version}'s "
                   f"{champion.val_bpb:.4f} on the same validation text; it stays champion")


def register(ctx: StageContext, tokenized: StageRecord, quantized: StageRecord, evaluated: StageRecord,
             lineage: dict[str, str] | None = None) -> dict[str, Any]:
    """Register the final model (or find the version that already holds it) and run the champion gate.

    ``lineage``: version tags saying where its pretrained weights and data came from (tasks/release/lineage.py).
    """
    name = ctx.cfg.tracking.registered_model
    onnx_path = quantized.path("onnx")
    lm = load_language_model(onnx_path)
    text = gate_text(tokenized, lm, ctx.cfg.eval.max_tokens)
    candidate_score = score_text(lm, text)

    with tracking.child_run("register", ctx.parent_run_id, {tracking.TAG_STAGE: "register"}) as run_id:
        version = registered_version(ctx, name, onnx_path, tokenized, quantized, evaluated, lm, candidate_score,
                                     lineage, run_id)
        promote, reason, champion_version, champion_score = champion_gate(name, version, text, candidate_score,
                                                                          run_id)
        decision = "promoted" if promote else "kept champion"
        model_registry.tag_version(name, version, {TAG_DECISION: decision, TAG_REASON: reason})
        metrics = {"candidate_val_bpb": candidate_score.val_bpb, "gate_bytes": candidate_score.bytes,
                   "promoted": int(promote)}
        if champion_score is not None:
            metrics["champion_val_bpb"] = champion_score.val_bpb
        tracking.log_run_metrics(run_id, metrics)
        tracking.set_run_tags(run_id, {TAG_DECISION: decision, TAG_REASON: reason, "cpuforge.model_version": version})

    now_champion = model_registry.alias_version(name, CHAMPION)
    log.info("registered %s version %s as %s: %s (%s)", name, version, CANDIDATE, decision, reason)
    return {
        "registered_model": name, "version": version, "model_uri": f"models:/{name}/{version}",
        "champion_uri": f"models:/{name}@{CHAMPION}", "aliases": model_registry.version_aliases(name, version),
        "champion_version": now_champion, "previous_champion_version": champion_version,
        "decision": decision, "reason": reason, "candidate_val_bpb": candidate_score.val_bpb,
        "champion_val_bpb": champion_score.val_bpb if champion_score else None, "mlflow_run_id": run_id,
        "serve": f"mlflow models serve -m models:/{name}@{CHAMPION} --env-manager local",
    }


def registered_version(ctx: StageContext, name: str, onnx_path: Path, tokenized: StageRecord, quantized: StageRecord,
                       evaluated: StageRecord, lm: LanguageModel, candidate_score: Score,
                       lineage: dict[str, str] | None, run_id: str) -> str:
    """The version that holds this model (logged, tagged and described when new), with its lineage tags and
    the candidate alias."""
    from cpuforge.tasks.infra import text_model  # imports MLflow: not before a run needs it

    existing = model_registry.versions_tagged(name, TAG_SOURCE_KEY, quantized.key)
    if existing:
        version = existing[0]
        log.info("%s version %s already holds this model; reusing it", name, version)
    else:
        version = text_model.log_text_model(
            onnx_path, tokenized.path("tokenizer"), name,
            metadata={"val_bpb": candidate_score.val_bpb, "params": lm.params, "file_bytes": lm.file_bytes})
        model_registry.tag_version(name, version, {
            TAG_SOURCE_KEY: quantized.key, TAG_VAL_BPB: f"{evaluated.metrics['final_val_bpb']:.5f}",
            TAG_PARAMS: str(lm.params), TAG_FILE_BYTES: str(lm.file_bytes),
            **({TAG_DECODE: f"{evaluated.metrics[DECODE_METRIC]:.1f}"} if DECODE_METRIC in evaluated.metrics else {})})
        model_registry.describe_version(name, version, model_card_summary(ctx, tokenized, evaluated, lm))
    model_registry.tag_version(name, version, lineage or {})
    model_registry.move_alias(name, CANDIDATE, version, f"the model of the latest pipeline run (MLflow run "
                              f"{ctx.parent_run_id or run_id})", run_id)
    return version


def champion_gate(name: str, version: str, text: str, candidate_score: Score,
                  run_id: str) -> tuple[bool, str, str | None, Score | None]:
    """Score the current champion on the same text and move the champion alias when the candidate beats it:
    (promoted, why, the champion's version before, its score)."""
    from cpuforge.tasks.infra import text_model  # imports MLflow: not before a run needs it

    champion_version = model_registry.alias_version(name, CHAMPION)
    champion_score, champion_error = None, None
    if champion_version == version:
        return False, "this model is already the champion", champion_version, champion_score
    if champion_version is not None:
        try:
            with tempfile.TemporaryDirectory(prefix="cpuforge-champion-") as tmp:
                folder = text_model.download(f"models:/{name}/{champion_version}", Path(tmp))
                champion_score = score_text(load_language_model(folder), text)
        except (ModelLoadError, ModelError, DataError, ValueError) as exc:
            champion_error = str(exc)
    promote, reason = decide(candidate_score, champion_score, champion_version, champion_error)
    if promote:
        model_registry.move_alias(name, CHAMPION, version, reason, run_id)
    return promote, reason, champion_version, champion_score


def model_card_summary(ctx: StageContext, tokenized: StageRecord, evaluated: StageRecord, lm: LanguageModel) -> str:
    """The version's description: what it was trained on, its size, quality and speed, and the run that made it."""
    m, cfg = evaluated.metrics, lm.cfg
    final = {v["variant"]: v for v in evaluated.summary.get("variants", [])}.get(stages.FINAL_VARIANT, {})
    tok = tokenized.metrics
    speed = (f"{final['prefill_tok_s']:,.0f} tokens/s prefill, {final['decode_tok_s']:,.0f} tokens/s decode "
             "(batch 1, on the machine that evaluated it)" if final else "not measured")
    return "\n".join([
        f"cpuforge int8 ONNX language model: {lm.params:,} parameters, {lm.file_bytes / 1e6:.2f} MB "
        f"({cfg.n_layer} layers, d_model {cfg.d_model}, {cfg.n_head} heads, context {cfg.block_size} tokens, "
        f"vocabulary {cfg.vocab_size:,}).",
        f"- data: {ctx.cfg.data.source} ({int(tok.get('tokens_train', 0)):,} training tokens, "
        f"{int(tok.get('bytes_train', 0)):,} bytes)",
        f"- quality: {m['final_val_bpb']:.4f} bits per byte on {int(m.get('val_tokens', 0)):,} validation tokens "
        f"(the pretrained fp32 model: {m.get('baseline_val_bpb', float('nan')):.4f})",
        f"- speed: {speed}",
        f"- made by: pipeline run (MLflow run {ctx.parent_run_id}), profile {ctx.cfg.profile}, "
        f"experiment {ctx.cfg.tracking.experiment}",
        "- use: prompts in (a `prompt` column or a list of strings), text out; params max_new_tokens, "
        "temperature, top_k, top_p, stop, seed",
    ])


def _markdown(result: dict[str, Any]) -> str:
    return "\n".join([
        f"### registry — {result['decision']}",
        "",
        f"- model: `{result['model_uri']}` (aliases: {', '.join(result['aliases']) or 'none'})",
        f"- champion now: version {result['champion_version']} (`{result['champion_uri']}`)",
        f"- why: {result['reason']}",
        f"- candidate bits per byte on the gate text: {result['candidate_val_bpb']:.4f}",
    ])


@task(name="register", cache_policy=NO_CACHE, **SERVICE_RETRIES)  # an MLflow server can be briefly away
def register_task(ctx: StageContext, tokenize: StageRecord, quantize: StageRecord, evaluate: StageRecord,
                  lineage: dict[str, str] | None = None) -> dict[str, Any]:
    result = register(ctx, tokenize, quantize, evaluate, lineage)
    if TaskRunContext.get() is not None:
        create_markdown_artifact(key="cpuforge-registry", markdown=_markdown(result),
                                 description="cpuforge: the registered model and the champion gate's decision")
    return result


def open_model(spec: str, tracking_uri: str | None = None) -> LanguageModel:
    """A model by path (model folder, .onnx file, stage output) or by MLflow URI (models:/NAME@alias,
    models:/NAME/VERSION, runs:/RUN/PATH), ready to run; ModelError says what is wrong."""
    try:
        if spec.startswith(("models:/", "runs:/")):
            from cpuforge.tasks.infra import text_model

            with tempfile.TemporaryDirectory(prefix="cpuforge-model-") as tmp:
                # onnxruntime reads the whole file when the session is made: the download can go afterwards.
                return load_language_model(text_model.download(spec, Path(tmp), tracking_uri))
        return load_language_model(Path(spec))
    except ModelLoadError as exc:
        raise ModelError(str(exc)) from None

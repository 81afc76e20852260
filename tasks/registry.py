"""The MLflow model registry: the final int8 ONNX model as a registered version, and the
champion gate.

Every pipeline run registers its final model (once per distinct model: a rerun that reuses
the quantize stage reuses its version) and points the alias ``candidate`` at it. The alias
``champion`` moves to it only when there is no champion yet, or when it has fewer bits per
byte than the current champion on the same validation text, each model reading that text
with its own tokenizer (so the comparison holds across tokenizers). The decision and its
reason are logged on the ``register`` run, tagged on the version, and returned for the summary.
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

from cpuforge.models.onnx_export import INPUTS, decoder_feeds, output_names, past_names
from cpuforge.models.runtime import LanguageModel, ModelLoadError, load_language_model
from cpuforge.tasks.engine.data import open_shards
from cpuforge.tasks.engine.scoring import Score, score_text
from cpuforge.tasks.errors import DataError, ModelError
from cpuforge.tasks.infra import tracking
from cpuforge.tasks.infra.stage import SERVICE_RETRIES, StageContext
from cpuforge.tasks.infra.store import StageRecord

log = logging.getLogger("cpuforge.registry")

CANDIDATE, CHAMPION = "candidate", "champion"
TAG_SOURCE_KEY = "cpuforge.quantize_key"
TAG_VAL_BPB = "cpuforge.val_bpb"  # as the evaluate stage measured it on its val tokens
TAG_DECISION = "cpuforge.gate_decision"
TAG_REASON = "cpuforge.gate_reason"


def gate_text(tokenized: StageRecord, lm: LanguageModel, max_tokens: int) -> str:
    """The validation text every contender is scored on: the first max_tokens val tokens, as text."""
    val = open_shards(Path(tokenized.output_dir), lm.cfg.block_size).val[: max_tokens + 1]
    return lm.tokenizer.decode(np.asarray(val).tolist(), skip_special_tokens=False)


def signature_and_example(lm: LanguageModel):
    from mlflow.models import ModelSignature
    from mlflow.types.schema import Schema, TensorSpec

    cfg = lm.cfg
    past_shape = (-1, cfg.n_kv_head, -1, cfg.head_dim)
    names_out = output_names(cfg.n_layer)
    inputs = Schema([TensorSpec(np.dtype(np.int64), (-1, -1), n) for n in INPUTS] +
                    [TensorSpec(np.dtype(np.float32), past_shape, n) for n in past_names(cfg.n_layer)])
    outputs = Schema([TensorSpec(np.dtype(np.float32), (-1, -1, cfg.vocab_size), names_out[0])] +
                     [TensorSpec(np.dtype(np.float32), past_shape, n) for n in names_out[1:]])
    # One decoding step with a real KV cache (that of a short prompt): a zero-length past, the
    # prefill case, would not survive the example's JSON form.
    prompt = lm.encode("def main():")[: cfg.block_size - 2] or [0]
    logits, past = lm.decoder.prefill(np.array([prompt], dtype=np.int64))
    next_token = np.array([[int(logits[0].argmax())]], dtype=np.int64)
    example = decoder_feeds(cfg, next_token, [np.asarray(t) for t in past])
    return ModelSignature(inputs=inputs, outputs=outputs), example


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


def _alias_version(client, name: str, alias: str) -> str | None:
    from mlflow.exceptions import MlflowException

    try:
        return str(client.get_model_version_by_alias(name, alias).version)
    except MlflowException:
        return None


def register(ctx: StageContext, tokenized: StageRecord, quantized: StageRecord, evaluated: StageRecord,
             lineage: dict[str, str] | None = None) -> dict[str, Any]:
    """Register the final model (or find the version that already holds it) and run the champion gate.

    ``lineage``: version tags saying where its pretrained weights and data came from (tasks/lineage.py).
    """
    mlflow = tracking._mlflow()
    client = mlflow.MlflowClient()
    name = ctx.cfg.tracking.registered_model
    onnx_path = quantized.path("onnx")
    lm = load_language_model(onnx_path)
    text = gate_text(tokenized, lm, ctx.cfg.eval.max_tokens)
    candidate_score = score_text(lm, text)

    with mlflow.start_run(run_name="register", nested=ctx.parent_run_id is not None,
                          parent_run_id=ctx.parent_run_id, tags={tracking.TAG_STAGE: "register"}) as run:
        existing = [v for v in client.search_model_versions(f"name='{name}'")
                    if v.tags.get(TAG_SOURCE_KEY) == quantized.key]
        if existing:
            version = str(existing[0].version)
            log.info("%s version %s already holds this model; reusing it", name, version)
        else:
            import onnx

            signature, example = signature_and_example(lm)
            info = mlflow.onnx.log_model(
                onnx.load(str(onnx_path)), name="model", registered_model_name=name, signature=signature,
                input_example=example, onnx_execution_providers=["CPUExecutionProvider"],
                save_as_external_data=False,
                metadata={"val_bpb": candidate_score.val_bpb, "params": lm.params, "file_bytes": lm.file_bytes})
            version = str(info.registered_model_version)
            client.set_model_version_tag(name, version, TAG_SOURCE_KEY, quantized.key)
            client.set_model_version_tag(name, version, TAG_VAL_BPB, f"{evaluated.metrics['final_val_bpb']:.5f}")
        for tag, value in (lineage or {}).items():
            client.set_model_version_tag(name, version, tag, value)
        client.set_registered_model_alias(name, CANDIDATE, version)

        champion_version = _alias_version(client, name, CHAMPION)
        champion_score, champion_error = None, None
        if champion_version == version:
            promote, reason = False, "this model is already the champion"
        else:
            if champion_version is not None:
                try:
                    with tempfile.TemporaryDirectory(prefix="cpuforge-champion-") as tmp:
                        folder = tracking.download(f"models:/{name}/{champion_version}", Path(tmp))
                        champion_score = score_text(load_language_model(folder), text)
                except (ModelLoadError, ModelError, DataError, ValueError) as exc:
                    champion_error = str(exc)
            promote, reason = decide(candidate_score, champion_score, champion_version, champion_error)
            if promote:
                client.set_registered_model_alias(name, CHAMPION, version)
        decision = "promoted" if promote else "kept champion"
        client.set_model_version_tag(name, version, TAG_DECISION, decision)
        client.set_model_version_tag(name, version, TAG_REASON, reason)
        metrics = {"candidate_val_bpb": candidate_score.val_bpb, "gate_bytes": candidate_score.bytes,
                   "promoted": int(promote)}
        if champion_score is not None:
            metrics["champion_val_bpb"] = champion_score.val_bpb
        mlflow.log_metrics(metrics)
        mlflow.set_tags({TAG_DECISION: decision, TAG_REASON: reason, "cpuforge.model_version": version})
        run_id = run.info.run_id

    now_champion = _alias_version(client, name, CHAMPION)
    log.info("registered %s version %s as %s: %s (%s)", name, version, CANDIDATE, decision, reason)
    return {
        "registered_model": name, "version": version, "model_uri": f"models:/{name}/{version}",
        "champion_uri": f"models:/{name}@{CHAMPION}", "aliases": _aliases(client, name, version),
        "champion_version": now_champion, "previous_champion_version": champion_version,
        "decision": decision, "reason": reason, "candidate_val_bpb": candidate_score.val_bpb,
        "champion_val_bpb": champion_score.val_bpb if champion_score else None, "mlflow_run_id": run_id,
    }


def _aliases(client, name: str, version: str) -> list[str]:
    return sorted(client.get_model_version(name, version).aliases)


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
            with tempfile.TemporaryDirectory(prefix="cpuforge-model-") as tmp:
                # onnxruntime reads the whole file when the session is made: the download can go afterwards.
                return load_language_model(tracking.download(spec, Path(tmp), tracking_uri))
        return load_language_model(Path(spec))
    except ModelLoadError as exc:
        raise ModelError(str(exc)) from None

"""Stage 6, quantize: the fp32 ONNX decoder -> int8 (or int4) with onnxruntime, the fastest good variant kept.

Candidates (``quantize.method``, ``quantize.weight_type``):
- dynamic: int8 weights, activations quantized on the fly per call. Signed (QInt8) and
  unsigned (QUInt8) weights are both tried under ``weight_type=auto``: on CPUs without VNNI
  the u8*s8 kernels can saturate, so which one stays accurate is measured, not assumed.
- genai: the graph ONNX Runtime GenAI's model builder makes from the recovered transformers
  folder (models/genai_build.py): fused GroupQueryAttention with rotary, skip-RMSNorm, and
  weight-only MatMulNBits at int8 and int4 (block 32; ``accuracy_level`` 4, int8 arithmetic,
  which onnxruntime's CPU kernels run on AVX2 too, see ACCURACY_LEVEL), each with the LM head quantized
  and kept fp32: whether the LM head pays for quantizing is measured like the rest; and int8 in blocks
  of 64 (fewer scales per row: whether that runs faster on this CPU and shape is measured too).
- gptq-int4: GPTQ on the exported graph (models/gptq_onnx.py: onnxruntime's solver, each weight corrected for
  its input's statistics on train-split batches), MatMulNBits int4 in symmetric blocks of 32, the LM head at int8
  (round-to-nearest); a tied embedding's lookup reads the head's int8 blocks.
- static: QDQ with activation ranges calibrated on train-split batches.
They are built most likely winners first (BUILD_ORDER); ``quantize.build_seconds`` (which budget.minutes sets)
leaves out the rest once building them would pass it, and the report lists them as not built.
Each is scored on the same validation tokens (bits per byte, and how often its greedy next-token
choice agrees with the fp32 model's where fp32 is confident: its top choice has probability >= CONFIDENT_P)
and timed with the fp32 model itself, in alternation (tasks/scoring.alternating_speeds): prefill
tokens/s at full context and decode tokens/s with the KV cache, both at batch 1, each the best of its rounds.

Rule (``choose``, a pure function of those figures):
1. Quality: only candidates whose bits per byte is at most ``quantize.max_bpb_increase`` above
   the fp32 model's and whose greedy choices agree with fp32's on at least
   ``quantize.min_token_agreement`` of the tokens where fp32 is confident (near-ties elsewhere flip with
   any rounding, more of them the flatter a model's logits); if none is, the most accurate (bits per byte)
   is kept and speed is not asked.
2. Decode: a candidate that decodes slower than the fp32 ONNX model is never the winner (at
   this size per-token overhead, not arithmetic, decides decode, and static QDQ can lose 3x).
3. Speed: of the rest, the highest geometric mean of its prefill and decode speed-ups over
   fp32 (``quantize.favour``: ``decode`` for a model that mostly generates, ``prefill`` for one that
   mostly scores or embeds, rank by that speed-up alone). Rounds go on (MIN_ROUNDS..MAX_ROUNDS, and
   within ``quantize.speed_seconds`` where set) until the winner's lead over the next candidate,
   and every candidate's decode margin over fp32, exceed the spread of the measurements; a lead
   still within the spread after the last round is a tie, and a tie goes to the simpler
   candidate (the order of SIMPLICITY: dynamic, then the builder's int8 (blocks of 64 first) and int4, then static).
4. The kept model is quantized: if no candidate decodes as fast as fp32, the one that decodes
   closest to it is kept, and the metrics (``int8_decodes_slower_than_fp32``) and the report say
   that the fp32 model decodes faster.
The file keeps its name, ``model.int8.onnx``, whatever the candidate (evaluate, the registry, the
GenAI config and users' scripts name it): a 4-bit winner says so in the ``weight_bits`` metric,
the ``kept`` info and the graph's ``cpuforge.quantization`` metadata.
The kept one is ``model.int8.onnx``, with the export stage's ONNX Runtime GenAI files beside it
(``genai_config.json`` naming it, with the builder's inputs and shared KV buffer when the kept graph
is the builder's, the tokenizer files), so the output folder runs in GenAI as the export's does;
every candidate stays in ``candidates/``.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import onnx

from cpuforge.models import onnx_files
from cpuforge.models.fileio import atomic_write_json, atomic_write_text
from cpuforge.models.genai_build import GenaiBuildError, build_decoder
from cpuforge.models.gptq_onnx import quantize_gptq
from cpuforge.models.onnx_export import (
    decoder_feeds,
    read_metadata,
    reshare_after_quantization,
    set_metadata,
    share_tied_embedding,
)
from cpuforge.models.onnx_layout import GENAI_CONFIG, copy_layout, use_decoder_of
from cpuforge.models.runtime import load_language_model
from cpuforge.tasks import stages
from cpuforge.tasks.config.settings import QuantizeConfig
from cpuforge.tasks.engine.data import BatchSampler, open_shards, token_byte_lengths
from cpuforge.tasks.engine.hardware import int8_dot_product
from cpuforge.tasks.engine.scoring import REFERENCE_TOP, Samples, alternating_speeds, best, score_with_choices, spread
from cpuforge.tasks.infra import live
from cpuforge.tasks.infra.stage import StageOutput, StageRun
from cpuforge.tasks.infra.store import StageRecord

log = logging.getLogger("cpuforge.quantize")

SPEC = stages.QUANTIZE
# Simplest first: the order a tie is broken in (a dynamic model needs no calibration data). The builder's int8
# graph in blocks of 64 comes before blocks of 32: the same graph with half the scales, a smaller file.
SIMPLICITY = ("dynamic-qint8", "dynamic-quint8", "genai-int8-b64", "genai-int8", "genai-int8-fp32head", "genai-int4",
              "genai-int4-head8", "genai-int4-kquant", "genai-int4-kquant-head8", "genai-int4-fp32head", "gptq-int4",
              "static-qdq")
GPTQ = "gptq-int4"


class BuilderCandidate(NamedTuple):
    precision: str  # models/genai_build.PRECISIONS
    quantize_head: bool
    block_size: int
    algo: str = "default"  # the builder's algo_config: round-to-nearest ('default'), or k_quant's scale search


# The builder's candidates. With the head quantized the embedding lookup reads the head's blocks (4-bit: the
# builder's own sharing; 8-bit: models/genai_build.share_int8_embedding); with an fp32 head the two share one
# fp32 table. Blocks of 64 at int8: on the demo's pruned shapes (widths 120,
# 192, 504 and 192, 544) they decoded 1.06-1.12x and prefilled 1.10-1.28x the speed of blocks of 32 at the same
# bits per byte (greedy agreement with fp32 98.5% against 98.8%); which one a machine runs faster is measured.
# At int4, k_quant (onnxruntime's k-quant scale search, llama.cpp's way of choosing each block's scale and offset
# to minimise its error, no calibration data) against plain round-to-nearest; '-head8' keeps the LM head, the
# single largest and most output-sensitive matrix, at int8 as llama.cpp's 4-bit mixes do (the lookup shares it).
GENAI = {"genai-int8": BuilderCandidate("int8", True, 32), "genai-int8-b64": BuilderCandidate("int8", True, 64),
         "genai-int8-fp32head": BuilderCandidate("int8", False, 32),
         "genai-int4": BuilderCandidate("int4", True, 32), "genai-int4-fp32head": BuilderCandidate("int4", False, 32),
         "genai-int4-head8": BuilderCandidate("int4", True, 32, "rtn_last"),
         "genai-int4-kquant": BuilderCandidate("int4", True, 32, "k_quant"),
         "genai-int4-kquant-head8": BuilderCandidate("int4", True, 32, "k_quant_last")}
# The order candidates are built in, so that quantize.build_seconds leaves out the least likely winners: weight-only
# int8 in blocks of 64 kept quality where dynamic int8 lost it (a 67M model pruned from a 135M one: 93-96% greedy
# agreement against 40-59%); k-quant int4 with an int8 head is the best of the smallest files, and round-to-nearest
# int4 with an int8 head (llama.cpp Q4_0's mix) comes next: the 4-bit file with an int8 head where k-quant cannot
# pack the widths; dynamic int8 costs seconds to build and often wins at small sizes; GPTQ runs the calibration
# batches and solves every weight; static QDQ needs calibration and decoded slowest.
BUILD_ORDER = ("genai-int8-b64", "genai-int4-kquant-head8", "genai-int4-head8", "dynamic-qint8", "dynamic-quint8",
               "genai-int4", "genai-int4-kquant", "genai-int8", "genai-int8-fp32head", "genai-int4-fp32head", GPTQ,
               "static-qdq")
META_QUANTIZATION = "cpuforge.quantization"
MIN_ROUNDS, MAX_ROUNDS = 3, 12
# The gate's agreement counts the positions where fp32's top choice has at least this probability. Where it has
# less, a near-tie flips with any rounding: weight-only int8 of a 67M model pruned from a 135M one disagreed with
# fp32 on 4-7% of all tokens at unchanged bits per byte, and the all-token gate refused it for the ties it measured.
CONFIDENT_P = 0.5
DECODE_TOKENS = 64
CALIB_BATCH = 4
CALIB_SEED = 2024  # fixed: the stage's key holds only the quantize section


def candidate_methods(q: QuantizeConfig) -> list[str]:
    dynamic = {"auto": ["dynamic-qint8", "dynamic-quint8"], "qint8": ["dynamic-qint8"],
               "quint8": ["dynamic-quint8"]}[q.weight_type]
    return {"best": dynamic + list(GENAI) + [GPTQ, "static-qdq"], "dynamic": dynamic, "static": ["static-qdq"],
            "genai": list(GENAI)}[q.method]


# MatMulNBits' arithmetic: 4 quantizes the activations to int8 for the product. onnxruntime's CPU kernels have
# that path for AVX2 as well as VNNI/AMX: on an AVX2-only EPYC (demo model, 2 threads, alternating) level 4 decoded
# 302 tok/s at int8 and 356 at int4 against 40 and 172 with fp32 arithmetic (level 1), prefill 0.6-0.8x of it.
ACCURACY_LEVEL = 4


def describe(method: str) -> str:
    """What a candidate is, for the graph's metadata and the report."""
    if method in GENAI:
        c = GENAI[method]
        head = "int8" if c.algo.endswith("_last") else c.precision if c.quantize_head else "fp32"
        algo = "k-quant scales" if c.algo.startswith("k_quant") else "round-to-nearest"
        return (f"{method}: ONNX Runtime GenAI model builder, MatMulNBits {c.precision} weights (block {c.block_size}, "
                f"{algo}, accuracy_level {ACCURACY_LEVEL}), LM head {head}, fused GroupQueryAttention")
    if method == GPTQ:
        return (f"{GPTQ}: GPTQ (onnxruntime's solver, Hessians from train batches), MatMulNBits int4 weights "
                f"(block 32, symmetric, accuracy_level {ACCURACY_LEVEL}) on the exported graph; LM head int8 "
                "(round-to-nearest), which a tied lookup reads")
    return {"dynamic-qint8": "dynamic-qint8: onnxruntime quantize_dynamic, int8 MatMul weights",
            "dynamic-quint8": "dynamic-quint8: onnxruntime quantize_dynamic, uint8 MatMul weights",
            "static-qdq": "static-qdq: onnxruntime quantize_static, QDQ int8 weights and activations"}[method]


def _calibration_reader(shards, q: QuantizeConfig, model_cfg):
    from onnxruntime.quantization import CalibrationDataReader

    sampler = BatchSampler(shards.train, CALIB_BATCH, model_cfg.block_size, seed=CALIB_SEED)

    class TrainBatches(CalibrationDataReader):
        def __init__(self) -> None:
            self.step = 0

        def get_next(self):
            if self.step >= q.calib_batches:
                return None
            x, _ = sampler.batch(self.step)
            self.step += 1
            return decoder_feeds(model_cfg, x.numpy())

    return TrainBatches()


def quantize_one(method: str, source: Path, target: Path, reader_factory, hf_folder: Path | None = None) -> None:
    """Write candidate ``method`` of the fp32 graph ``source`` to ``target``; the builder's candidates are
    built from ``hf_folder`` (the transformers folder the graph was exported from) and leave their
    genai_config beside ``target`` (``<name>.genai_config.json``)."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static

    metadata = {**read_metadata(source), META_QUANTIZATION: describe(method)}
    if method in GENAI:
        c = GENAI[method]
        config = build_decoder(hf_folder, target, c.precision, metadata, accuracy_level=ACCURACY_LEVEL,
                               quantize_lm_head=c.quantize_head, block_size=c.block_size, algo=c.algo)
        atomic_write_json(target.with_suffix(".genai_config.json"), config)
        return
    if method == GPTQ:
        proto = onnx.load(str(source))
        reader = reader_factory()
        quantize_gptq(proto, iter(reader.get_next, None), block_size=32, accuracy_level=ACCURACY_LEVEL,
                      work_dir=target.parent)
        set_metadata(proto, metadata)
        onnx_files.save(proto, target)
        return
    large = bool(onnx_files.external_files(source))  # the quantizers write external data only when told
    if method.startswith("dynamic"):
        weight_type = QuantType.QInt8 if method == "dynamic-qint8" else QuantType.QUInt8
        quantize_dynamic(str(source), str(target), weight_type=weight_type, op_types_to_quantize=["MatMul"],
                         use_external_data_format=large)
    else:
        quantize_static(str(source), str(target), reader_factory(), quant_format=QuantFormat.QDQ,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, reduce_range=True,
                        op_types_to_quantize=["MatMul"], extra_options={"WeightSymmetric": True},
                        use_external_data_format=large)
    proto = onnx.load(str(target))
    onnx_files.remove(target)  # the quantizer's external data file has a name of its own
    reshare_after_quantization(proto)
    set_metadata(proto, metadata)  # the config and tokenizer travel with every variant
    onnx_files.save(proto, target)


@dataclass
class Decision:
    kept: str
    why: str
    settled: bool  # the measurements decide it (else more rounds could change it)
    margins: dict[str, float] = field(default_factory=dict)
    decodes_slower_than_fp32: bool = False


def _simplicity(name: str) -> tuple[int, str]:
    return (SIMPLICITY.index(name) if name in SIMPLICITY else len(SIMPLICITY), name)


# quantize.favour: which speed-ups over fp32 the score is made of (best rounds).
FAVOUR_MEASURES = {"balanced": ("prefill_b1", "decode"), "decode": ("decode",), "prefill": ("prefill_b1",)}
FAVOUR_WORDS = {"balanced": "the geometric mean of prefill and decode speed-ups", "decode": "decode speed-up",
                "prefill": "prefill speed-up"}


def speed_score(speeds: dict[str, list[float]], fp32: dict[str, list[float]], favour: str = "balanced") -> float:
    """The speed-up over fp32 that ranks candidates: by default the geometric mean of prefill and decode
    (both count alike); quantize.favour=decode or prefill ranks by that one alone."""
    measures = FAVOUR_MEASURES[favour]
    return math.prod(best(speeds[m]) / best(fp32[m]) for m in measures) ** (1 / len(measures))


def choose(quality: dict[str, float], speeds: Samples, fp32_bpb: float, max_increase: float,
           agreement: dict[str, float] | None = None, min_agreement: float = 0.0,
           favour: str = "balanced") -> Decision:
    """The rule in the module docstring. quality: candidate -> val bits per byte; agreement: candidate ->
    fraction of greedy next-token choices equal to fp32's where fp32 is confident; speeds: candidate (and "fp32") ->
    {"prefill_b1": [tok/s per round], "decode": [...]}; favour: what the speed score is made of."""
    limit = fp32_bpb * (1 + max_increase)
    within = f"within {100 * max_increase:g}% of the fp32 bits per byte ({fp32_bpb:.4f} -> at most {limit:.4f})"
    agreement = agreement or {}
    if min_agreement > 0:
        within += f" and agreeing with its greedy tokens where it is confident on at least {100 * min_agreement:g}%"
    good = sorted((n for n in quality if quality[n] <= limit and agreement.get(n, 1.0) >= min_agreement),
                  key=_simplicity)
    if not good:
        name = min(sorted(quality, key=_simplicity), key=lambda n: quality[n])
        return Decision(name, f"no candidate stays {within}; kept the most accurate", settled=True)
    fp32 = speeds["fp32"]
    fp32_decode = best(fp32["decode"])
    decode_vs_fp32 = {n: best(speeds[n]["decode"]) / fp32_decode - 1 for n in good}
    # A decode margin within the noise of either figure could flip with one more round.
    decode_noise = {n: max(spread(speeds[n]["decode"]), spread(fp32["decode"])) for n in good}
    eligibility_settled = all(abs(decode_vs_fp32[n]) > decode_noise[n] for n in good)
    fast_enough = [n for n in good if decode_vs_fp32[n] >= 0]
    if not fast_enough:
        name = max(good, key=lambda n: decode_vs_fp32[n])  # good is simplest-first: max keeps the first of equals
        return Decision(
            name, f"no int8 candidate {within} decodes as fast as the fp32 ONNX model at batch 1; kept the closest "
                  f"({name}, {100 * decode_vs_fp32[name]:+.1f}% decode vs fp32): for generation the fp32 model is faster",
            settled=eligibility_settled, decodes_slower_than_fp32=True,
            margins={"decode_vs_fp32_pct": round(100 * decode_vs_fp32[name], 2)})
    scores = {n: speed_score(speeds[n], fp32, favour) for n in fast_enough}
    ranked = sorted(fast_enough, key=lambda n: -scores[n])
    winner = ranked[0]
    lead = scores[winner] / scores[ranked[1]] - 1 if len(ranked) > 1 else math.inf
    noise = max(spread(speeds[winner][m]) for m in FAVOUR_MEASURES[favour])
    margins = {"noise_pct": round(100 * noise, 2), "decode_vs_fp32_pct": round(100 * decode_vs_fp32[winner], 2),
               "score": round(scores[winner], 4),
               **({"lead_pct": round(100 * lead, 2)} if math.isfinite(lead) else {})}  # none without a runner-up
    rule = (f"fastest by {FAVOUR_WORDS[favour]} over fp32 ({scores[winner]:.2f}x), "
            f"among the candidates {within} that decode at least as fast as fp32")
    if lead > noise:
        margin = f"lead {100 * lead:.1f}% over {ranked[1]} > spread {100 * noise:.1f}%" if len(ranked) > 1 else "the only one"
        return Decision(winner, f"{rule}; {margin}", settled=eligibility_settled, margins=margins)
    tied = [n for n in fast_enough if scores[n] * (1 + noise) >= scores[winner]]
    simplest = min(tied, key=_simplicity)
    margins["score"] = round(scores[simplest], 4)
    margins["decode_vs_fp32_pct"] = round(100 * decode_vs_fp32[simplest], 2)
    return Decision(simplest, f"{rule}; {', '.join(sorted(tied, key=_simplicity))} tie within the "
                    f"{100 * noise:.1f}% spread of the measurements: kept the simplest", settled=False, margins=margins)


def work(run: StageRun, quantize: QuantizeConfig) -> StageOutput:
    return quantize_model(quantize, run.inputs["tokenize"], run.inputs["export"], run.out_dir, run.report,
                          hf_folder=run.inputs["recover"].path("model"))


def quantize_model(q: QuantizeConfig, tokenized: StageRecord, exported: StageRecord, out_dir: Path,
                   report: live.Report = live.nothing, hf_folder: Path | None = None) -> StageOutput:
    """Quantize the fp32 ONNX model each candidate way, score and time them, keep one by the rule.
    ``report(fraction, headline)`` follows it: the candidates are the first half, the timing rounds the rest."""
    started = time.perf_counter()
    fp32_path = exported.path("onnx")
    fp32 = load_language_model(fp32_path)
    shards = open_shards(Path(tokenized.output_dir), fp32.cfg.block_size)
    scoring = (np.asarray(shards.val[: q.score_tokens + 1]), token_byte_lengths(shards.tokenizer_path))
    prepared = prepare_graph(fp32_path, out_dir / "prepared.onnx")

    methods = candidate_methods(q)
    if hf_folder is None:  # the builder needs the transformers folder the graph came from
        methods = [m for m in methods if m not in GENAI]
    built, results, skipped = build_candidates(q, methods, fp32, prepared, out_dir / "candidates", shards, scoring,
                                               hf_folder, report)
    lms = {"fp32": fp32, **{name: load_language_model(path) for name, path in built.items()}}
    decision, rounds = time_candidates(q, lms, results, report)

    kept = decision.kept
    onnx_files.copy(out_dir / "candidates" / f"{kept}.onnx", out_dir / "model.int8.onnx")
    layout = copy_layout(Path(exported.output_dir), out_dir, "model.int8.onnx")
    if kept in GENAI:  # the builder's graph: its inputs and its shared KV buffer, in the folder's genai_config
        use_decoder_of(out_dir, out_dir / "candidates" / f"{kept}.genai_config.json")
    metrics = {**quantize_metrics(results, decision, rounds, started), "candidates_built": len(built),
               "candidates_skipped": len(skipped)}
    summary = write_reports(out_dir, decision, rounds, results, skipped, metrics)
    return StageOutput(metrics=metrics, files={"onnx": "model.int8.onnx", "genai_config": GENAI_CONFIG,
                                               "candidates": "candidates", "report": "quantize_report.md"},
                       artifacts=[*onnx_files.files_of(out_dir / "model.int8.onnx"), *layout, "candidates.json",
                                  "quantize_report.md"],
                       info={"kept": kept, "kept_is": describe(kept), "rule": decision.why,
                             "int8_dot_product": summary["int8_dot_product"],
                             **({"skipped_candidates": skipped} if skipped else {})})


def prepare_graph(fp32_path: Path, prepared: Path) -> Path:
    """The fp32 graph as the quantizers take it: shapes inferred, a tied embedding shared."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    # Symbolic shape inference cannot follow the dynamic past length; ONNX's own inference suffices.
    large = bool(onnx_files.external_files(fp32_path))
    quant_pre_process(str(fp32_path), str(prepared), skip_symbolic_shape=True, save_as_external_data=large,
                      all_tensors_to_one_file=True, external_data_location=onnx_files.data_file(prepared).name)
    if share_tied_embedding(proto := onnx.load(str(prepared))):
        onnx_files.save(proto, prepared, check=False)
    return prepared


def kquant_misfit(candidate: BuilderCandidate, hf_folder: Path) -> str | None:
    """Why the builder's k-quant path cannot quantize this model, or None. onnxruntime (1.32) packs its 4-bit
    zero points two to a byte across a matrix's rows, and fails on any matmul whose input width is an odd
    number of blocks (a pruned width of 96 or 736 on the 32 grid): known before building, not after."""
    if not candidate.algo.startswith("k_quant") or candidate.precision != "int4":
        return None
    config = json.loads((Path(hf_folder) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    widths = {config["hidden_size"], config["intermediate_size"], config["num_attention_heads"] * head_dim}
    odd = sorted(w for w in widths if -(-w // candidate.block_size) % 2)
    if not odd:
        return None
    return (f"k-quant's 4-bit zero points (onnxruntime's packing) need every matmul input width to be an even "
            f"number of {candidate.block_size}-value blocks; this model has {', '.join(map(str, odd))}")


def build_budget_spent(q: QuantizeConfig, elapsed: float, slowest: float, any_built: bool) -> str | None:
    """Why the next candidate is not built (quantize.build_seconds would be passed at the pace of the slowest
    candidate so far), or None. The first candidate that builds is never refused: there must be a model to keep."""
    if q.build_seconds is None or not any_built or elapsed + slowest <= q.build_seconds:
        return None
    return (f"not built: quantize.build_seconds={q.build_seconds:g} s would be passed ({elapsed:.0f} s spent, the "
            f"slowest candidate took {slowest:.0f} s)")


def confident_agreement(greedy: np.ndarray, fp32_greedy: np.ndarray, fp32_top: np.ndarray) -> float:
    """How often a candidate's greedy choice equals fp32's where fp32 gives its choice >= CONFIDENT_P; 1.0 where
    fp32 is never that sure (a random-init model): nothing to hold the candidate to, bits per byte decides."""
    confident = fp32_top >= CONFIDENT_P
    return round(float((greedy[confident] == fp32_greedy[confident]).mean()), 5) if confident.any() else 1.0


def build_candidates(q: QuantizeConfig, methods: list[str], fp32: Any, prepared: Path, candidates: Path, shards: Any,
                     scoring: tuple[np.ndarray, Any], hf_folder: Path | None, report: live.Report,
                     ) -> tuple[dict[str, Path], dict[str, dict], dict[str, str]]:
    """Each method's model in candidates/, scored against fp32: their files, their results, and the methods
    skipped (the model builder refused the model, the model does not fit a candidate, or quantize.build_seconds
    was spent), in the order of ``methods``. They are built in BUILD_ORDER. The prepared graph is removed after."""
    val_tokens, byte_lengths = scoring
    built: dict[str, Path] = {}
    fp32_score, fp32_choices, _ = score_with_choices(fp32, val_tokens, byte_lengths)
    fp32_greedy, fp32_top = fp32_choices.greedy, fp32_choices.top_p
    confident = fp32_top >= CONFIDENT_P
    results: dict[str, dict] = {"fp32": {"file_bytes": fp32.file_bytes, "val_bpb": fp32_score.val_bpb,
                                         "token_agreement": 1.0, "confident_agreement": 1.0, "kl_to_fp32": 0.0,
                                         "confident_share": round(float(confident.mean()), 5)}}
    log.info("fp32: val bpb %.4f; confident (top-1 probability >= %g) on %.1f%% of %s scored tokens", fp32_score.val_bpb,
             CONFIDENT_P, 100 * confident.mean(), f"{confident.size:,}")
    shutil.rmtree(candidates, ignore_errors=True)  # an interrupted earlier attempt's partial candidates
    candidates.mkdir()
    report(0.05, {"phase": "quantizing", "fp32 val bits per byte": results["fp32"]["val_bpb"]}, force=True)
    skipped: dict[str, str] = {}
    refused: GenaiBuildError | None = None  # the builder refuses a model (its config), not one precision
    loop_started, slowest, spent = time.perf_counter(), 0.0, None
    refused_by = ""
    order = sorted(methods, key=lambda m: BUILD_ORDER.index(m) if m in BUILD_ORDER else len(BUILD_ORDER))
    for i, method in enumerate(order):
        target = candidates / f"{method}.onnx"
        t0 = time.perf_counter()
        if method in GENAI and hf_folder is not None and (misfit := kquant_misfit(GENAI[method], hf_folder)):
            skipped[method] = misfit
            log.info("%s is not a candidate for this model: %s", method, misfit)
            continue
        if method in GENAI and refused is not None:
            skipped[method] = skipped[refused_by]
            continue
        # once spent, the same words for every candidate left (the report names them on one line)
        spent = spent or build_budget_spent(q, t0 - loop_started, slowest, bool(built))
        if spent:
            skipped[method] = spent
            log.info("%s %s", method, spent)
            continue
        try:
            quantize_one(method, prepared, target, lambda: _calibration_reader(shards, q, fp32.cfg), hf_folder)
        except GenaiBuildError as exc:
            # One family's tool refusing this model is not a reason to lose the others' candidates; a failure
            # of k-quant's own code path says nothing about the builder's other candidates.
            if not GENAI[method].algo.startswith("k_quant"):
                refused, refused_by = exc, method
            skipped[method] = str(exc).strip().splitlines()[-1].strip()[:300]
            log.warning("%s skipped: the model builder failed (%s)", method, skipped[method])
            continue
        except Exception as exc:  # noqa: BLE001  (GPTQ's: below; anything else is raised again)
            if method != GPTQ:
                raise
            # The newest and most memory-hungry candidate, built late: its failure loses none of the others.
            onnx_files.remove(target)
            skipped[method] = f"failed: {type(exc).__name__}: {str(exc).strip()[:300]}"
            log.warning("%s skipped: %s", method, skipped[method])
            continue
        lm = load_language_model(target)
        score, choices, kl = score_with_choices(lm, val_tokens, byte_lengths, reference=fp32_choices)
        greedy = choices.greedy
        built[method] = target
        results[method] = {"file_bytes": lm.file_bytes, "val_bpb": score.val_bpb,
                           "token_agreement": round(float((greedy == fp32_greedy).mean()), 5),
                           "confident_agreement": confident_agreement(greedy, fp32_greedy, fp32_top),
                           "kl_to_fp32": round(kl, 6),
                           "quantize_seconds": round(time.perf_counter() - t0, 2)}
        slowest = max(slowest, results[method]["quantize_seconds"])
        log.info("%s: %.2f MB, val bpb %.4f, KL to fp32 %.5f nats/token, greedy agreement %.4f (%s)", method,
                 results[method]["file_bytes"] / 1e6, results[method]["val_bpb"], results[method]["kl_to_fp32"],
                 results[method]["token_agreement"],
                 f"{results[method]['confident_agreement']:.4f} where fp32 is confident" if confident.any()
                 else "fp32 is confident nowhere: bits per byte decides")
        report(0.05 + 0.45 * (i + 1) / len(methods),
               {"phase": "quantizing", **{f"{name} val bits per byte": r["val_bpb"] for name, r in results.items()}})
        del lm  # one candidate loaded at a time while building: the next builder needs the memory (static
        # calibration of a 0.55B model takes ~11 GB; with every candidate held too, a 23 GiB machine ran out)
    onnx_files.remove(prepared)
    if refused is not None and not built:  # only the builder's candidates were asked for
        raise refused
    in_order = [m for m in methods if m in results]
    return ({m: built[m] for m in in_order}, {"fp32": results["fp32"], **{m: results[m] for m in in_order}},
            {m: skipped[m] for m in methods if m in skipped})


def time_candidates(q: QuantizeConfig, lms: dict[str, Any], results: dict[str, dict], report: live.Report,
                    ) -> tuple[Decision, int]:
    """Every candidate with fp32, in alternation, until the rule's margins stand out of the noise: the rule's
    decision and the rounds it took. Each result gets its prefill and decode speeds and their samples."""
    base = results["fp32"]
    quality = {k: v["val_bpb"] for k, v in results.items() if k != "fp32"}
    agreement = {k: v["confident_agreement"] for k, v in results.items() if k != "fp32"}

    def decide(samples: Samples) -> Decision:
        return choose(quality, samples, base["val_bpb"], q.max_bpb_increase, agreement, q.min_token_agreement,
                      q.favour)

    def settled(samples: Samples) -> bool:
        done = len(samples["fp32"]["decode"])
        report(0.5 + 0.5 * done / MAX_ROUNDS, {"phase": f"timing round {done} (at most {MAX_ROUNDS})",
                                               **{f"{name} decode tok/s": best(s["decode"]) for name, s in samples.items()}})
        return decide(samples).settled

    speeds = alternating_speeds(lms, [1], DECODE_TOKENS, MIN_ROUNDS, MAX_ROUNDS, settled=settled,
                                seconds=q.speed_seconds)
    decision = decide(speeds)
    for name, r in results.items():
        r.update(prefill_tok_s=round(best(speeds[name]["prefill_b1"]), 1),
                 decode_tok_s=round(best(speeds[name]["decode"]), 1), samples=speeds[name])
    return decision, len(speeds["fp32"]["decode"])


def quantize_metrics(results: dict[str, dict], decision: Decision, rounds: int,
                     started: float) -> dict[str, float | int]:
    """The kept model against fp32, the rule's margins, and every candidate's figures by name."""
    base, kept, kept_r = results["fp32"], decision.kept, results[decision.kept]
    metrics: dict[str, float | int] = {
        "fp32_bytes": base["file_bytes"], "int8_bytes": kept_r["file_bytes"],
        "size_ratio": round(base["file_bytes"] / kept_r["file_bytes"], 3),
        "fp32_val_bpb": base["val_bpb"], "val_bpb": kept_r["val_bpb"],
        "bpb_increase_pct": round(100 * (kept_r["val_bpb"] / base["val_bpb"] - 1), 3),
        "fp32_prefill_tok_s": base["prefill_tok_s"], "prefill_tok_s": kept_r["prefill_tok_s"],
        "speedup_vs_fp32": round(kept_r["prefill_tok_s"] / base["prefill_tok_s"], 3),
        "fp32_decode_tok_s": base["decode_tok_s"], "decode_tok_s": kept_r["decode_tok_s"],
        "decode_speedup_vs_fp32": round(kept_r["decode_tok_s"] / base["decode_tok_s"], 3),
        "int8_decodes_slower_than_fp32": int(decision.decodes_slower_than_fp32),
        "weight_bits": 4 if kept == GPTQ or (kept in GENAI and GENAI[kept].precision == "int4") else 8,
        "token_agreement": kept_r["token_agreement"], "confident_agreement": kept_r["confident_agreement"],
        "confident_share": base["confident_share"], "kl_to_fp32": kept_r["kl_to_fp32"],
        "rule_rounds": rounds, "rule_settled": int(decision.settled),
        **{f"rule_{k}": v for k, v in decision.margins.items()},
        "seconds": round(time.perf_counter() - started, 2),
    }
    for name, r in results.items():
        for key in ("val_bpb", "token_agreement", "confident_agreement", "kl_to_fp32", "file_bytes", "prefill_tok_s",
                    "decode_tok_s"):
            metrics[f"{name}/{key}"] = r[key]
    return metrics


def write_reports(out_dir: Path, decision: Decision, rounds: int, results: dict[str, dict], skipped: dict[str, str],
                  metrics: dict[str, float | int]) -> dict[str, Any]:
    """candidates.json and quantize_report.md: what was kept, why, and every candidate's figures."""
    kept, why, kept_r = decision.kept, decision.why, results[decision.kept]
    summary = {"kept": kept, "kept_is": describe(kept), "rule": why, "rounds": rounds, "settled": decision.settled,
               "int8_dot_product": int8_dot_product(), "results": results, "skipped": skipped}
    atomic_write_json(out_dir / "candidates.json", summary)
    atomic_write_text(out_dir / "quantize_report.md", _markdown(summary))
    log.info("kept %s: %.2f MB (%.1fx smaller than fp32 ONNX), val bpb %.4f (%+.2f%%), %.2fx the fp32 prefill and "
             "%.2fx its decode speed (%d rounds); %s", kept, kept_r["file_bytes"] / 1e6, metrics["size_ratio"],
             kept_r["val_bpb"], metrics["bpb_increase_pct"], metrics["speedup_vs_fp32"],
             metrics["decode_speedup_vs_fp32"], rounds, why)
    return summary


def _markdown(report: dict) -> str:
    lines = [f"kept **{report['kept']}** ({report['kept_is']}): {report['rule']}", "",
             f"CPU int8 dot-product instructions: {report['int8_dot_product']}. Speeds: best of {report['rounds']} "
             f"rounds, candidates timed in alternation{'' if report['settled'] else ' (margins still within the noise)'}.",
             f"Greedy agreement with fp32 is counted on every scored token, and where fp32 is confident (its top "
             f"choice has probability >= {CONFIDENT_P:g}: {100 * report['results']['fp32']['confident_share']:.1f}% "
             "of them), which the gate uses. KL to fp32: mean nats per token, exact over fp32's top "
             f"{REFERENCE_TOP} tokens with the rest of the vocabulary as one outcome.",
             "", "| variant | file MB | val bits/byte | KL to fp32 | greedy agreement with fp32 | where fp32 is confident | "
             "prefill tok/s (batch 1) | decode tok/s (batch 1, KV cache) |", "|---|---|---|---|---|---|---|---|"]
    for name, r in report["results"].items():
        lines.append(f"| {name} | {r['file_bytes'] / 1e6:.2f} | {r['val_bpb']:.4f} | {r.get('kl_to_fp32', 0):.5f} | "
                     f"{r['token_agreement']:.4f} | "
                     f"{r['confident_agreement']:.4f} | "
                     f"{r['prefill_tok_s']:,.0f} | "
                     f"{r['decode_tok_s']:,.0f} |")
    by_reason: dict[str, list[str]] = {}  # one line per reason: a spent build budget leaves out several alike
    for name, why in report.get("skipped", {}).items():
        by_reason.setdefault(why, []).append(f"**{name}**")
    lines += [f"\nleft out: {', '.join(names)}: {why}" for why, names in by_reason.items()]
    return "\n".join(lines) + "\n"

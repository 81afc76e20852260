"""Stage 7, evaluate: every variant of the model on the same validation tokens.

Variants: pretrained (PyTorch fp32), pruned, recovered (PyTorch fp32), onnx-fp32 and
onnx-int8 (onnxruntime). For each: bits per byte and perplexity on the first
``eval.max_tokens`` val tokens, parameters, file size, prefill tokens/s at full context for
each of ``eval.batch_sizes``, decode tokens/s with the KV cache, peak RSS and samples from
the fixed prompts. Each variant is measured in a process of its own, one after the other (forked from one
measuring server that imports torch and onnxruntime once, tasks/engine/measure.py), so its peak RSS is its own and
no two measurements share the cores. Speeds are then timed in one more
process that holds every variant and visits them in turn, round after round (best of
SPEED_ROUNDS, or with ``eval.speed_seconds`` as many from MIN_SPEED_ROUNDS up as fit), so machine
noise cannot favour whichever variant happened to run in a quiet spell. Variants that run the same
computation (the pruned and the recovered model) are timed once. The measuring processes' progress
lines reach the log as they come.

Outputs: ``variants.json``, ``report.md``, ``quality_vs_size_speed.png``; in MLflow the
metrics (``<variant>/<metric>``), a table and the files; in Prefect a table and the report.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.context import TaskRunContext

from cpuforge.models import llama_cpp_runtime
from cpuforge.models.fileio import atomic_write_json, atomic_write_text
from cpuforge.tasks import stages
from cpuforge.tasks.config.settings import EvalConfig
from cpuforge.tasks.engine.data import corpus_prompts, open_shards
from cpuforge.tasks.engine.hardware import available_cores
from cpuforge.tasks.engine.llama_cpp_measure import PASSES
from cpuforge.tasks.engine.measure import MeasuringProcess
from cpuforge.tasks.infra import live, tracking
from cpuforge.tasks.infra.stage import StageOutput, StageRun
from cpuforge.tasks.infra.store import StageRecord
from cpuforge.tasks.release.reports import SAMPLE_SEED

log = logging.getLogger("cpuforge.evaluate")

SPEC = stages.EVALUATE
SPEED_ROUNDS = 5
MIN_SPEED_ROUNDS = 2  # with eval.speed_seconds: rounds past this start only while the time allows
BASELINE, FINAL = stages.BASELINE_VARIANT, stages.FINAL_VARIANT
GGUF_VARIANTS = {"gguf-q8_0": "gguf_q8_0", "gguf-q4_0": "gguf_q4_0"}  # variant -> the gguf stage's output
SUMMARY_KEYS = ("variant", "format", "params", "file_bytes", "val_bpb", "ppl", "prefill_tok_s",
                "prefill_tok_s_by_batch", "decode_tok_s", "peak_rss_mb")


def variant_paths(inputs: dict[str, StageRecord]) -> dict[str, Path]:
    """Every model variant to measure, in pipeline order: the output each model-making stage declares
    in the registry (StageSpec.evaluates)."""
    paths = {}
    for name in SPEC.needs:
        if (declared := stages.BY_NAME[name].evaluates) is not None:
            variant, output = declared
            paths[variant] = inputs[name].path(output)
    return paths


def gguf_paths(inputs: dict[str, StageRecord]) -> dict[str, Path]:
    """The gguf stage's quantized files, as variants measured in llama.cpp."""
    if "gguf" not in inputs:
        return {}
    return {variant: inputs["gguf"].path(output) for variant, output in GGUF_VARIANTS.items()}


def work(run: StageRun, eval: EvalConfig) -> StageOutput:  # noqa: A002 (the section's name)
    return evaluate(eval, run.inputs["tokenize"], variant_paths(run.inputs), run.out_dir, run.run_id, run.report,
                    gguf_paths(run.inputs))


def evaluate(e: EvalConfig, tokenized: StageRecord, paths: dict[str, Path], out_dir: Path, run_id: str,
             report: live.Report = live.nothing, ggufs: dict[str, Path] | None = None) -> StageOutput:
    """Every variant measured alike; ``report(fraction, headline)`` follows it variant by variant
    (the speed rounds over all of them count as one more). GGUF files (`ggufs`) are measured in llama.cpp
    after the rest where it is installed; where it is not, the report says so."""
    started = time.perf_counter()
    prompts = e.prompts or corpus_prompts(open_shards(Path(tokenized.output_dir), 0))
    missing = llama_cpp_runtime.missing() if ggufs else None
    with MeasuringProcess() as measurer:
        variants = measure_variants(e, tokenized, paths, prompts, report, measurer)
        if ggufs and not missing:
            variants += measure_ggufs(e, tokenized, ggufs, prompts, measurer)
    llama_cpp_note = ""
    if ggufs and missing:
        log.info("the GGUF files are not measured: %s", missing)
        llama_cpp_note = f"{', '.join(ggufs)} not measured: {missing}"
    elif ggufs:
        llama_cpp_note = (f"{', '.join(ggufs)} run in llama.cpp ({llama_cpp_runtime.version()}), each in a process "
                          f"of its own after the others: prefill at batch 1 only, each speed the best of {PASSES} passes")
    metrics = evaluate_metrics(variants, e.batch_sizes)

    atomic_write_json(out_dir / "variants.json", variants)
    atomic_write_text(out_dir / "report.md", report_markdown(variants, metrics, e.batch_sizes, llama_cpp_note))
    atomic_write_text(out_dir / "samples.txt", samples_text(variants))
    plot_variants(variants, out_dir / "quality_vs_size_speed.png", e.batch_sizes[0])
    tracking.log_table(run_id, table_rows(variants), "variants_table.json")
    metrics["seconds"] = round(time.perf_counter() - started, 2)
    log.info("final model (%s): %.1fx smaller than the pretrained fp32 model, %.2fx its prefill speed (batch %s), "
             "bits per byte %.4f vs %.4f (%+.1f%%)", FINAL, metrics["size_ratio"],
             metrics[f"prefill_speedup_b{e.batch_sizes[0]}"], e.batch_sizes[0], metrics["final_val_bpb"],
             metrics["baseline_val_bpb"], metrics["bpb_increase_pct"])
    return StageOutput(
        metrics=metrics,
        files={"variants": "variants.json", "report": "report.md", "samples": "samples.txt",
               "plot": "quality_vs_size_speed.png"},
        artifacts=["variants.json", "report.md", "samples.txt", "quality_vs_size_speed.png"],
        summary={"variants": [{k: v[k] for k in SUMMARY_KEYS} for v in variants], "sample_prompts": prompts},
        info={"final_model": str(paths[FINAL])},
    )


def measure_variants(e: EvalConfig, tokenized: StageRecord, paths: dict[str, Path], prompts: list[str],
                     report: live.Report, measurer: MeasuringProcess) -> list[dict[str, Any]]:
    """Each variant's quality, size and samples in a process of its own, then the speeds of all of
    them in one process, timed in alternation."""
    variants: list[dict[str, Any]] = []
    steps = len(paths) + 1

    def scored() -> dict[str, float]:
        return {f"{v['variant']} val bits per byte": v["val_bpb"] for v in variants}

    def follow(phase: str, fraction: float) -> Callable[[str], None]:
        def line(text: str) -> None:
            log.info("%s: %s", phase, text)
            report(fraction, {"phase": f"{phase}: {text}", **scored()})
        return line

    for i, (name, path) in enumerate(paths.items()):
        report(i / steps, {"phase": f"measuring {name}", **scored()}, force=i == 0)
        result = measurer.measure(
            name, follow(name, i / steps), model_path=str(path), tokenize_dir=tokenized.output_dir,
            max_tokens=e.max_tokens, batch_sizes=e.batch_sizes, prompts=prompts, max_new_tokens=e.max_new_tokens,
            threads=available_cores(), seed=SAMPLE_SEED)
        variants.append({"variant": name, **result})
        log.info("%s: bits per byte %.4f on %s tokens", name, result["val_bpb"], f"{result['val_tokens']:,}")
    report(len(paths) / steps, {"phase": "timing every variant in alternation", **scored()})
    capped = e.speed_seconds is not None
    log.info("timing every variant in alternation: %s", f"{MIN_SPEED_ROUNDS}-{SPEED_ROUNDS} rounds within "
             f"eval.speed_seconds={e.speed_seconds:g}" if capped else f"{SPEED_ROUNDS} rounds")
    speeds = measurer.measure(
        "speeds", follow("speeds", len(paths) / steps), speeds=True,
        model_paths={name: str(path) for name, path in paths.items()}, batch_sizes=e.batch_sizes,
        decode_tokens=e.decode_tokens, threads=available_cores(), rounds=SPEED_ROUNDS,
        min_rounds=MIN_SPEED_ROUNDS if capped else SPEED_ROUNDS, seconds=e.speed_seconds)
    for v in variants:
        v.update(speeds[v["variant"]])
        log_row(v, f" (timed as {v['timed_as']})" if v.get("timed_as") else "")
    return variants


def log_row(v: dict[str, Any], note: str = "") -> None:
    """One variant's figures as a line of the log."""
    log.info("%-10s %9s params %8.2f MB  bpb %.4f  prefill %8.0f tok/s  decode %6.0f tok/s  rss %5.0f MB%s",
             v["variant"], f"{v['params']:,}", v["file_bytes"] / 1e6, v["val_bpb"], v["prefill_tok_s"],
             v["decode_tok_s"], v["peak_rss_mb"], note)


def measure_ggufs(e: EvalConfig, tokenized: StageRecord, ggufs: dict[str, Path], prompts: list[str],
                  measurer: MeasuringProcess) -> list[dict[str, Any]]:
    """Each GGUF file in llama.cpp, in a process of its own (tasks/engine/llama_cpp_measure.py)."""
    measured = []
    for name, path in ggufs.items():
        result = measurer.measure(
            name, lambda line, name=name: log.info("%s: %s", name, line), gguf=True, model_path=str(path),
            tokenize_dir=tokenized.output_dir, max_tokens=e.max_tokens, prompts=prompts,
            max_new_tokens=e.max_new_tokens, decode_tokens=e.decode_tokens, threads=available_cores(), seed=SAMPLE_SEED)
        measured.append({"variant": name, **result})
        log_row(measured[-1], " (llama.cpp)")
    return measured


def evaluate_metrics(variants: list[dict[str, Any]], batch_sizes: list[int]) -> dict[str, float | int]:
    """The final variant against the baseline first (the run table shows the first few), then every
    variant's figures by name; "seconds" is filled in when the stage ends."""
    by_name = {v["variant"]: v for v in variants}
    base, final = by_name[BASELINE], by_name[FINAL]
    speedups = {f"prefill_speedup_b{b}": round(final["prefill_tok_s_by_batch"][str(b)]
                                               / base["prefill_tok_s_by_batch"][str(b)], 3) for b in batch_sizes}
    metrics: dict[str, float | int] = {  # headline figures first: the run table shows the first few
        "final_val_bpb": final["val_bpb"], "baseline_val_bpb": base["val_bpb"],
        "bpb_increase_pct": round(100 * (final["val_bpb"] / base["val_bpb"] - 1), 3),
        "size_ratio": round(base["file_bytes"] / final["file_bytes"], 3), **speedups,
        "decode_speedup": round(final["decode_tok_s"] / base["decode_tok_s"], 3),
        "final_ppl": final["ppl"], "final_file_bytes": final["file_bytes"],
        "val_tokens": final["val_tokens"], "seconds": 0.0,
    }
    for v in variants:
        for key in ("val_bpb", "ppl", "params", "file_bytes", "decode_tok_s", "peak_rss_mb"):
            metrics[f"{v['variant']}/{key}"] = v[key]
        for b, speed in v["prefill_tok_s_by_batch"].items():
            metrics[f"{v['variant']}/prefill_tok_s_b{b}"] = speed
    return metrics


def table_rows(variants: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for v in variants:
        row = {k: v[k] for k in ("variant", "format", "params", "file_bytes", "val_bpb", "ppl", "decode_tok_s",
                                 "peak_rss_mb")}
        row.update({f"prefill_tok_s_b{b}": s for b, s in v["prefill_tok_s_by_batch"].items()})
        rows.append(row)
    return rows


def samples_text(variants: list[dict[str, Any]]) -> str:
    """Every variant's samples from the fixed prompts (temperature 0.8, top-k 40, one seed for all)."""
    parts = []
    for v in variants:
        for prompt, text in v["samples"].items():
            parts.append(f"=== {v['variant']}, prompt: {prompt!r}\n{text}\n")
    return "\n".join(parts)


def report_markdown(variants: list[dict[str, Any]], metrics: dict[str, Any], batch_sizes: list[int],
                    llama_cpp_note: str = "") -> str:
    b0 = batch_sizes[0]
    prefill_cols = " | ".join(f"prefill tok/s b{b}" for b in batch_sizes)
    lines = [
        "## cpuforge evaluation",
        "",
        f"Final model **{FINAL}** against the pretrained fp32 model: **{metrics['size_ratio']:.1f}x smaller**, "
        f"**{metrics[f'prefill_speedup_b{b0}']:.2f}x** prefill tokens/s at batch {b0}, "
        f"**{metrics['decode_speedup']:.2f}x** decode tokens/s, bits per byte {metrics['final_val_bpb']:.4f} vs "
        f"{metrics['baseline_val_bpb']:.4f} ({metrics['bpb_increase_pct']:+.1f}%). "
        f"All on the same {metrics['val_tokens']:,} validation tokens.",
        "",
        f"| variant | format | params | file MB | bits/byte | perplexity | {prefill_cols} | decode tok/s | peak RSS MB |",
        "|---|---|---|---|---|---|" + "---|" * len(batch_sizes) + "---|---|",
    ]
    for v in variants:
        by_batch = v["prefill_tok_s_by_batch"]
        speeds = " | ".join(f"{by_batch[str(b)]:,.0f}" if str(b) in by_batch else "-" for b in batch_sizes)
        lines.append(f"| {v['variant']} | {v['format']} | {v['params']:,} | {v['file_bytes'] / 1e6:.2f} | "
                     f"{v['val_bpb']:.4f} | {v['ppl']:.2f} | {speeds} | {v['decode_tok_s']:,.0f} | {v['peak_rss_mb']:,.0f} |")
    shared = [f"{v['variant']} runs the same computation as {v['timed_as']} (format, shapes, file size): its speeds "
              "are that model's, timed once" for v in variants if v.get("timed_as")]
    notes = shared + ([llama_cpp_note] if llama_cpp_note else [])
    if notes:
        lines += [""] + [f"- {line}" for line in notes]
    lines += ["", "### Samples (temperature 0.8, top-k 40, same seed for every variant)", ""]
    for v in variants:
        lines.append(f"**{v['variant']}**")
        lines.append("")
        for text in v["samples"].values():
            lines += ["```", text.strip("\n"), "```"]
        lines.append("")
    return "\n".join(lines)


def plot_variants(variants: list[dict[str, Any]], path: Path, batch: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    fig, (size_ax, speed_ax) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    markers = "osD^v<>"
    for i, v in enumerate(variants):  # one colour and marker per variant, same in both panels
        style = dict(s=60, marker=markers[i % len(markers)], color=f"C{i}", label=v["variant"])
        size_ax.scatter(v["file_bytes"] / 1e6, v["val_bpb"], **style)
        speed_ax.scatter(v["prefill_tok_s"], v["val_bpb"], **style)
    size_ax.set_xscale("log")
    size_ax.xaxis.set_major_formatter(ScalarFormatter())
    size_ax.xaxis.set_minor_formatter(ScalarFormatter())
    size_ax.legend(fontsize=8)
    size_ax.set_xlabel("file size (MB, log scale)")
    speed_ax.set_xlabel(f"prefill tokens/s (batch {batch}, full context)")
    size_ax.set_ylabel("validation bits per byte (lower is better)")
    fig.suptitle("Quality against size and speed of every variant")
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def publish(record: StageRecord) -> None:
    """In Prefect: the variants as a table and the report as markdown (the UI's artifacts tab)."""
    if TaskRunContext.get() is None:
        return
    create_table_artifact(key="cpuforge-evaluation", table=table_rows(record.summary["variants"]),
                          description="cpuforge: every variant on the same validation tokens")
    create_markdown_artifact(key="cpuforge-report", markdown=record.path("report").read_text(),
                             description="cpuforge: the evaluation report")

"""One cpuforge model, two runtimes, two precisions: cpuforge's int8 and int4 ONNX next to llama.cpp running the
same recovered weights as Q8_0 and Q4_0 GGUF.

    cpuforge run --profile demo --summary demo.json          # or compress --pretrained hf:DIR ... --summary
    pip install 'cpuforge[bench]'     # llama-cpp-python: builds llama.cpp from source (about 6 minutes on 2 cores)
    python benchmarks/vs_llamacpp.py demo.json [--rounds 3] [--json vs_llamacpp.json]

Pairs, each made from the recovered model:
- 8-bit: quantize's kept model.int8.onnx when it is 8-bit (else its genai-int8-b64 candidate) against the gguf
  stage's model-q8_0.gguf;
- 4-bit: quantize's genai-int4-head8 candidate (MatMulNBits, blocks of 32, the head 8-bit: Q4_0's mix), or
  genai-int4 (the head 4-bit too) in a run without it, against model-q4_0.gguf (Q4_0, blocks of 32, the logits'
  matrix Q8_0).
Every model sees the same validation tokens in the same windows (scoring.score_tokens's; llama.cpp tokenizes as
cpuforge does, tests/test_gguf.py) with the same number of threads:
- bits per byte: consecutive full-context windows, each from an empty cache;
- prefill tokens/s: one full-context sequence at batch 1, the best of 3 passes after a warm-up;
- decode tokens/s: greedy at batch 1 with the KV cache after a 16-token prompt, the best of 3 runs.
Each measurement runs in a fresh process holding one model (two runtimes' thread pools in one process spin
against each other on a small machine), the four models in rotation round after round; each figure is the best
round (noise on a shared machine only ever slows a round down). The ratios of each round's pair of figures say
whether a lead is settled (every round on the same side of the goal) or within the noise. Goal: cpuforge decodes
>= 1.2x and prefills >= 1.0x llama.cpp in both pairs, at equal or better bits per byte.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from cpuforge.models.checkpoint import read_config
from cpuforge.tasks.config.settings import load_config
from cpuforge.tasks.engine.data import bits_per_byte, open_shards, token_byte_lengths
from cpuforge.tasks.engine.hardware import available_cores, cpu_model, int8_dot_product

PROMPT_LEN = 16  # as scoring.decode_tokens_per_s
PAIRS = ("8-bit", "4-bit")


# --- child mode: one model in this process -------------------------------------------------------------

def onnx_child(path: Path, job: dict) -> dict:
    import torch

    from cpuforge.models.runtime import load_language_model
    from cpuforge.tasks.engine.scoring import decode_tokens_per_s, prefill_tokens_per_s, score_tokens

    torch.set_num_threads(job["threads"])
    lm = load_language_model(path, threads=job["threads"])
    if job["mode"] == "score":
        score = score_tokens(lm, np.load(job["tokens"]), np.load(job["byte_lengths"]))
        return {"val_bpb": score.val_bpb, "val_tokens": score.tokens}
    return {"prefill_tok_s": prefill_tokens_per_s(lm, batch=1, repeats=3),
            "decode_tok_s": decode_tokens_per_s(lm, job["decode_tokens"], PROMPT_LEN)}


def gguf_child(path: Path, job: dict) -> dict:
    from cpuforge.models.llama_cpp_runtime import LlamaCppModel

    block, threads = job["block"], job["threads"]
    plain = int8_dot_product() == "amx_int8"  # see LlamaCppModel
    if job["mode"] == "score":
        llm = LlamaCppModel(path, block, threads, logits_all=True, plain_buffers=plain)
        nll, n_bytes, n_tokens = llm.nll(np.load(job["tokens"]), np.load(job["byte_lengths"]))
        return {"val_bpb": round(bits_per_byte(nll, n_bytes), 5), "val_tokens": n_tokens}
    prefill, decode = LlamaCppModel(path, block, threads, plain_buffers=plain).best_speeds(job["decode_tokens"])
    return {"prefill_tok_s": prefill, "decode_tok_s": decode}


# --- parent: rotate fresh processes ----------------------------------------------------------------------

def run_child(kind: str, path: Path, job: dict, scratch: Path) -> dict:
    job_file = scratch / "job.json"
    job_file.write_text(json.dumps(job))
    out = subprocess.run([sys.executable, __file__, "--child", kind, str(path), str(job_file)],
                         capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"measuring {path.name} ({kind}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def models_of(stages: dict) -> dict[tuple[str, str], Path]:
    """{(pair, runtime): file} from a run's stages."""
    quantized, gguf = Path(stages["quantize"]["output_dir"]), Path(stages["gguf"]["output_dir"])
    eight = (quantized / "model.int8.onnx" if stages["quantize"]["metrics"].get("weight_bits", 8) == 8
             else quantized / "candidates" / "genai-int8-b64.onnx")
    head8 = quantized / "candidates" / "genai-int4-head8.onnx"  # Q4_0's mix; runs before it had none
    four = head8 if head8.exists() else quantized / "candidates" / "genai-int4.onnx"
    files = {("8-bit", "cpuforge"): eight, ("8-bit", "llama.cpp"): gguf / "model-q8_0.gguf",
             ("4-bit", "cpuforge"): four,
             ("4-bit", "llama.cpp"): gguf / "model-q4_0.gguf"}
    absent = [str(path) for path in files.values() if not path.exists()]
    if absent:
        raise SystemExit(f"not in this run: {', '.join(absent)} (quantize.method=best makes the genai candidates)")
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("summary", nargs="?", help="summary JSON of a cpuforge run that went through quantize and gguf")
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds (a process per model each)")
    parser.add_argument("--json", default="vs_llamacpp.json", help="where to write the results")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)  # child mode: KIND MODEL JOB.json
    args = parser.parse_args()
    if args.child:
        kind, path, job = args.child
        result = (onnx_child if kind == "cpuforge" else gguf_child)(Path(path), json.loads(Path(job).read_text()))
        print(json.dumps(result))
        return
    if not args.summary:
        parser.error("give the summary JSON of a cpuforge run")

    summary = json.loads(Path(args.summary).read_text())
    stages = summary["stages"]
    missing = {"quantize", "gguf"} - set(stages)
    if missing:
        parser.error(f"the run has no {' or '.join(sorted(missing))} stage: run the pipeline through it first")
    cfg = load_config(config_file=Path(summary["run_dir"]) / "config.yaml")
    files = models_of(stages)
    shards = open_shards(Path(stages["tokenize"]["output_dir"]), 2)
    block = read_config(Path(stages["recover"]["output_dir"]) / "model").block_size
    threads = available_cores()

    with tempfile.TemporaryDirectory(prefix="vs-llamacpp-") as tmp:
        scratch = Path(tmp)
        np.save(scratch / "tokens.npy", np.asarray(shards.val[: cfg.eval.max_tokens + 1], dtype=np.int64))
        np.save(scratch / "lengths.npy", token_byte_lengths(shards.tokenizer_path))
        job = {"threads": threads, "block": block, "decode_tokens": cfg.eval.decode_tokens,
               "tokens": str(scratch / "tokens.npy"), "byte_lengths": str(scratch / "lengths.npy")}
        rows = {key: {"file_mb": round(path.stat().st_size / 1e6, 3),
                      **run_child(key[1], path, {**job, "mode": "score"}, scratch)} for key, path in files.items()}
        order = list(files)
        for round_ in range(args.rounds):
            shift = round_ % len(order)  # who runs first rotates
            for key in order[shift:] + order[:shift]:
                timing = run_child(key[1], files[key], {**job, "mode": "time"}, scratch)
                for name, value in timing.items():
                    rows[key][name] = round(max(rows[key].get(name, 0.0), value), 1)
                    rows[key].setdefault("rounds", {}).setdefault(name, []).append(round(value, 1))

    print(f"CPU: {cpu_model()}, {threads} threads, int8 dot product: {int8_dot_product()}; context {block}, "
          f"{rows[order[0]]['val_tokens']:,} val tokens, best of {args.rounds} rounds")
    result = {"cpu": cpu_model(), "threads": threads, "int8_dot_product": int8_dot_product(), "context": block,
              "rounds": args.rounds, "run_id": summary.get("run_id"), "pairs": {}}
    for pair in PAIRS:
        ours, theirs = rows[(pair, "cpuforge")], rows[(pair, "llama.cpp")]
        ratios = {"decode": round(ours["decode_tok_s"] / theirs["decode_tok_s"], 3),
                  "prefill": round(ours["prefill_tok_s"] / theirs["prefill_tok_s"], 3),
                  "bpb": round(ours["val_bpb"] / theirs["val_bpb"], 4),
                  "file": round(ours["file_mb"] / theirs["file_mb"], 3)}
        print(f"\n{pair}: cpuforge {files[(pair, 'cpuforge')].name} vs llama.cpp {files[(pair, 'llama.cpp')].name}")
        print(f"{'':28s}{'cpuforge':>14s}{'llama.cpp':>14s}{'cpuforge / llama.cpp':>24s}")
        for key, label, ratio in (("val_bpb", "bits per byte", "bpb"),
                                  ("prefill_tok_s", f"prefill tok/s (b1, T={block})", "prefill"),
                                  ("decode_tok_s", "decode tok/s (b1)", "decode"), ("file_mb", "file MB", "file")):
            print(f"{label:28s}{ours[key]:>14,}{theirs[key]:>14,}{ratios[ratio]:>24}")
        # The two runtimes' figures from the same round were measured minutes apart at most: their ratio, round by
        # round, shows whether a lead outlasts the machine's noise (settled: every round on the same side of the goal).
        per_round = {measure: [round(a / b, 3) for a, b in zip(ours["rounds"][f"{measure}_tok_s"],
                                                                theirs["rounds"][f"{measure}_tok_s"])]
                     for measure in ("prefill", "decode")}
        for measure, target in (("prefill", 1.0), ("decode", 1.2)):
            low, high = min(per_round[measure]), max(per_round[measure])
            verdict = "settled" if low >= target or high < target else "unsettled"
            print(f"{measure} ratio round by round: {low}-{high} ({verdict} against {target}x)")
        goal = ratios["decode"] >= 1.2 and ratios["prefill"] >= 1.0 and ours["val_bpb"] <= theirs["val_bpb"]
        print(f"goal (decode >= 1.2x, prefill >= 1.0x, bits per byte no worse): {'met' if goal else 'not met'}")
        result["pairs"][pair] = {"cpuforge": {"path": str(files[(pair, "cpuforge")]), **ours},
                                 "llama.cpp": {"path": str(files[(pair, "llama.cpp")]), **theirs},
                                 "cpuforge_over_llamacpp": ratios, "ratios_by_round": per_round, "goal_met": goal}
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwritten to {args.json}")


if __name__ == "__main__":
    main()

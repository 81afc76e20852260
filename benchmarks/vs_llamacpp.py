"""One cpuforge model, two runtimes: cpuforge's final int8 ONNX next to llama.cpp running it as Q8_0 GGUF.

    cpuforge run --profile demo --summary demo.json
    pip install llama-cpp-python     # builds llama.cpp from source (about 6 minutes on 2 cores)
    python benchmarks/vs_llamacpp.py demo.json [--rounds 3] [--json vs_llamacpp.json]

cpuforge: the quantize stage's model.int8.onnx in onnxruntime (models/runtime.py). llama.cpp: the gguf
stage's model-q8_0.gguf (8-bit weights as well) through llama-cpp-python. Both see the same validation
tokens (the run's val shard; llama.cpp tokenizes as cpuforge does, tests/test_gguf.py), with the same
number of threads:
- bits per byte: consecutive full-context windows, each from an empty cache (scoring.score_tokens's windows);
- prefill tokens/s: one full-context sequence at batch 1, the best of 3 passes after a warm-up;
- decode tokens/s: greedy at batch 1 with the KV cache after a 16-token prompt, the best of 3 runs.
Each measurement runs in a fresh process holding one model (two runtimes' thread pools in one process
spin against each other on a small machine), the two alternating round after round; each figure is the
best round (noise on a shared machine only ever slows a round down).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from cpuforge.models.checkpoint import read_config
from cpuforge.tasks.config.settings import load_config
from cpuforge.tasks.engine.data import bits_per_byte, open_shards, token_byte_lengths
from cpuforge.tasks.engine.hardware import available_cores, cpu_model, int8_dot_product

PROMPT_LEN = 16  # as scoring.decode_tokens_per_s
NAMES = {"onnx": "cpuforge int8 ONNX", "gguf": "llama.cpp Q8_0 GGUF"}


# --- child mode: one model in this process -------------------------------------------------------------

def nll_sum(logits: np.ndarray, targets: np.ndarray) -> float:
    """Summed negative log-likelihood in float64, as scoring does it."""
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    return float((np.log(np.exp(z).sum(axis=-1)) - np.take_along_axis(z, targets[:, None], axis=-1)[:, 0]).sum())


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
    import llama_cpp

    block, threads = job["block"], job["threads"]
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=block, n_batch=block, n_ubatch=block, n_threads=threads,
                          n_threads_batch=threads, logits_all=job["mode"] == "score", verbose=False)
    if job["mode"] == "score":
        tokens, lengths = np.load(job["tokens"]), np.load(job["byte_lengths"])
        nll, n_bytes, n_tokens = 0.0, 0, 0
        for start in range(0, len(tokens) - 1, block):  # the windows score_tokens uses
            x, y = tokens[start:start + block], tokens[start + 1:start + block + 1]
            x = x[:len(y)]
            llm.reset()
            llm.eval(x.tolist())
            nll += nll_sum(np.asarray(llm.scores[:len(x)]), y)
            n_bytes += int(lengths[y].sum())
            n_tokens += len(y)
        return {"val_bpb": round(bits_per_byte(nll, n_bytes), 5), "val_tokens": n_tokens}

    ids = np.random.default_rng(0).integers(0, llm.n_vocab(), size=block).tolist()  # scoring._prefill_ids's draw

    def next_token() -> int:  # without logits_all, llama-cpp-python keeps no scores: read the last row directly
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))))

    def prefill() -> float:
        llm.reset()
        started = time.perf_counter()
        llm.eval(ids)
        return time.perf_counter() - started

    def decode() -> float:
        """Seconds per greedy token with the KV cache, prefill excluded (as scoring._timed_decode)."""
        n = min(job["decode_tokens"], block - PROMPT_LEN - 1)
        llm.reset()
        llm.eval(list(range(1, PROMPT_LEN + 1)))
        token = next_token()
        started = time.perf_counter()
        for _ in range(n - 1):
            llm.eval([token])
            token = next_token()
        return (time.perf_counter() - started) / max(1, n - 1)

    prefill(), decode()  # warm-up
    return {"prefill_tok_s": block / min(prefill() for _ in range(3)),
            "decode_tok_s": 1.0 / min(decode() for _ in range(3))}


# --- parent: alternate fresh processes ------------------------------------------------------------------

def run_child(kind: str, path: Path, job: dict, scratch: Path) -> dict:
    job_file = scratch / "job.json"
    job_file.write_text(json.dumps(job))
    out = subprocess.run([sys.executable, __file__, "--child", kind, str(path), str(job_file)],
                         capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"the {NAMES[kind]} process failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("summary", nargs="?", help="summary JSON of a cpuforge run that went through quantize and gguf")
    parser.add_argument("--rounds", type=int, default=3, help="alternating timing rounds (a process per model each)")
    parser.add_argument("--json", default="vs_llamacpp.json", help="where to write the results")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)  # child mode: KIND MODEL JOB.json
    args = parser.parse_args()
    if args.child:
        kind, path, job = args.child
        result = (onnx_child if kind == "onnx" else gguf_child)(Path(path), json.loads(Path(job).read_text()))
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
    paths = {"onnx": Path(stages["quantize"]["output_dir"]) / "model.int8.onnx",
             "gguf": Path(stages["gguf"]["output_dir"]) / "model-q8_0.gguf"}
    shards = open_shards(Path(stages["tokenize"]["output_dir"]), 2)
    block = read_config(Path(stages["recover"]["output_dir"]) / "model").block_size
    threads = available_cores()

    with tempfile.TemporaryDirectory(prefix="vs-llamacpp-") as tmp:
        scratch = Path(tmp)
        np.save(scratch / "tokens.npy", np.asarray(shards.val[: cfg.eval.max_tokens + 1], dtype=np.int64))
        np.save(scratch / "lengths.npy", token_byte_lengths(shards.tokenizer_path))
        job = {"threads": threads, "block": block, "decode_tokens": cfg.eval.decode_tokens,
               "tokens": str(scratch / "tokens.npy"), "byte_lengths": str(scratch / "lengths.npy")}
        rows = {kind: {"file_mb": round(path.stat().st_size / 1e6, 3),
                       **run_child(kind, path, {**job, "mode": "score"}, scratch)} for kind, path in paths.items()}
        kinds = list(paths)
        for round_ in range(args.rounds):
            for kind in kinds[round_ % 2:] + kinds[:round_ % 2]:  # the first to run alternates
                timing = run_child(kind, paths[kind], {**job, "mode": "time"}, scratch)
                for key, value in timing.items():
                    rows[kind][key] = round(max(rows[kind].get(key, 0.0), value), 1)

    ours, theirs = rows["onnx"], rows["gguf"]
    ratios = {"prefill_llamacpp_over_cpuforge": round(theirs["prefill_tok_s"] / ours["prefill_tok_s"], 3),
              "decode_llamacpp_over_cpuforge": round(theirs["decode_tok_s"] / ours["decode_tok_s"], 3),
              "bpb_llamacpp_over_cpuforge": round(theirs["val_bpb"] / ours["val_bpb"], 4),
              "file_llamacpp_over_cpuforge": round(theirs["file_mb"] / ours["file_mb"], 3)}
    print(f"CPU: {cpu_model()}, {threads} threads, int8 dot product: {int8_dot_product()}; context {block}, "
          f"{ours['val_tokens']:,} val tokens, best of {args.rounds} alternating rounds")
    header = f"{'':28s}{NAMES['onnx']:>22s}{NAMES['gguf']:>22s}{'llama.cpp / cpuforge':>22s}"
    print(header)
    for key, label, ratio in (("val_bpb", "bits per byte", "bpb"), ("prefill_tok_s", f"prefill tok/s (b1, T={block})",
                              "prefill"), ("decode_tok_s", "decode tok/s (b1)", "decode"), ("file_mb", "file MB", "file")):
        print(f"{label:28s}{ours[key]:>22,}{theirs[key]:>22,}{ratios[f'{ratio}_llamacpp_over_cpuforge']:>22}")
    result = {"cpu": cpu_model(), "threads": threads, "context": block, "rounds": args.rounds,
              "run_id": summary.get("run_id"), "models": {NAMES[k]: {"path": str(paths[k]), **rows[k]} for k in kinds},
              "ratios": ratios}
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {args.json}")


if __name__ == "__main__":
    main()

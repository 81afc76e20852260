"""Global unstructured L1 magnitude pruning (torch.nn.utils.prune) next to cpuforge's structured
pruning at the same sparsity: bits per byte and CPU speed of each, in one run.

    cpuforge run --summary demo.json
    python benchmarks/unstructured_vs_structured.py demo.json

Both start from the run's pretrained model. Structured: the prune stage's output (heads, channels
and layers removed; before recovery) and the recovered model. Unstructured: the same number of
weights zeroed by global L1 magnitude over every weight matrix (embedding included, as structured
pruning shrinks it too), one shot, like the structured model before recovery. All are scored on
the same val batches and timed on the same prefill batches, fp32, eager PyTorch, dense kernels.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.nn.utils import prune

from cpuforge.models.checkpoint import load_model
from cpuforge.models.llama import Llama
from cpuforge.tasks.config.settings import load_config
from cpuforge.tasks.engine.data import open_shards, token_byte_lengths, val_batches
from cpuforge.tasks.engine.hardware import available_cores
from cpuforge.tasks.engine.validation import evaluate


def weight_matrices(model: Llama) -> list[tuple[torch.nn.Module, str]]:
    modules = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))]
    seen, out = set(), []
    for m in modules:  # a tied LM head shares the embedding's tensor: prune it once
        if id(m.weight) not in seen:
            seen.add(id(m.weight))
            out.append((m, "weight"))
    return out


def unstructured_l1(model: Llama, n_zeros: int) -> Llama:
    params = weight_matrices(model)
    prune.global_unstructured(params, pruning_method=prune.L1Unstructured, amount=n_zeros)
    for module, name in params:
        prune.remove(module, name)  # make the zeros permanent (a plain dense tensor again)
    return model


def nonzero(model: Llama) -> int:
    return sum(int(t.count_nonzero()) for t in {id(p): p for p in model.parameters()}.values())


def prefill_tok_s(model: Llama, batch: int, block: int, vocab: int, repeats: int = 5) -> float:
    x = torch.randint(0, vocab, (batch, block))
    best = float("inf")
    with torch.no_grad():
        model(x)  # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(x)
            best = min(best, time.perf_counter() - t0)
    return batch * block / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("summary", help="summary JSON of a cpuforge run that went through recover")
    args = parser.parse_args()

    torch.set_num_threads(available_cores())
    summary = json.loads(Path(args.summary).read_text())
    stages = summary["stages"]
    cfg = load_config(config_file=Path(summary["run_dir"]) / "config.yaml")
    pretrained = load_model(Path(stages["pretrain"]["output_dir"]) / "model")
    structured = load_model(Path(stages["prune"]["output_dir"]) / "model")
    recovered = load_model(Path(stages["recover"]["output_dir"]) / "model")
    removed = nonzero(pretrained) - nonzero(structured)
    unstructured = unstructured_l1(load_model(Path(stages["pretrain"]["output_dir"]) / "model"), removed)

    block = pretrained.cfg.block_size
    shards = open_shards(Path(stages["tokenize"]["output_dir"]), block)
    lengths = token_byte_lengths(shards.tokenizer_path)
    val = val_batches(shards.val, cfg.train.eval_batches, cfg.train.batch_size, block)
    variants = {"unpruned": pretrained, "unstructured L1 (one shot)": unstructured,
                "structured (one shot)": structured, "structured + distillation": recovered}

    rows = []
    for name, model in variants.items():
        model.eval()
        with torch.no_grad():
            _, bpb = evaluate(model, val, lengths)
        speeds = [prefill_tok_s(model, b, block, model.cfg.vocab_size) for b in (1, 8)]
        stored = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        rows.append((name, nonzero(model), stored, bpb, *speeds))

    base = rows[0]
    print(f"sparsity: {removed:,} of {base[1]:,} weights removed ({removed / base[1]:.0%}); {available_cores()} threads")
    print("| variant | nonzero weights | stored weights | val bits/byte | prefill tok/s b1 | b8 | speed vs unpruned (b1) |")
    print("|---|---|---|---|---|---|---|")
    for name, nz, stored, bpb, s1, s8 in rows:
        print(f"| {name} | {nz:,} | {stored:,} | {bpb:.4f} | {s1:,.0f} | {s8:,.0f} | {s1 / base[4]:.2f}x |")


if __name__ == "__main__":
    main()

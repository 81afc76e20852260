"""How high MFU can go at a model's shapes: every matmul of its training step, timed alone.

    python benchmarks/mfu_ceiling.py [--profile demo] [--set model.d_model=384] [--precision auto|fp32|bf16]

MFU divides a step's model FLOPs (models/llama.flops_per_token) by the rate of one big 2048^3
matmul. A small model's matmuls are narrow (the demo's: 192-576 wide over 2,048 tokens, and
64-wide attention heads), and a CPU reaches its peak only on big ones. This times each matmul
the training step does, alone, best of repeats, in the step's precision: per weight the forward
product and backward's two (input and weight gradients), the attention products per head
(QK^T and AV, and their four backward products, over the full T x T as the FLOP count has it),
and the LM head. The MFU of a step that did nothing else is an upper bound for the real step,
which also runs norms, activations, rotary, softmax, the loss, casts and the optimizer.
Issue 15 asks for >= 60% MFU (benchmarks/train_throughput.py measures the real step).
"""

from __future__ import annotations

import argparse
import time

import torch

from cpuforge.models.llama import flops_per_token
from cpuforge.tasks.config.settings import load_config
from cpuforge.tasks.engine.hardware import available_cores, measure_matmul_peak, peak_size
from cpuforge.tasks.engine.step_timing import choose_precision


def best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: first-call allocations and kernel selection
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def products(cfg, batch: int) -> list[tuple[str, int, tuple[int, int, int, int]]]:
    """(name, how many, (g, m, k, n)) of every matmul in one training step: g products of m x k times k x n
    in one batched call (g = 1: a plain matmul)."""
    M, T, hd = batch * cfg.block_size, cfg.block_size, cfg.head_dim
    linears = {"qkv": (cfg.d_model, (cfg.n_head + 2 * cfg.n_kv_head) * hd), "o": (cfg.n_head * hd, cfg.d_model),
               "gate": (cfg.d_model, cfg.d_mlp), "up": (cfg.d_model, cfg.d_mlp), "down": (cfg.d_mlp, cfg.d_model)}
    out = []
    for name, (k, n) in [*linears.items()]:
        out += [(f"{name} fwd", cfg.n_layer, (1, M, k, n)), (f"{name} dX", cfg.n_layer, (1, M, n, k)),
                (f"{name} dW", cfg.n_layer, (1, k, M, n))]
    heads = batch * cfg.n_head  # every head of every sequence in one batched call, as attention runs them
    out += [("QK^T fwd", cfg.n_layer, (heads, T, hd, T)), ("AV fwd", cfg.n_layer, (heads, T, T, hd)),
            # dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q: T*T*hd each
            ("attn bwd (4)", 4 * cfg.n_layer, (heads, T, T, hd))]
    k, n = cfg.d_model, cfg.vocab_size
    out += [("lm head fwd", 1, (1, M, k, n)), ("lm head dX", 1, (1, M, n, k)), ("lm head dW", 1, (1, k, M, n))]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="demo")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=available_cores())
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto")
    args = parser.parse_args()

    run_cfg = load_config(args.profile, overrides=args.overrides)
    cfg = run_cfg.model.or_named("demo").shape(args.vocab_size)  # model.size=auto: demo dims, as train_throughput
    batch = run_cfg.train.batch_size
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, choose_precision(args.precision, cfg, batch, args.threads)["dtype"])
    peak = measure_matmul_peak(args.threads, dtype, peak_size(dtype), seconds=3.0)
    print(f"{cfg.n_layer} layers x d_model {cfg.d_model}, d_mlp {cfg.d_mlp}, {cfg.n_head} heads of {cfg.head_dim}, "
          f"vocab {cfg.vocab_size}; batch {batch} x {cfg.block_size}; {dtype}, {args.threads} threads; "
          f"peak (2048^3) {peak / 1e9:.0f} GFLOP/s")
    total_s = total_flops = 0.0
    for name, count, (g, m, k, n) in products(cfg, batch):
        a, b = torch.randn(g, m, k, dtype=dtype), torch.randn(g, k, n, dtype=dtype)
        seconds = best_seconds(lambda: torch.bmm(a, b) if g > 1 else torch.mm(a[0], b[0]), args.repeats)
        flops = 2 * g * m * k * n
        total_s += count * seconds
        total_flops += count * flops
        print(f"  {name:14s} x{count:<3d} {g:3d} x {m:5d} x {k:5d} x {n:5d}  {flops / seconds / 1e9:6.0f} GFLOP/s "
              f"{flops / seconds / peak:6.1%} of peak")
    step_flops = flops_per_token(cfg) * batch * cfg.block_size
    print(f"matmuls alone: {total_flops / total_s / 1e9:.0f} GFLOP/s, {total_flops / total_s / peak:.1%} of peak")
    print(f"MFU ceiling of the step (its model FLOPs {step_flops / 1e9:.2f} G over the matmuls' time alone): "
          f"{step_flops / total_s / peak:.1%} (issue 15's goal: 60%)")


if __name__ == "__main__":
    main()

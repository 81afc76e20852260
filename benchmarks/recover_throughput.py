"""Recovery's training step at a real shape: tokens per second of one distillation step (the teacher's forward,
the student's forward and backward, the loss, AdamW) with the loss cpuforge trains with (the teacher's hidden
states and both models' logits fused at the student's head, models/distill_head.py) against the same loss written
out over full-vocabulary logits (tasks/engine/losses.reference_distillation_loss), and the student's plain
language-model step for scale. Random weights and tokens: speed only.

Defaults: the teacher is SmolLM2-135M's shape (30 x 576, 9 heads / 3 KV, MLP 1536, vocabulary 49,152, tied),
the student the shape cpuforge's demo prune made of it (22 x 432, head dim 64, MLP 1096), 8 x 256 tokens a step,
bf16 autocast where the CPU has native bf16 (else fp32), the trainer's malloc settings. Each variant's steps
alternate with the others' so that a change in the machine's load reaches all of them; the best round counts,
and the spread between rounds is printed (over ~10%: the machine was not quiet, measure again).

    python benchmarks/recover_throughput.py
    python benchmarks/recover_throughput.py --rounds 5 --dtype float32

MFU counts the step's FLOPs (student forward and backward, teacher forward) against the matmul peak measured
here in the step's precision. Run it alone: a second process on 2 cores halves the figure.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cpuforge.models.config import LlamaConfig
from cpuforge.models.llama import Llama, param_count
from cpuforge.tasks.engine.allocator import keep_freed_memory
from cpuforge.tasks.engine.hardware import cpu_model, has_native_bf16, measure_matmul_peak, peak_size
from cpuforge.tasks.engine.losses import distillation_loss, lm_loss, reference_distillation_loss
from cpuforge.tasks.engine.training_run import training_flops_per_token


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="timed steps per variant, after one warm-up step")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                    help="default: bfloat16 where the CPU has native bf16, else float32")
    ap.add_argument("--student-layers", type=int, default=22)
    ap.add_argument("--student-d-model", type=int, default=432)
    ap.add_argument("--student-mlp", type=int, default=1096)
    args = ap.parse_args()
    keep_freed_memory()
    dtype = getattr(torch, args.dtype or ("bfloat16" if has_native_bf16() else "float32"))

    teacher_cfg = LlamaConfig(vocab_size=49152, n_layer=30, n_head=9, n_kv_head=3, d_model=576, d_mlp=1536,
                              block_size=args.context, tie_embeddings=True)
    student_cfg = LlamaConfig(vocab_size=49152, n_layer=args.student_layers, n_head=9, n_kv_head=3,
                              d_model=args.student_d_model, d_mlp=args.student_mlp, block_size=args.context,
                              tie_embeddings=True, head_dim_override=64)
    torch.manual_seed(0)
    teacher, student = Llama(teacher_cfg).eval(), Llama(student_cfg)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-5, fused=True)
    xy = torch.randint(0, 49152, (args.batch, args.context + 1))
    x, y = xy[:, :-1], xy[:, 1:]
    tokens = x.numel()
    variants = {
        "distillation, fused head loss": distillation_loss(teacher, 2.0, 0.5, 0.5),
        "distillation, full logits (reference)": reference_distillation_loss(teacher, 2.0, 0.5, 0.5),
        "student LM loss only (no teacher)": lambda m, a, b: (lm_loss(m, a, b), {}),
    }

    def step(loss_fn) -> float:
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss = loss_fn(student, x, y)[0]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {name: [] for name in variants}
    for name, fn in variants.items():
        step(fn)  # warm-up
    for _ in range(args.rounds):
        for name, fn in variants.items():
            times[name].append(step(fn))

    peak = measure_matmul_peak(torch.get_num_threads(), dtype, peak_size(dtype))
    print(f"CPU: {cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}, {str(dtype)[6:]}; "
          f"matmul peak {peak / 1e9:.0f} GFLOP/s")
    print(f"teacher {param_count(teacher) / 1e6:.1f}M, student {param_count(student) / 1e6:.1f}M, "
          f"{args.batch} x {args.context} tokens a step, {args.rounds} rounds\n")
    print("| step | best s | tok/s | spread | MFU |\n|---|---|---|---|---|")
    for name, ts in times.items():
        best = min(ts)
        flops = training_flops_per_token(student_cfg, None if "only" in name else teacher_cfg) * tokens
        spread = (statistics.median(ts) - best) / best
        print(f"| {name} | {best:.2f} | {tokens / best:,.0f} | {spread:.0%} | {flops / best / peak:.0%} |")
    fused, ref = (min(times[k]) for k in list(variants)[:2])
    print(f"\nfused / reference: {ref / fused:.2f}x")


if __name__ == "__main__":
    main()

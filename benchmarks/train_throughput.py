"""Training throughput: cpuforge's decoder vs Hugging Face LlamaForCausalLM, side by side.

    pip install -e ".[bench]"
    python benchmarks/train_throughput.py [--profile demo] [--rounds 5] [--steps 3] [--precision auto|fp32|bf16]
                                          [--compile auto|true|false]

Same dimensions, batch, sequence, loss, AdamW, threads and precision; rounds alternate between
the two so machine noise hits both alike; prints median tokens/s of each, the ratio, and MFU
against this machine's measured matmul peak in the precision the steps ran in. --precision auto
(the default) is what the pipeline would pick: the same measured A/B of a training step
(tasks/engine/step_timing.choose_precision; bf16 is not timed on a CPU without native bf16); fp32 or bf16
forces one (bf16 = autocast, as the trainer runs it). --compile (default: the profile's
train.compile, auto) also times cpuforge under torch.compile; with auto the goal line reports the
step the pipeline would train with, compiled only where compile_choice.compile_pays
(>= 1.1x eager; the pipeline measures it in a child process, within the
budget). Both models run under the malloc settings cpuforge trains with (tasks/engine/allocator.py),
which speed transformers' step up more than cpuforge's. Goals (issue 15): ratio >= 1.3, MFU >= 60%.
benchmarks/train_levers.py measures what each lever of the step is worth.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F

from cpuforge.models.config import LlamaConfig
from cpuforge.models.llama import Llama, flops_per_token, param_count
from cpuforge.tasks.config.settings import load_config
from cpuforge.tasks.engine.allocator import keep_freed_memory
from cpuforge.tasks.engine.compile_choice import compile_pays
from cpuforge.tasks.engine.hardware import available_cores, measure_matmul_peak, peak_size
from cpuforge.tasks.engine.step_timing import choose_precision


def hf_model(cfg: LlamaConfig):
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    hf_cfg = HFConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_mlp,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
        max_position_embeddings=cfg.block_size, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, mlp_bias=False,
    )
    return LlamaForCausalLM._from_config(hf_cfg, attn_implementation="sdpa", dtype=torch.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="demo")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per round")
    parser.add_argument("--threads", type=int, default=available_cores())
    parser.add_argument("--compile", nargs="?", const="true", choices=("auto", "true", "false"),
                        help="time cpuforge under torch.compile too (~30 s to compile); default: the profile's "
                             "train.compile. auto: the goal line takes the step the pipeline would pick")
    parser.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                        help="auto: what train.precision=auto picks on this CPU (measured); fp32/bf16: forced")
    args = parser.parse_args()

    keep_freed_memory()  # as the trainer does; for both contenders, since they share this process
    run_cfg = load_config(args.profile, overrides=args.overrides)
    compile_mode = args.compile or str(run_cfg.train.compile).lower()
    cfg = run_cfg.model.or_named("demo").shape(args.vocab_size)  # model.size=auto: demo dims
    B, T = run_cfg.train.batch_size, cfg.block_size
    torch.set_num_threads(args.threads)
    precision = choose_precision(args.precision, cfg, B, args.threads)  # no cache: a benchmark measures afresh
    dtype = getattr(torch, precision["dtype"])
    print(f"precision: {precision['dtype']} ({precision['reason']})")
    torch.manual_seed(0)
    ours, theirs = Llama(cfg), hf_model(cfg)
    print(f"model: {param_count(ours) / 1e6:.2f}M params (HF: {sum(p.numel() for p in theirs.parameters()) / 1e6:.2f}M), "
          f"batch {B} x {T}, {args.threads} threads")

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16) if dtype == torch.bfloat16 else contextlib.nullcontext()

    x = torch.randint(0, cfg.vocab_size, (B, T))
    y = torch.randint(0, cfg.vocab_size, (B, T))

    def loss_ours(m):  # the trainer's loss (trainer.lm_loss): through forward, the LM head in slices
        return m(x, targets=y)[0]

    def loss_hf(m):  # the logits, then the cross-entropy in fp32
        logits = m(input_ids=x).logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))

    contenders = {"cpuforge": (ours, loss_ours), "transformers": (theirs, loss_hf)}
    if compile_mode != "false":
        torch.manual_seed(0)
        compiled = Llama(cfg)
        compiled.compile_forward()  # what train.compile=true does
        contenders["cpuforge+compile"] = (compiled, loss_ours)
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=True) for name, (m, _) in contenders.items()}

    def step(name: str) -> None:
        model, loss_of = contenders[name]
        with autocast():
            loss = loss_of(model)
        loss.backward()
        optimizers[name].step()
        optimizers[name].zero_grad(set_to_none=True)

    peak_before = measure_matmul_peak(args.threads, dtype, peak_size(dtype), seconds=3.0)
    for name in contenders:  # warm-up (and compilation)
        t0 = time.perf_counter()
        step(name)
        step(name)
        if name.endswith("compile"):
            print(f"compile + 2 warm-up steps: {time.perf_counter() - t0:.0f}s")
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.rounds):
        for name in contenders:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(name)
            rates[name].append(args.steps * B * T / (time.perf_counter() - t0))

    # Other load can only make a measurement low: keep the better of two, before and after.
    peak = max(peak_before, measure_matmul_peak(args.threads, dtype, peak_size(dtype), seconds=3.0))
    ours_rate = statistics.median(rates["cpuforge"])
    hf_rate = statistics.median(rates["transformers"])
    print(f"matmul peak ({peak_size(dtype)}^3 {precision['dtype']}, {args.threads} threads): {peak / 1e9:.1f} GFLOP/s")
    print(f"    cpuforge: {ours_rate:8.0f} tokens/s  MFU {ours_rate * flops_per_token(cfg) / peak:.1%}")
    print(f"transformers: {hf_rate:8.0f} tokens/s  MFU {hf_rate * flops_per_token(cfg) / peak:.1%}")
    picked, picked_rate = "cpuforge", ours_rate
    if compile_mode != "false":
        c_rate = statistics.median(rates["cpuforge+compile"])
        print(f"cpuforge+compile: {c_rate:8.0f} tokens/s  MFU {c_rate * flops_per_token(cfg) / peak:.1%}")
        print(f"ratio cpuforge / transformers: {ours_rate / hf_rate:.2f}; cpuforge+compile / transformers: "
              f"{c_rate / hf_rate:.2f}; compiled / eager: {c_rate / ours_rate:.2f}")
        if compile_mode == "true" or compile_pays(ours_rate, c_rate):
            picked, picked_rate = "cpuforge+compile", c_rate
    print(f"the pipeline's step ({picked}, train.compile={compile_mode}): {picked_rate / hf_rate:.2f}x transformers "
          f"(goal >= 1.3), MFU {picked_rate * flops_per_token(cfg) / peak:.1%} (goal >= 60%)")


if __name__ == "__main__":
    main()

"""What each training-step lever is worth: variants of cpuforge's step timed side by side in one process.

    python benchmarks/train_levers.py [--profile demo] [--rounds 8] [--threads 2] [--clock wall|cpu]
                                      [--compile] [--batches 4,16] [--precision auto|fp32|bf16]

Every variant trains the same model (same seed, dimensions, batch, loss) and they are timed in
alternation, one optimizer step per turn, so machine noise hits them alike; other load can only
slow a step, so each variant's best step is its figure and the ratios are to "before" (the step as
it was: q, k and v as separate matmuls, q and k rotated one at a time). All use foreach AdamW,
as tasks/engine/trainer.make_optimizer does, unless named otherwise. Variants:

    before          the reference attention (kept here as it was), the loss over the whole batch's logits
    fused AdamW     before, with torch.optim.AdamW(fused=True)
    fused QKV+rope  q, k, v as one matmul over the concatenated weights, q and k rotated together
                    (models/llama.py's attention), the loss still over the whole batch's logits
    + gate/up       and gate and up as one matmul too
    + chunked CE    the model as it is: the loss through forward(targets=...), the LM head and
                    cross-entropy over LOSS_CHUNKS slices of the tokens (each op on a slice's logits)
    + compile       (--compile) the model as it is under torch.compile; prints the compile time and
                    how many minutes of training it takes to earn it back

--batches also times the model as it is at other batch sizes (tokens/s; ratio to "before").
--clock cpu times each step by this process's CPU time instead of the wall clock: on a machine
other processes keep busy it counts the work a variant does, not the time it waited for a core.
Use it with --threads 1 (with more, threads spinning at a barrier count as work).
--precision auto (the default) times the steps in the precision train.precision=auto picks on this CPU
(tasks/engine/step_timing.choose_precision, measured): bf16 means autocast, as the trainer runs it, with
the cross-entropy in fp32.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from cpuforge.models.config import LlamaConfig
from cpuforge.models.llama import Llama, apply_rope
from cpuforge.tasks.config.settings import load_config
from cpuforge.tasks.engine.hardware import available_cores
from cpuforge.tasks.engine.step_timing import choose_precision


def attention_before(self, x, cos, sin, cache=None, mask=None):
    """Attention.forward as it was before the fused path (a plain causal pass)."""
    B, T, _ = x.shape
    q = self.wq(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
    k = self.wk(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
    v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=self.n_kv_head != self.n_head)
    return self.wo(y.transpose(1, 2).reshape(B, T, -1)), (k, v)


def mlp_fused(self, x):
    """gate and up as one matmul over their concatenated weights."""
    gate, up = F.linear(x, torch.cat((self.gate.weight, self.up.weight))).chunk(2, dim=-1)
    return self.down(F.silu(gate) * up)


class Variant:
    clock = staticmethod(time.perf_counter)
    dtype = torch.float32  # bfloat16: the step runs under autocast, as the trainer runs it

    def __init__(self, cfg: LlamaConfig, batch: int, *, fused_qkv: bool, fused_mlp: bool, fused_adamw: bool,
                 sliced_loss: bool = False, compile: bool = False) -> None:
        torch.manual_seed(0)
        self.model = Llama(cfg).train()
        for block in self.model.blocks:
            if not fused_qkv:
                block.attn.forward = attention_before.__get__(block.attn)
            if fused_mlp:
                block.mlp.forward = mlp_fused.__get__(block.mlp)
        if compile:
            self.model.compile_forward()  # what train.compile=true does
        kind = {"fused": True} if fused_adamw else {"foreach": True}
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, **kind)
        self.sliced_loss = sliced_loss
        g = torch.Generator().manual_seed(1)
        self.x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)
        self.y = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)
        self.best = float("inf")

    def loss(self) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.dtype == torch.bfloat16):
            if self.sliced_loss:
                return self.model(self.x, targets=self.y)[0]
            logits, _ = self.model(self.x)
            return F.cross_entropy(logits.float().view(-1, logits.size(-1)), self.y.view(-1))

    def step(self) -> float:
        t0 = self.clock()
        self.loss().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        seconds = self.clock() - t0
        self.best = min(self.best, seconds)
        return seconds

    def tokens_per_s(self) -> float:
        return self.x.numel() / self.best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="demo")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=8, help="timed steps per variant, alternating")
    parser.add_argument("--threads", type=int, default=available_cores())
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time steps by the wall clock or by this process's CPU time (busy machine, 1 thread)")
    parser.add_argument("--compile", action="store_true", help="also time the model under torch.compile")
    parser.add_argument("--batches", default="", help="comma-separated other batch sizes to time, e.g. 4,16")
    parser.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                        help="auto: what train.precision=auto picks on this CPU (measured); fp32/bf16: forced")
    args = parser.parse_args()

    run_cfg = load_config(args.profile, overrides=args.overrides)
    cfg = run_cfg.model.or_named("demo").shape(args.vocab_size)  # model.size=auto: demo dims
    B = run_cfg.train.batch_size
    torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        Variant.clock = staticmethod(time.process_time)
    precision = choose_precision(args.precision, cfg, B, args.threads)  # no cache: a benchmark measures afresh
    Variant.dtype = getattr(torch, precision["dtype"])
    print(f"batch {B} x {cfg.block_size}, d_model {cfg.d_model}, {cfg.n_layer} layers, vocab {cfg.vocab_size}, "
          f"{args.threads} threads, {precision['dtype']} ({precision['reason']}), {args.clock} clock")

    now = dict(fused_qkv=True, fused_mlp=False, fused_adamw=False, sliced_loss=True)
    variants = {
        "before": Variant(cfg, B, fused_qkv=False, fused_mlp=False, fused_adamw=False),
        "fused AdamW": Variant(cfg, B, fused_qkv=False, fused_mlp=False, fused_adamw=True),
        "fused QKV+rope": Variant(cfg, B, fused_qkv=True, fused_mlp=False, fused_adamw=False),
        "+ gate/up": Variant(cfg, B, fused_qkv=True, fused_mlp=True, fused_adamw=False),
        "+ chunked CE": Variant(cfg, B, **now),
    }
    if args.compile:
        variants["+ compile"] = Variant(cfg, B, **now, compile=True)
    for b in (int(b) for b in args.batches.split(",") if b):
        variants[f"batch {b}"] = Variant(cfg, b, **now)

    with torch.no_grad():  # the levers change how the maths is computed, not what it is
        reference = variants["before"].model(variants["before"].x)[0]
        for name, v in variants.items():
            if not name.startswith(("batch", "+ compile")):
                assert torch.allclose(v.model(v.x)[0], reference, atol=1e-5), name
    warmup: dict[str, float] = {}  # wall seconds: compilation also runs in worker processes
    for name, v in variants.items():  # first-call allocations (and compilation)
        t0 = time.perf_counter()
        v.step()
        warmup[name], v.best = time.perf_counter() - t0, float("inf")
    for _ in range(args.rounds):
        for v in variants.values():
            v.step()

    base = variants["before"].tokens_per_s()
    print(f"{'variant':>16}  {'tok/s':>7}  ratio to before  (best of {args.rounds} steps each)")
    for name, v in variants.items():
        print(f"{name:>16}  {v.tokens_per_s():7.0f}  {v.tokens_per_s() / base:.3f}")
    if args.compile:
        eager, compiled = variants["+ chunked CE"], variants["+ compile"]
        saved_per_token = 1 / eager.tokens_per_s() - 1 / compiled.tokens_per_s()
        compile_s = warmup["+ compile"] - warmup["+ chunked CE"]
        if saved_per_token > 0:
            minutes = compile_s / saved_per_token / eager.tokens_per_s() / 60
            print(f"compile: {compile_s:.0f}s to compile, repaid after {minutes:.1f} min of eager training")
        else:
            print(f"compile: {compile_s:.0f}s to compile, and no faster than eager: never repaid")


if __name__ == "__main__":
    main()

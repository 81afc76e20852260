"""Peak memory of optimizer steps for large configs, with activation checkpointing off and on.

    python benchmarks/train_memory.py [--sizes medium-320m large-1b] [--batch 1] [--steps 2] [--fsdp N]

Each (size, checkpointing) case runs in its own process so its peak RSS is its own; prints
parameters, peak RSS, bytes per parameter and seconds per step. fp32 AdamW needs 16 bytes
per parameter for weights, gradients and the two moments before any activation.
Goal: large-1b completes optimizer steps within this machine's 24 GiB.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, os, sys, time, torch, torch.nn.functional as F
from cpuforge.models.config import LlamaConfig
from cpuforge.models.llama import Llama, param_count
from cpuforge.tasks.engine.hardware import available_cores, peak_rss_mb
size, ckpt, batch, steps = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), int(sys.argv[4])
world = int(os.environ.get("WORLD_SIZE", "1"))  # > 1 under torchrun: FSDP
if world > 1:
    torch.distributed.init_process_group("gloo")
torch.set_num_threads(max(1, available_cores() // world))
cfg = LlamaConfig.named(size, vocab_size=32000)
model = Llama(cfg)
params = param_count(model)
model.activation_checkpointing = ckpt
if world > 1:
    from cpuforge.tasks.engine.sharding import shard
    shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=False)  # foreach would add a full-size temp copy
x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size))
times = []
for _ in range(steps):
    t0 = time.perf_counter()
    model(x, targets=x)[0].backward()  # the trainer's loss (trainer.lm_loss)
    opt.step()
    opt.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - t0)
print(json.dumps({"params": params, "peak_rss_mb": peak_rss_mb(), "seconds_per_step": min(times), "steps": steps}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["medium-320m", "large-1b"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--fsdp", type=int, default=1, metavar="N",
                        help="N > 1: N processes on this machine under torchrun, the model sharded with FSDP")
    parser.add_argument("--checkpointing", choices=["both", "off", "on"], default="both")
    args = parser.parse_args()
    modes = {"both": (False, True), "off": (False,), "on": (True,)}[args.checkpointing]
    print(f"{'size':>12} {'act. ckpt':>9} {'params':>8} {'peak RSS':>10} {'bytes/param':>11} {'s/step':>7}"
          + (f"  (FSDP x{args.fsdp}: per process; this machine holds {args.fsdp} of them)" if args.fsdp > 1 else ""))
    with tempfile.NamedTemporaryFile("w", suffix=".py") as child:
        child.write(CHILD)
        child.flush()
        launcher = [sys.executable] if args.fsdp == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.fsdp}"]
        for size in args.sizes:
            for ckpt in modes:
                t0 = time.time()
                proc = subprocess.run([*launcher, child.name, size, "1" if ckpt else "0", str(args.batch),
                                       str(args.steps)], capture_output=True, text=True)
                if proc.returncode != 0:
                    print(f"{size:>12} {str(ckpt):>9} failed after {time.time() - t0:.0f}s: "
                          f"{(proc.stderr.strip().splitlines() or ['killed (out of memory?)'])[-1]}")
                    continue
                ranks = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
                r = max(ranks, key=lambda rank: rank["peak_rss_mb"])  # the process closest to the limit
                print(f"{size:>12} {str(ckpt):>9} {r['params'] / 1e6:7.0f}M {r['peak_rss_mb'] / 1024:8.2f}GiB "
                      f"{r['peak_rss_mb'] * 2**20 / r['params']:11.1f} {r['seconds_per_step']:7.1f}")


if __name__ == "__main__":
    main()

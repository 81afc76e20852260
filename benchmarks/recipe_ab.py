"""The training recipe A/B: validation bits per byte at the same wall-clock, on two corpora.

    nice python benchmarks/recipe_ab.py --minutes 5 --threads 2 \\
        --corpus stdlib --corpus '/usr/share/vim/vim90/doc/*.txt'

Method. The machine is shared, so a literal "train each arm for 5 minutes" would measure the
load, not the recipe. Instead:
1. Step time, in alternation: every arm's model and optimizer are built in this one process
   and timed round-robin (a few steps each per round, best of the rounds), so a slow spell
   hits all arms alike. The ratio to today's recipe is what is kept.
   Arms whose steps do the same work (same optimizer; lr, schedule and init change numbers,
   not work) share one timing.
2. Today's recipe gets the steps it completes in --minutes at its throughput (--base-tok-s,
   or its best timed throughput here), and every other arm that many steps scaled by its
   step-time ratio (an arm 5% slower per step gets 5% fewer steps).
3. Each arm trains with max_steps (deterministic in tokens, whatever the load) on the demo
   profile's model shape and batch, and is scored on the same fixed validation batches.
Every arm is timed and trained in one precision: --precision auto (the default) is what
train.precision=auto picks on this CPU for today's arm (a measured A/B; bf16 means autocast),
fp32 or bf16 forces one.
The table prints each arm's step-time ratio, steps, val bits per byte and its change
against today's recipe. Arms are --set style overrides of the train section on top of the
demo profile; `today` pins the recipe the demo profile shipped with before this benchmark.
The `shipped` arm is the demo profile as it ships now, shape included: the recipe of its train
section and the model that `model.size: auto` picks for --minutes on this machine:

    nice python benchmarks/recipe_ab.py --minutes 5 --arms shipped \\
        --corpus stdlib --corpus '/usr/share/vim/vim90/doc/*.txt'

An arm named `BASE+key=value+...` is arm BASE with more overrides after its own (so they win), e.g.
`shipped+lr=4e-3` is the shipped demo with AdamW's lr at 4e-3. --reuse takes the rows of an earlier
--json table instead of training them again when the corpus, the resolved config, the steps, the
precision and the validation batches all match (training by max_steps is deterministic on one
machine and code version: reuse tables from this machine and commit), so a new arm costs only its
own minutes.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import torch

from cpuforge.models.llama import Llama, zero_residual_projections
from cpuforge.tasks.config.settings import load_config
from cpuforge.tasks.engine.data import BatchSampler, open_shards, token_byte_lengths, val_batches
from cpuforge.tasks.engine.losses import lm_loss
from cpuforge.tasks.engine.step_timing import choose_precision
from cpuforge.tasks.engine.trainer import RunFacts, make_optimizer, train
from cpuforge.tasks.stages.tokenize import tokenize

# The recipe before this A/B (AdamW, warmup 30 + cosine to lr/10, default init), pinned so the
# baseline stays today's whatever the defaults become.
TODAY = ["optimizer=adamw", "lr=2e-3", "min_lr=2e-4", "warmup_steps=30", "lr_schedule=cosine",
         "zero_init_residual=false"]
WSD = ["lr_schedule=wsd", "cooldown_fraction=0.4", "min_lr=0"]
ARMS: dict[str, list[str]] = {
    "today": [],
    "adamw-wsd-zero-lr4e-3": [*WSD, "lr=4e-3", "zero_init_residual=true"],
    "muon-wsd-zero-lr4e-3": ["optimizer=muon", "muon_lr=4e-3", *WSD, "lr=4e-3", "zero_init_residual=true"],
    "muon-wsd-zero-lr8e-3": ["optimizer=muon", "muon_lr=8e-3", *WSD, "lr=4e-3", "zero_init_residual=true"],
    "muon-wsd-zero-lr2e-3": ["optimizer=muon", "muon_lr=2e-3", *WSD, "lr=4e-3", "zero_init_residual=true"],
    # AdamW's own lr (the tied embedding and the norms) inside the Muon recipe
    **{f"muon-wsd-zero-lr2e-3-adam{n}e-3": ["optimizer=muon", "muon_lr=2e-3", *WSD, f"lr={n}e-3",
                                            "zero_init_residual=true"] for n in (2, 8, 16, 32)},
}


# The demo profile as it ships, model shape included: `model.size: auto` picks the shape for --minutes on
# this machine (tasks/engine/sizing.py), so this arm answers "today's demo against the shipped one".
SHIPPED = "shipped"


def base_arm(name: str) -> str:
    """`BASE` of an arm named `BASE+key=value+...` (the name itself for a plain arm)."""
    return name.split("+")[0]


def resolve_arm(name: str, known: dict[str, list[str]]) -> list[str]:
    """The overrides of a known arm, or of `BASE+key=value+...`: BASE's, then these (later ones win)."""
    base, *more = name.split("+")
    if base not in known:
        raise SystemExit(f"unknown arm {base!r}; known: {', '.join(known)}")
    return [*known[base], *more]


def arm_config(arm: str, extra: list[str]):
    """An arm's config: the demo profile with today's recipe and the 4.0M demo shape, then the arm's
    overrides (train.* unless they name another section)."""
    overrides = ["model.size=demo", *(o if o.startswith("model.") else f"train.{o}" for o in TODAY + extra),
                 "train.max_minutes=null", "train.max_steps=1"]
    return load_config("demo", overrides=overrides)


def shipped_overrides(minutes: float, root: Path) -> list[str]:
    """The shipped demo profile's recipe and the shape its model.size=auto picks for `minutes` here."""
    from cpuforge.tasks.engine.sizing import resolve_auto_size

    shipped = load_config("demo")
    cfg, choice = resolve_auto_size(shipped.model_copy(update={"train": shipped.train.model_copy(
        update={"max_minutes": minutes})}), root)
    print(f"{SHIPPED}: model.size=auto chose {choice.reason}")
    recipe = shipped.train.model_dump()
    train = [f"{k}={recipe[k]}" for k in ("optimizer", "lr", "min_lr", "muon_lr", "warmup_steps", "lr_schedule",
                                          "cooldown_fraction", "zero_init_residual")]
    shape = [f"model.{k}={getattr(cfg.model, k)}" for k in ("n_layer", "d_model", "n_head", "n_kv_head", "d_mlp")]
    return train + shape


def prepare_corpus(source: str, root: Path) -> Path:
    """Tokenize a corpus as the demo profile does (its own tokenizer), once per source."""
    name = "stdlib" if source == "stdlib" else Path(source.split("*")[0]).name or "corpus"
    out = root / name / "tok"
    if (out / "meta.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config("demo", overrides=[f"data.source={source}"])
    tokenize(cfg.data, cfg.tokenizer, out, root / name / "cache")
    return out


def build(cfg, vocab: int, dtype: torch.dtype) -> tuple[Llama, torch.optim.Optimizer]:
    torch.manual_seed(cfg.train.seed)
    model = Llama(cfg.model.shape(vocab))
    if cfg.train.zero_init_residual:
        zero_residual_projections(model)
    return model, make_optimizer(model, cfg.train, dtype)


def step_class(extra: list[str]) -> str:
    """Arms whose steps do the same work share one timing: lr, schedule and init change numbers, not work;
    the optimizer (Muon's Newton-Schulz) and the model shape change the work."""
    cfg = arm_config("", extra)
    return f"{cfg.train.optimizer_in_use()} {cfg.model.model_dump_json()}"


def resolved_config(extra: list[str]) -> str:
    """An arm's whole config as JSON: arms spelled differently but configured alike are one arm."""
    return arm_config("", extra).model_dump_json()


def time_steps(arms: dict[str, list[str]], tok: Path, rounds: int, steps: int, dtype: torch.dtype
               ) -> dict[str, float]:
    """Best seconds per optimizer step of each arm's step class, timed round-robin in this process."""
    shards = open_shards(tok, 256)
    built = {}
    for arm, extra in arms.items():
        if step_class(extra) in built:
            continue
        cfg = arm_config(arm, extra)
        model, opt = build(cfg, shards.vocab_size, dtype)
        sampler = BatchSampler(shards.train, cfg.train.batch_size, model.cfg.block_size, cfg.train.seed, 0, 1)
        built[step_class(extra)] = (model, opt, sampler)
    best = {name: math.inf for name in built}
    for r in range(rounds + 1):  # round 0 warms up allocators and caches, and is not counted
        for name, (model, opt, sampler) in built.items():
            t0 = time.perf_counter()
            for i in range(steps):
                x, y = sampler.batch(r * steps + i, 0)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                    loss = lm_loss(model, x, y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
            if r:
                best[name] = min(best[name], (time.perf_counter() - t0) / steps)
    return {arm: best[step_class(extra)] for arm, extra in arms.items()}


def train_arm(arm: str, extra: list[str], steps: int, shards, val, lengths, dtype: torch.dtype, ckpt: Path
              ) -> float:
    """Train one arm for exactly `steps` optimizer steps from its seed; its val bits per byte."""
    cfg = arm_config(arm, extra)
    model, _ = build(cfg, shards.vocab_size, dtype)
    s = cfg.train.model_copy(update={"max_steps": steps, "max_minutes": None, "eval_interval": 10**9,
                                     "checkpoint_every_steps": 10**9, "checkpoint_every_minutes": 10**9})
    shutil.rmtree(ckpt, ignore_errors=True)  # a fresh run each time, not a resume of the last one
    return train(model, shards.train, val, lengths, s, ckpt, RunFacts(dtype)).val_bpb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", action="append", help="data.source of a corpus (repeat; default: stdlib)")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of: {', '.join([*ARMS, SHIPPED])}")
    parser.add_argument("--minutes", type=float, default=5.0, help="wall-clock budget the steps stand for")
    parser.add_argument("--base-tok-s", type=float, default=None,
                        help="today's recipe's idle tokens/s (default: its best timed throughput here)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                        help="auto: what train.precision=auto picks on this CPU (measured); fp32/bf16: forced")
    parser.add_argument("--eval-batches", type=int, default=32, help="fixed val batches (8 x 256 tokens each)")
    parser.add_argument("--timing-rounds", type=int, default=4)
    parser.add_argument("--timing", help="JSON of seconds per step per arm: read if it exists, else measured and "
                        "written (so several invocations, e.g. one per corpus, share one measurement)")
    parser.add_argument("--time-only", action="store_true", help="measure step times, print them and stop")
    parser.add_argument("--workdir", default="/tmp/cpuforge-recipe-ab")
    parser.add_argument("--json", help="write the table here too")
    parser.add_argument("--reuse", action="append", default=[],
                        help="an earlier --json table whose matching rows are taken instead of trained (repeat)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    root = Path(args.workdir)
    trained = ["today", *(a for a in args.arms.split(",") if a != "today")]  # the yardstick of every row
    corpora = args.corpus or ["stdlib"]
    toks = {source: prepare_corpus(source, root) for source in corpora}
    # the shipped arm's shape is the one auto sizing picks here, so it is only known when asked for
    wants_shipped = any(base_arm(a) == SHIPPED for a in trained)
    known = {**ARMS, **({SHIPPED: shipped_overrides(args.minutes, root / "sizing")} if wants_shipped else {})}
    # today's recipe is the yardstick of the step ratio
    arms = {"today": [], **{a: resolve_arm(a, known) for a in trained}}

    today_cfg = arm_config("today", [])
    precision = choose_precision(args.precision, today_cfg.model.shape(open_shards(toks[corpora[0]], 256).vocab_size),
                                 today_cfg.train.batch_size, args.threads)
    dtype = getattr(torch, precision["dtype"])
    print(f"precision {precision['dtype']}: {precision['reason']}")
    timing = Path(args.timing) if args.timing else None
    known_steps = json.loads(timing.read_text()) if timing and timing.is_file() else {}
    if known_steps and known_steps.get("precision") != precision["dtype"]:
        raise SystemExit(f"{timing} was timed in {known_steps.get('precision', 'an unrecorded precision')}, this run "
                         f"trains in {precision['dtype']}: give another --timing file (or delete this one)")
    if known_steps:  # an arm the file lacks takes the time of one there whose steps do the same work
        # ("precision", and arms not known to this run, are skipped)
        timed = {step_class(resolve_arm(a, known)): t for a, t in known_steps.items() if base_arm(a) in known}
        per_step = {arm: known_steps.get(arm, timed.get(step_class(extra))) for arm, extra in arms.items()}
        if missing := [arm for arm, t in per_step.items() if t is None]:
            raise SystemExit(f"{timing} has no step time for {', '.join(missing)} (nor for an arm doing the same "
                             "work): give another --timing file (or delete this one)")
    else:
        per_step = time_steps(arms, toks[corpora[0]], args.timing_rounds, steps=3, dtype=dtype)
        if timing:
            timing.write_text(json.dumps({"precision": precision["dtype"], **per_step}, indent=2))
    tokens_per_step = 8 * 256
    base_tok_s = args.base_tok_s or tokens_per_step / per_step["today"]
    base_steps = round(args.minutes * 60 * base_tok_s / tokens_per_step)
    print(f"threads {args.threads}; today's recipe: {tokens_per_step / per_step['today']:.0f} tok/s timed here, "
          f"{base_tok_s:.0f} tok/s used -> {base_steps} steps in {args.minutes:g} min")
    ratio = {arm: per_step[arm] / per_step["today"] for arm in arms}
    steps = {arm: max(1, round(base_steps / ratio[arm])) for arm in arms}
    for arm in arms:
        print(f"  {arm:<22} {per_step[arm] * 1000:7.1f} ms/step  x{ratio[arm]:.3f}  -> {steps[arm]} steps")
    if args.time_only:
        return

    reusable = {}
    for earlier in map(Path, args.reuse):
        old = json.loads(earlier.read_text())
        took = (old.get("precision"), old.get("eval_batches", 32))  # tables before eval_batches was recorded: 32
        if took != (precision["dtype"], args.eval_batches):
            print(f"--reuse {earlier}: not reused, trained in {took[0]} on {took[1]} val batches (this run: "
                  f"{precision['dtype']}, {args.eval_batches})")
            continue
        reusable.update({(r["corpus"], resolved_config(r["overrides"]), r["steps"]): r for r in old["rows"]})
    table = []
    for source, tok in toks.items():
        shards = open_shards(tok, 256)
        lengths = token_byte_lengths(shards.tokenizer_path)
        val = val_batches(shards.val, args.eval_batches, 8, 256)
        print(f"\ncorpus {source}: {len(shards.train):,} train tokens, {sum(x.numel() for x, _ in val):,} val tokens")
        results = {}
        for arm in trained:
            extra = arms[arm]
            t0 = time.perf_counter()
            if row := reusable.get((source, resolved_config(extra), steps[arm])):
                results[arm], how = row["val_bpb"], "reused"
            else:
                results[arm], how = train_arm(arm, extra, steps[arm], shards, val, lengths, dtype,
                                              root / tok.parent.name / "runs" / arm), None
            rel = results[arm] / results["today"] - 1 if "today" in results else math.nan
            print(f"  {arm:<22} steps {steps[arm]:4d}  val bpb {results[arm]:.4f}  {100 * rel:+6.2f}% vs today"
                  f"  ({how or f'{time.perf_counter() - t0:.0f} s'})", flush=True)
            table.append({"corpus": source, "arm": arm, "overrides": extra, "step_time_ratio": round(ratio[arm], 4),
                          "steps": steps[arm], "val_bpb": round(results[arm], 4), "vs_today": round(rel, 4)})
    if args.json:
        Path(args.json).write_text(json.dumps({"base_tok_s": base_tok_s, "minutes": args.minutes,
                                               "precision": precision["dtype"], "eval_batches": args.eval_batches,
                                               "rows": table}, indent=2))


if __name__ == "__main__":
    main()

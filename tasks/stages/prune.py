"""Stage 3, prune: the pretrained model -> a physically smaller one (Minitron-style).

Importance comes from activations on calibration batches of the train split. The target is
either explicit dimensions (prune.n_layer, n_head, n_kv_head, d_model, d_mlp) or a fraction
of parameters to keep (prune.keep_ratio) split by prune.strategy:
- width: keep every layer and head; shrink the embedding and MLP widths by one common factor
  (Minitron found width pruning beats depth pruning at the same size);
- depth: drop the layers that change their input least, keep all widths;
- width_then_depth: drop layers down to sqrt(keep_ratio) of the depth, then shrink widths.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from cpuforge.models.checkpoint import load_model, save_model
from cpuforge.models.config import LlamaConfig, ModelConfigError
from cpuforge.models.fileio import atomic_write_json
from cpuforge.models.hf_format import write_tokenizer
from cpuforge.models.importance import Importance, activation_importance
from cpuforge.models.llama import config_param_count, param_count
from cpuforge.models.prune import check_target, choose_keep, prune
from cpuforge.tasks import stages
from cpuforge.tasks.config.settings import PruneConfig
from cpuforge.tasks.engine.data import BatchSampler, open_shards, token_byte_lengths, val_batches
from cpuforge.tasks.engine.validation import evaluate
from cpuforge.tasks.infra import live
from cpuforge.tasks.infra.stage import StageOutput, StageRun, key_config
from cpuforge.tasks.infra.store import StageRecord
from cpuforge.tasks.records.errors import ConfigError
from cpuforge.tasks.release.model_card import made_by, write_model_card

log = logging.getLogger("cpuforge.prune")

SPEC = stages.PRUNE
NEAR_BUDGET = 0.95  # a pruned shape holding this share of keep_ratio's parameters counts as meeting it


def _round_width(value: float, limit: int, multiple: int) -> int:
    return int(min(limit, max(multiple, multiple * round(value / multiple))))


def _shrink_width(cfg: LlamaConfig, budget: int, multiple: int) -> LlamaConfig:
    """The widest shape that fits the parameter budget, d_model and d_mlp multiples of `multiple`: both
    shrink by the largest common factor that fits (bisection); then d_model is tried at the grid points
    either side of that factor's width, the MLP taking what each leaves of the budget in steps of
    `multiple` up to its own width (a shape near the budget and balanced wins, see below). On a coarse grid the
    common factor alone can land far below the budget: a 9-head model's d_model moves in steps of
    lcm(32, 9) = 288, so a 576-wide model kept at 70% would otherwise drop to 288 and half its size."""

    def shaped(d_model: int, d_mlp: int) -> LlamaConfig:
        return replace(cfg, d_model=d_model, d_mlp=d_mlp, head_dim_override=cfg.head_dim)

    # transformers' LlamaConfig refuses a hidden size that its query heads do not divide, whatever head_dim is
    model_multiple = math.lcm(multiple, cfg.n_head)

    def at(factor: float) -> LlamaConfig:
        return shaped(_round_width(cfg.d_model * factor, cfg.d_model, model_multiple),
                      _round_width(cfg.d_mlp * factor, cfg.d_mlp, multiple))

    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if config_param_count(at(mid)) <= budget else (lo, mid)
    # On the grid only, the model's own widths included only where they are on it (a 176-wide MLP stays whole
    # at no width_multiple of 32: its rows would not fit the GGUF files' blocks)
    mlp_widths = range(cfg.d_mlp - cfg.d_mlp % multiple, 0, -multiple)
    widest = cfg.d_model - cfg.d_model % model_multiple
    grid_points = {min(widest, max(model_multiple, model_multiple * step(cfg.d_model * hi / model_multiple)))
                   for step in (math.floor, math.ceil)} - {0}
    fits = [next((shaped(d_model, d_mlp) for d_mlp in mlp_widths
                  if config_param_count(shaped(d_model, d_mlp)) <= budget), None) for d_model in sorted(grid_points)]
    fits = [shape for shape in fits if shape is not None]
    if not fits:
        raise ConfigError(
            f"prune: no width fits {budget:,} parameters (the embedding alone needs "
            f"{cfg.vocab_size * model_multiple:,} at the narrowest width, prune.width_multiple={multiple}); raise "
            f"prune.keep_ratio or lower prune.width_multiple"
        )
    # An MLP narrower than the model it feeds (Llamas use ~2.7x) is no candidate while another shape fits.
    # Within NEAR_BUDGET of the budget the shape that shrinks both widths most alike wins (Minitron's width
    # pruning cuts both); when neither is that near, the larger one does.
    fits = [shape for shape in fits if shape.d_mlp >= min(shape.d_model, cfg.d_mlp)] or fits
    near = [shape for shape in fits if config_param_count(shape) >= NEAR_BUDGET * budget]
    if not near:
        return max(fits, key=config_param_count)
    return min(near, key=lambda shape: abs(math.log(shape.d_model / cfg.d_model * cfg.d_mlp / shape.d_mlp)))


def target_config(cfg: LlamaConfig, p: PruneConfig) -> LlamaConfig:
    """The pruned shape: explicit dimensions where given, else what keep_ratio and strategy imply."""
    explicit = {k: getattr(p, k) for k in ("n_layer", "n_head", "n_kv_head", "d_model", "d_mlp") if getattr(p, k)}
    if explicit:
        if "n_kv_head" in explicit and "n_head" not in explicit:
            explicit["n_head"] = explicit["n_kv_head"] * (cfg.n_head // cfg.n_kv_head)
        try:
            target = replace(cfg, head_dim_override=cfg.head_dim, **explicit)
            check_target(cfg, target)
        except ModelConfigError as exc:
            raise ConfigError(f"prune: {exc}") from None
        return target
    budget = int(p.keep_ratio * config_param_count(cfg))
    if p.strategy == "width":
        return _shrink_width(cfg, budget, p.width_multiple)
    if p.strategy == "depth":
        per_layer = (config_param_count(cfg) - config_param_count(replace(cfg, n_layer=1))) / max(1, cfg.n_layer - 1)
        fixed = config_param_count(cfg) - per_layer * cfg.n_layer
        layers = int((budget - fixed) // per_layer)
        if layers < 1:
            raise ConfigError(f"prune: dropping layers cannot reach keep_ratio={p.keep_ratio}: the embedding alone "
                              f"is {fixed / config_param_count(cfg):.0%} of the model; use strategy=width")
        return replace(cfg, n_layer=min(cfg.n_layer, layers), head_dim_override=cfg.head_dim)
    layers = max(1, math.ceil(cfg.n_layer * math.sqrt(p.keep_ratio)))
    return _shrink_width(replace(cfg, n_layer=layers, head_dim_override=cfg.head_dim), budget, p.width_multiple)


def calibration_batches(train, p: PruneConfig, block_size: int) -> list[torch.Tensor]:
    """Train-split windows for importance, drawn apart from the training stream's seeds."""
    sampler = BatchSampler(train, p.batch_size, block_size, p.seed)
    return [sampler.batch(i)[0] for i in range(p.calib_batches)]


def work(run: StageRun, prune: PruneConfig) -> StageOutput:
    return prune_stage(prune, run.inputs["tokenize"], run.inputs["pretrain"], run.out_dir, run.report)


def batch_progress(report: live.Report, total: int) -> Callable[[str], Callable[[], None]]:
    """`phase(name)` -> a callback for one forward batch of that phase, reporting the share of all batches done."""
    done = [0]

    def phase(name: str) -> Callable[[], None]:
        def one_batch() -> None:
            done[0] += 1
            report(done[0] / total, {"phase": name, "batches": f"{done[0]} of {total}"})
        return one_batch

    return phase


def prune_stage(p: PruneConfig, tokenized: StageRecord, pretrained: StageRecord, out_dir: Path,
                report: live.Report = live.nothing) -> StageOutput:
    started = time.perf_counter()
    teacher = load_model(pretrained.path("model"))
    target = target_config(teacher.cfg, p)
    shards = open_shards(Path(tokenized.output_dir), teacher.cfg.block_size)
    lengths = token_byte_lengths(shards.tokenizer_path)
    val = val_batches(shards.val, p.val_batches, p.batch_size, teacher.cfg.block_size)
    phase = batch_progress(report, 2 * len(val) + p.calib_batches)  # forward passes: all of the stage's time
    _, bpb_before = evaluate(teacher, val, lengths, on_batch=phase("scoring the model"))

    imp = activation_importance(teacher, calibration_batches(shards.train, p, teacher.cfg.block_size),
                                on_batch=phase("importance"))
    keep = choose_keep(teacher.cfg, imp, target)
    student = prune(teacher, keep)
    _, bpb_after = evaluate(student, val, lengths, on_batch=phase("scoring the pruned model"))

    save_model(student, out_dir / "model")
    write_tokenizer(out_dir / "model", pretrained.path("tokenizer"), shards.meta["eod_token"], shards.eod_id)
    choices = {
        "strategy": "explicit" if any(getattr(p, k) for k in ("n_layer", "n_head", "n_kv_head", "d_model", "d_mlp"))
        else p.strategy,
        "before": {k: getattr(teacher.cfg, k) for k in ("n_layer", "n_head", "n_kv_head", "d_model", "d_mlp")},
        "after": {k: getattr(student.cfg, k) for k in ("n_layer", "n_head", "n_kv_head", "d_model", "d_mlp")},
        "kept_layers": keep.layers, "kept_kv_heads": keep.kv_heads, "kept_query_heads": keep.q_per_group,
        "layer_cosine": [round(float(c), 4) for c in imp.layer_cosine],
    }
    atomic_write_json(out_dir / "choices.json", choices)
    plot_importance(imp, keep, out_dir / "importance.png")
    params_before, params_after = param_count(teacher), param_count(student)
    write_model_card(out_dir / "model", [*made_by(tokenized, pretrained), (SPEC.name, {"prune": key_config("prune", p)})],
                     tokenized, {"val_bpb_after": bpb_after, "params": params_after})
    log.info("pruned %s -> %s parameters (%.0f%%): val bpb %.3f -> %.3f",
             f"{params_before:,}", f"{params_after:,}", 100 * params_after / params_before, bpb_before, bpb_after)
    return StageOutput(
        metrics={"params_before": params_before, "params_after": params_after,
                 "keep_ratio_actual": round(params_after / params_before, 4),
                 "val_bpb_before": round(bpb_before, 4), "val_bpb_after": round(bpb_after, 4),
                 **{f"{k}_after": v for k, v in choices["after"].items()},
                 "seconds": round(time.perf_counter() - started, 2)},
        files={"model": "model", "tokenizer": "model/tokenizer.json", "choices": "choices.json",
               "importance": "importance.png"},
        artifacts=["choices.json", "importance.png"],
        info={"choices": choices["after"], "model_config": student.cfg.to_dict()},
    )


def plot_importance(imp: Importance, keep, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(14, 3.2), dpi=100)
    axes[0].imshow(imp.heads.numpy(), aspect="auto", cmap="viridis")
    axes[0].set(title="head importance", xlabel="head", ylabel="layer")
    for i, layer_scores in enumerate(imp.mlp):
        axes[1].plot(sorted(layer_scores.tolist(), reverse=True), lw=1, label=f"layer {i}")
    axes[1].axvline(len(next(iter(keep.mlp.values()))), color="k", ls="--", lw=1)
    axes[1].set(title="MLP channels (sorted)", xlabel="rank")
    axes[2].plot(sorted(imp.embed.tolist(), reverse=True))
    axes[2].axvline(len(keep.embed), color="k", ls="--", lw=1)
    axes[2].set(title="embedding channels (sorted)", xlabel="rank")
    axes[3].bar(range(len(imp.layer_cosine)), imp.layer_cosine.tolist(),
                color=["C0" if i in keep.layers else "C3" for i in range(len(imp.layer_cosine))])
    axes[3].set(title="layer in/out cosine (red: dropped)", xlabel="layer")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

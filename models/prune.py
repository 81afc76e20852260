"""Structural surgery: a physically smaller Llama that keeps chosen heads, channels and layers.

The result has a uniform, valid config (same heads and MLP width in every layer, query heads
a multiple of KV heads) and loads like any other checkpoint. Keeping everything reproduces
the original logits exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from cpuforge.models.config import LlamaConfig, ModelConfigError
from cpuforge.models.llama import Llama


@dataclass
class Keep:
    """What survives. Per-layer lists are indexed by the original layer number."""

    layers: list[int]  # original layer indices, in order
    kv_heads: dict[int, list[int]]  # layer -> kept KV head indices (whole GQA groups)
    q_per_group: dict[int, list[list[int]]]  # layer -> per kept group, kept query offsets within the group
    mlp: dict[int, list[int]]  # layer -> kept MLP channels
    embed: list[int]  # kept embedding channels (the same everywhere)


def keep_all(cfg: LlamaConfig) -> Keep:
    group = cfg.n_head // cfg.n_kv_head
    layers = list(range(cfg.n_layer))
    return Keep(
        layers=layers,
        kv_heads={i: list(range(cfg.n_kv_head)) for i in layers},
        q_per_group={i: [list(range(group))] * cfg.n_kv_head for i in layers},
        mlp={i: list(range(cfg.d_mlp)) for i in layers},
        embed=list(range(cfg.d_model)),
    )


def pruned_config(cfg: LlamaConfig, keep: Keep) -> LlamaConfig:
    first = keep.layers[0] if keep.layers else None
    if first is None:
        raise ModelConfigError("cannot prune every layer")
    n_kv = len(keep.kv_heads[first])
    q_group = len(keep.q_per_group[first][0]) if keep.q_per_group[first] else 0
    d_mlp = len(keep.mlp[first])
    for i in keep.layers:  # uniform across layers, or the checkpoint would not load anywhere
        if len(keep.kv_heads[i]) != n_kv or len(keep.mlp[i]) != d_mlp or any(len(g) != q_group for g in keep.q_per_group[i]):
            raise ModelConfigError(f"layer {i} keeps a different number of heads or channels than layer {first}")
    if n_kv == 0 or q_group == 0 or d_mlp == 0 or not keep.embed:
        raise ModelConfigError("pruning must keep at least one KV head, query head, MLP channel and embedding channel")
    return replace(cfg, n_layer=len(keep.layers), n_head=n_kv * q_group, n_kv_head=n_kv, d_model=len(keep.embed),
                   d_mlp=d_mlp, head_dim_override=cfg.head_dim)


@torch.no_grad()
def prune(model: Llama, keep: Keep) -> Llama:
    cfg = model.cfg
    new = Llama(pruned_config(cfg, keep))
    hd, group = cfg.head_dim, cfg.n_head // cfg.n_kv_head
    e = torch.tensor(keep.embed)
    new.tok_emb.weight.copy_(model.tok_emb.weight[:, e])
    new.norm.weight.copy_(model.norm.weight[e])
    if not cfg.tie_embeddings:
        new.lm_head.weight.copy_(model.lm_head.weight[:, e])
    for new_i, old_i in enumerate(keep.layers):
        old, blk = model.blocks[old_i], new.blocks[new_i]
        kv = keep.kv_heads[old_i]
        q_heads = [g * group + q for g, qs in zip(kv, keep.q_per_group[old_i]) for q in qs]
        q_rows = torch.tensor([h * hd + d for h in q_heads for d in range(hd)])
        kv_rows = torch.tensor([h * hd + d for h in kv for d in range(hd)])
        blk.attn_norm.weight.copy_(old.attn_norm.weight[e])
        blk.mlp_norm.weight.copy_(old.mlp_norm.weight[e])
        blk.attn.wq.weight.copy_(old.attn.wq.weight[q_rows][:, e])
        blk.attn.wk.weight.copy_(old.attn.wk.weight[kv_rows][:, e])
        blk.attn.wv.weight.copy_(old.attn.wv.weight[kv_rows][:, e])
        blk.attn.wo.weight.copy_(old.attn.wo.weight[e][:, q_rows])
        m = torch.tensor(keep.mlp[old_i])
        blk.mlp.gate.weight.copy_(old.mlp.gate.weight[m][:, e])
        blk.mlp.up.weight.copy_(old.mlp.up.weight[m][:, e])
        blk.mlp.down.weight.copy_(old.mlp.down.weight[e][:, m])
    return new


def choose_keep(cfg: LlamaConfig, imp, target: LlamaConfig) -> Keep:
    """The most important parts at the target's sizes (imp: models.importance.Importance)."""
    group = cfg.n_head // cfg.n_kv_head
    q_keep = target.n_head // target.n_kv_head
    # Layers that change their input least (highest cosine) go first; the rest keep their order.
    layers = sorted(torch.argsort(imp.layer_cosine)[: target.n_layer].tolist())
    kv_heads, q_groups, mlp = {}, {}, {}
    for i in layers:
        scores = imp.heads[i].view(cfg.n_kv_head, group)
        kv = sorted(torch.argsort(scores.sum(dim=1), descending=True)[: target.n_kv_head].tolist())
        kv_heads[i] = kv
        q_groups[i] = [sorted(torch.argsort(scores[g], descending=True)[:q_keep].tolist()) for g in kv]
        mlp[i] = sorted(torch.argsort(imp.mlp[i], descending=True)[: target.d_mlp].tolist())
    embed = sorted(torch.argsort(imp.embed, descending=True)[: target.d_model].tolist())
    return Keep(layers=layers, kv_heads=kv_heads, q_per_group=q_groups, mlp=mlp, embed=embed)


def check_target(cfg: LlamaConfig, target: LlamaConfig) -> None:
    """Raise ModelConfigError when `target` is not a sub-shape of `cfg` under the GQA constraints."""
    group, q_keep = cfg.n_head // cfg.n_kv_head, target.n_head // target.n_kv_head
    problems = []
    for name in ("n_layer", "n_kv_head", "d_model", "d_mlp"):
        if getattr(target, name) > getattr(cfg, name):
            problems.append(f"{name}={getattr(target, name)} is more than the model's {getattr(cfg, name)}")
    if target.d_model % target.n_head:  # transformers' LlamaConfig refuses it, whatever head_dim is
        problems.append(f"d_model={target.d_model} is not a multiple of n_head={target.n_head}, which transformers "
                        f"requires of a Llama")
    if target.n_head % target.n_kv_head:
        problems.append(f"n_head={target.n_head} is not a multiple of n_kv_head={target.n_kv_head}")
    elif q_keep > group:
        problems.append(f"n_head={target.n_head} needs {q_keep} query heads per KV head; the model has {group}")
    if problems:
        raise ModelConfigError("the pruning target cannot be met: " + "; ".join(problems))

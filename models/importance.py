"""Minitron-style importance from activations on calibration batches (forward passes only).

- attention head: mean L2 norm of its output (the input of wo, per head)
- MLP channel: mean |activation| entering the down projection
- embedding channel: mean |value| at the output of every RMSNorm, summed
- layer: mean cosine similarity between a block's input and output (high = changes little)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cpuforge.models.llama import Llama, RMSNorm


@dataclass
class Importance:
    heads: torch.Tensor  # (n_layer, n_head)
    mlp: torch.Tensor  # (n_layer, d_mlp)
    embed: torch.Tensor  # (d_model,)
    layer_cosine: torch.Tensor  # (n_layer,)


@torch.no_grad()
def activation_importance(model: Llama, batches: list[torch.Tensor],
                          on_batch: Callable[[], None] | None = None) -> Importance:
    """Importance of heads, MLP channels, embedding channels and layers from forward passes over `batches`
    (`on_batch()` after each)."""
    cfg = model.cfg
    heads = torch.zeros(cfg.n_layer, cfg.n_head)
    mlp = torch.zeros(cfg.n_layer, cfg.d_mlp)
    embed = torch.zeros(cfg.d_model)
    cosine = torch.zeros(cfg.n_layer)
    hooks = []
    for i, block in enumerate(model.blocks):
        def head_hook(_m, args, i=i):
            y = args[0]
            heads[i] += y.view(*y.shape[:2], cfg.n_head, cfg.head_dim).norm(dim=-1).mean(dim=(0, 1))

        def mlp_hook(_m, args, i=i):
            mlp[i] += args[0].abs().mean(dim=(0, 1))

        def block_hook(_m, args, out, i=i):
            cosine[i] += F.cosine_similarity(args[0], out[0], dim=-1).mean()

        hooks += [block.attn.wo.register_forward_pre_hook(head_hook),
                  block.mlp.down.register_forward_pre_hook(mlp_hook),
                  block.register_forward_hook(block_hook)]
    def norm_hook(_m, _args, out):  # must return None: a returned value would replace the output
        embed.add_(out.abs().mean(dim=(0, 1)))

    for module in model.modules():
        if isinstance(module, RMSNorm):
            hooks.append(module.register_forward_hook(norm_hook))
    was_training, head = model.training, model.lm_head
    model.eval()
    # No hook reads the logits: skip the LM head, a third of a 135M model's FLOPs at a 49k vocabulary.
    model.lm_head = torch.nn.Identity()
    try:
        for x in batches:
            model(x)
            if on_batch is not None:
                on_batch()
    finally:
        model.lm_head = head
        for h in hooks:
            h.remove()
        model.train(was_training)
    n = max(1, len(batches))
    return Importance(heads / n, mlp / n, embed / n, cosine / n)

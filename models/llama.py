"""A Llama-style decoder, readable in one sitting.

RMSNorm, rotary position embeddings, grouped-query attention through
F.scaled_dot_product_attention, SwiGLU MLP, no biases, optionally tied embeddings.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from cpuforge.models import distill_head
from cpuforge.models.config import LlamaConfig
from cpuforge.models.distill_head import Distillation

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (k, v) of shape (B, n_kv_head, T, head_dim)

# The training loss takes the LM head, the cast to fp32 and the cross-entropy over this many slices of
# the tokens: each op works on a quarter of the batch's logits (8 x 256 x 4096 x 4 bytes = 32 MB at the
# demo's), and there is no bf16 copy of all of them beside the fp32 one. 1.12x a bf16-autocast demo step
# on AVX-512/AMX, 1.00-1.04x in fp32 (benchmarks/train_levers.py). The log-probabilities autograd keeps
# for the backward pass still add up to the whole batch's.
LOSS_CHUNKS = 4


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_cache(cfg: LlamaConfig, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)  # (T, head_dim/2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :d/2], x[..., d/2:]) by position-dependent angles (the Llama layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_head * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: tuple[torch.Tensor, torch.Tensor] | None = None, mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """`mask` (T, past + T), True where a query may attend: given, it replaces the causal rule derived
        from the cache's length (the ONNX decoder passes one so its graph has no shape-dependent branch)."""
        B, T, _ = x.shape
        if cache is None and mask is None:
            return self._forward_plain(x, cos, sin)
        q = self.wq(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = torch.cat((cache[0], k), dim=2), torch.cat((cache[1], v), dim=2)
        # Causal within the new tokens; every cached position is in the past, so it is visible.
        causal = mask is None and (cache is None or cache[0].shape[2] == 0)
        if mask is None and not causal and T > 1:
            past = k.shape[2] - T
            mask = torch.ones(T, k.shape[2], dtype=torch.bool).tril(diagonal=past)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and T > 1,
                                           enable_gqa=self.n_kv_head != self.n_head)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1)), (k, v)

    def _forward_plain(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                       ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """A causal pass without a cache (training, scoring, prefill), the same maths in fewer, larger ops:
        one matmul for q, k and v over their concatenated weights (they stay three parameters, which
        pruning and the exporters address by name), and one rotation of q and k together in the
        (B, T, heads, head_dim) layout the CPU attention kernel reads without a copy."""
        B, T, _ = x.shape
        H, K, D = self.n_head, self.n_kv_head, self.head_dim
        qkv = F.linear(x, torch.cat((self.wq.weight, self.wk.weight, self.wv.weight))).view(B, T, H + 2 * K, D)
        qk = apply_rope(qkv[:, :, :H + K], cos[:, None], sin[:, None])
        q, k, v = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2), qkv[:, :, H + K:].transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=K != H)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1)), (k, v)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.d_mlp, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.d_mlp, bias=False)
        self.down = nn.Linear(cfg.d_mlp, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # gate and up stay two matmuls: one over their concatenated weights was no faster here
        # (0.99-1.03x a demo step, benchmarks/train_levers.py).
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cache=None, mask=None):
        h, new_cache = self.attn(self.attn_norm(x), cos, sin, cache, mask)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), new_cache


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        cos, sin = rope_cache(cfg, cfg.block_size)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.activation_checkpointing = False
        self.apply(self._init_weights)
        # GPT-2 style: scale the residual projections by depth so the residual stream stays O(1).
        for name, p in self.named_parameters():
            if name.endswith(("wo.weight", "down.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def compile_forward(self) -> None:
        """torch.compile this model's forward, as training runs it; distillation's fused head loss stays eager."""
        distill_head.keep_out_of_compile()
        self.forward = torch.compile(self.forward)  # type: ignore[method-assign]

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None, start: int = 0,
                targets: torch.Tensor | None = None, distill: Distillation | None = None,
                hidden: bool = False) -> tuple[torch.Tensor, KVCache]:
        """Logits for every position, and the updated KV cache. `start` is the position of idx[:, 0].
        Given `targets` (idx's shape), the mean cross-entropy in fp32 takes the logits' place (the
        training loss, computed in LOSS_CHUNKS slices); given `distill` too, the tuple (loss, kd, lm) of
        distillation's fused head loss (models/distill_head.py) does. Losses go through forward so that
        DDP, FSDP and torch.compile see them. `hidden`: the final hidden states (after the norm) instead
        of logits, the teacher's share of a fused distillation loss."""
        T = idx.shape[1]
        if start + T > self.cfg.block_size:
            raise ValueError(f"sequence of {start + T} tokens exceeds the context of {self.cfg.block_size}")
        cos, sin = self.rope_cos[start:start + T], self.rope_sin[start:start + T]
        x = self.tok_emb(idx)
        new_cache: KVCache = []
        for i, block in enumerate(self.blocks):
            layer_cache = cache[i] if cache is not None else None
            if self.activation_checkpointing and self.training and cache is None:
                x, kv = checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x, kv = block(x, cos, sin, layer_cache)
            new_cache.append(kv)
        h = self.norm(x)
        if hidden:
            return h, new_cache
        if distill is not None:
            if targets is None:
                raise ValueError("distill needs the targets: its loss includes the next-token cross-entropy")
            # looked up here, not imported: compile_forward replaces it with the version compile leaves eager
            return distill_head.distillation_head_loss(h, self.lm_head.weight, targets, distill), new_cache
        if targets is None:
            return self.lm_head(h), new_cache
        h, targets = h.view(-1, h.size(-1)), targets.reshape(-1)
        total = sum(F.cross_entropy(self.lm_head(h_part).float(), t_part, reduction="sum")
                    for h_part, t_part in zip(h.chunk(LOSS_CHUNKS), targets.chunk(LOSS_CHUNKS)))
        return total / targets.numel(), new_cache

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (targets are idx shifted by one)."""
        return self(idx, targets=targets)[0]


@torch.no_grad()
def zero_residual_projections(model: Llama) -> None:
    """Zero each block's output projections (attention wo, MLP down): every block starts as the identity
    and the residual stream as the embedding (nanoGPT speedrun's init). Gradients still reach them (their
    inputs are not zero), and the rest of the block learns once they move."""
    for block in model.blocks:
        block.attn.wo.weight.zero_()
        block.mlp.down.weight.zero_()


def param_count(model: nn.Module) -> int:
    """Distinct parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def config_param_count(cfg: LlamaConfig) -> int:
    """Parameters of a model with this config, without building it (equals param_count(Llama(cfg)))."""
    attn = cfg.d_model * (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim + cfg.n_head * cfg.head_dim * cfg.d_model
    per_layer = attn + 3 * cfg.d_model * cfg.d_mlp + 2 * cfg.d_model
    embeddings = cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2)
    return cfg.n_layer * per_layer + embeddings + cfg.d_model


def flops_per_token(cfg: LlamaConfig, seq_len: int | None = None, backward: bool = True) -> float:
    """Training FLOPs per token: 6 x matmul parameters + attention (PaLM appendix B convention);
    with backward=False the forward pass alone, a third of that (2 x parameters + attention).

    The LM head is a matmul whether or not it is tied, so it counts; the embedding lookup does not.
    """
    T = seq_len or cfg.block_size
    attn = cfg.d_model * (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim + cfg.n_head * cfg.head_dim * cfg.d_model
    mlp = 3 * cfg.d_model * cfg.d_mlp
    matmul_params = cfg.n_layer * (attn + mlp) + cfg.d_model * cfg.vocab_size
    training = 6.0 * matmul_params + 12.0 * cfg.n_layer * cfg.n_head * cfg.head_dim * T
    return training if backward else training / 3

"""LlamaConfig: the shape of the decoder, with named sizes (LitGPT style).

The one description of a model's shape: the config's `model` section (tasks/config/settings.py) is made from
these fields (a named size plus any field overridden), with the descriptions given here."""

from __future__ import annotations

import typing
from dataclasses import asdict, dataclass, field, fields
from typing import Any


class ModelConfigError(ValueError):
    """A model shape that cannot work."""


def _doc(default: Any, text: str) -> Any:
    return field(default=default, metadata={"doc": text})


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = field(metadata={"doc": "Token ids (the tokenizer's, never set by hand)."})
    n_layer: int = _doc(4, "Decoder blocks.")
    n_head: int = _doc(4, "Query heads per block.")
    n_kv_head: int = _doc(2, "Key/value heads (grouped-query attention).")
    d_model: int = _doc(256, "Embedding width.")
    d_mlp: int = _doc(704, "SwiGLU hidden width.")
    block_size: int = _doc(256, "Context length in tokens.")
    tie_embeddings: bool = _doc(True, "Share the token embedding and the LM head.")
    rope_theta: float = _doc(10_000.0, "Rotary embedding base.")
    norm_eps: float = _doc(1e-5, "RMSNorm epsilon.")
    # Set explicitly once embedding channels are pruned, since the heads keep their size when d_model shrinks.
    head_dim_override: int | None = _doc(None, "Width of one attention head (empty: d_model / n_head).")

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_head", "n_kv_head", "d_model", "d_mlp", "block_size"):
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"{name}={getattr(self, name)} must be positive")
        for name in ("rope_theta", "norm_eps", "head_dim_override"):
            value = getattr(self, name)
            if value is not None and not 0 < value < float("inf"):
                raise ModelConfigError(f"{name}={value} must be a positive number")
        if self.head_dim_override is None and self.d_model % self.n_head:
            raise ModelConfigError(f"n_head={self.n_head} does not divide d_model={self.d_model}")
        if self.n_head % self.n_kv_head:
            raise ModelConfigError(f"n_kv_head={self.n_kv_head} does not divide n_head={self.n_head}")
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.d_model // self.n_head

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LlamaConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ModelConfigError(f"unknown model config keys: {', '.join(sorted(unknown))}")
        return cls(**data)

    @classmethod
    def named(cls, name: str, vocab_size: int, **overrides: Any) -> LlamaConfig:
        """A named size (SIZES) with some fields set otherwise."""
        if name not in SIZES:
            raise ModelConfigError(f"unknown model size {name!r}; available: {', '.join(SIZES)}")
        return cls(vocab_size=vocab_size, **{**SIZES[name], **overrides})


@dataclass(frozen=True)
class FieldInfo:
    name: str
    type_hint: Any
    metadata: Any


def llama_fields() -> list[FieldInfo]:
    """LlamaConfig's fields with their resolved types (the annotations are strings here)."""
    hints = typing.get_type_hints(LlamaConfig)
    return [FieldInfo(f.name, hints[f.name], f.metadata) for f in fields(LlamaConfig)]


# Named sizes. Parameter counts are for a 4096-token vocabulary with tied embeddings.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_mlp=176, block_size=64),  # ~0.3M
    "demo": dict(n_layer=4, n_head=4, n_kv_head=2, d_model=256, d_mlp=704, block_size=256),  # ~4M
    "small": dict(n_layer=12, n_head=12, n_kv_head=4, d_model=768, d_mlp=2048, block_size=512),  # ~78M
    "medium-320m": dict(n_layer=26, n_head=16, n_kv_head=4, d_model=1024, d_mlp=3072, block_size=512),  # ~318M
    "large-1b": dict(n_layer=22, n_head=32, n_kv_head=4, d_model=2048, d_mlp=5632, block_size=512),  # ~1B
}


# The shapes `model.size: auto` chooses from, smallest first, as (d_model, n_layer): heads of 64 (the demo's),
# half as many KV heads where the head count is even, a SwiGLU width of ~2.75 d_model (the demo's ratio).
# Every width is a multiple of 32, which GGUF q8_0 blocks and the int8 kernels want. The first six span the
# size sweep of benchmarks/size_sweep.py (~0.4M to ~8M parameters at a 4096-token vocabulary).
AUTO_LADDER: tuple[tuple[int, int], ...] = (
    (64, 2), (128, 2), (128, 4), (192, 4), (256, 4), (320, 6),
    (384, 6), (512, 8), (640, 10), (768, 12), (1024, 16), (1024, 24), (1536, 24), (2048, 22),
)
AUTO_HEAD_DIM = 64


def ladder_shape(d_model: int, n_layer: int) -> dict[str, int]:
    """The shape fields of one rung of AUTO_LADDER."""
    n_head = max(1, d_model // AUTO_HEAD_DIM)
    return dict(n_layer=n_layer, d_model=d_model, n_head=n_head, n_kv_head=n_head // 2 if n_head % 2 == 0 else n_head,
                d_mlp=-(-int(2.75 * d_model) // 32) * 32)

"""LlamaConfig: the shape of the decoder, with named sizes (LitGPT style)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


class ModelConfigError(ValueError):
    """A model shape that cannot work."""


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 2
    d_model: int = 256
    d_mlp: int = 704
    block_size: int = 256
    tie_embeddings: bool = True
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    # Width of one attention head. None: d_model // n_head. Set explicitly once embedding
    # channels are pruned, since the heads keep their size when d_model shrinks.
    head_dim_override: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_head", "n_kv_head", "d_model", "d_mlp", "block_size"):
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"{name}={getattr(self, name)} must be positive")
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
        if name not in SIZES:
            raise ModelConfigError(f"unknown model size {name!r}; available: {', '.join(SIZES)}")
        return cls(vocab_size=vocab_size, **{**SIZES[name], **overrides})


# Named sizes. Parameter counts are for a 4096-token vocabulary with tied embeddings.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_mlp=176, block_size=64),  # ~0.3M
    "demo": dict(n_layer=4, n_head=4, n_kv_head=2, d_model=256, d_mlp=704, block_size=256),  # ~4M
    "small": dict(n_layer=12, n_head=12, n_kv_head=4, d_model=768, d_mlp=2048, block_size=512),  # ~78M
    "medium-320m": dict(n_layer=26, n_head=16, n_kv_head=4, d_model=1024, d_mlp=3072, block_size=512),  # ~318M
    "large-1b": dict(n_layer=22, n_head=32, n_kv_head=4, d_model=2048, d_mlp=5632, block_size=512),  # ~1B
}

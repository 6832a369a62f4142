"""Engine section of a profile: which rollout backend and how big its KV cache is."""

from __future__ import annotations

from dataclasses import dataclass, field

from tiderl.core.config import (
    require,
    require_choice,
    require_non_negative,
    require_positive,
)

BACKENDS = ("embedded", "http", "vllm", "sglang")


@dataclass(frozen=True)
class EngineConfig:
    backend: str = "embedded"
    urls: list[str] = field(default_factory=list)  # one server per rollout rank (non-embedded)
    kv_cache_tokens: int = 16384  # fixed KV pool per rollout rank, never grows
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # chunked-prefill budget per engine step
    max_new_tokens: int = 32  # per turn
    temperature: float = 1.0
    top_p: float = 1.0
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        require_choice(self.backend, BACKENDS, "backend")
        if self.backend != "embedded":
            require(bool(self.urls), "urls", f"expected server URLs for {self.backend!r}")
        for name in ("kv_cache_tokens", "block_size", "max_num_seqs", "max_num_batched_tokens",
                     "max_new_tokens"):
            require_positive(getattr(self, name), name)
        require(self.kv_cache_tokens >= self.block_size, "kv_cache_tokens",
                f"expected >= block_size ({self.block_size}), got {self.kv_cache_tokens}")
        require_non_negative(self.temperature, "temperature")
        require(0.0 < self.top_p <= 1.0, "top_p", f"expected a number in (0, 1], got {self.top_p}")

"""Engine section of a profile: which rollout backend, how big its KV cache is, and how its
servers (backends other than ``embedded``) are started and updated."""

from __future__ import annotations

from dataclasses import dataclass, field

from tiderl.core.config import (
    require,
    require_choice,
    require_non_negative,
    require_positive,
)
from tiderl.core.quote import short
from tiderl.serving.limits import ConnectionLimits

BACKENDS = ("embedded", "http", "vllm", "sglang")
SERVER_BACKENDS = ("http", "vllm", "sglang")  # a server process per rank, beside it
GPU_SERVERS = ("vllm", "sglang")
KERNEL_CHOICES = ("auto", "native", "torch")  # tiderl/engine/kernels.py
KV_ON_UPDATE = ("flush", "keep")
SERVED_MODEL_NAME = "tiderl"  # the model name the launcher gives vLLM and SGLang servers
VLLM_NO_IMAGES = (  # why a model that reads images does not roll out on vLLM
    "vLLM's /v1/completions takes no images beside a token-id prompt, and its token-in "
    "/inference/v1/generate wants the items its own render step serialized; roll out a model "
    "that reads images on engine.backend sglang, http or embedded")
SERVER_UP_TIMEOUT_S = 900.0  # a rank waits this long for its server (vLLM loads for minutes)


@dataclass(frozen=True)
class EngineConfig:
    backend: str = "embedded"
    urls: list[str] = field(default_factory=list)  # running servers, one per rank; empty: the
    # launcher starts one per rank (a rank not rolling out keeps its server asleep)
    server_args: list[str] = field(default_factory=list)  # added to each server's command line
    server_python: str = ""  # vllm / sglang: the Python whose environment has the server (empty:
    # the node's, the job's own; `make vllm-cpu` builds vLLM's CPU backend into another)
    gpu_memory_utilization: float = 0.5  # vllm / sglang: the GPU share a server takes (it
    # sizes its own KV cache in it; the rank beside it trains on the rest)
    host_kv_gib: float = 0.0  # vllm: host memory for KV blocks it evicts (0: none), where a
    # paused task's prefix can wait (--kv-offloading-size)
    keep_versions: int = 2  # weight folders kept on disk per node (the newest)
    kv_on_update: str = "flush"  # flush: no KV of the old weights is hit again; keep: pinned
    # and cached prefixes survive an update (their KV was computed by the previous version)
    kv_cache_tokens: int = 16384  # fixed KV pool per rollout rank, never grows
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # chunked-prefill budget per engine step
    max_new_tokens: int = 32  # per turn
    temperature: float = 1.0
    top_p: float = 1.0
    enable_prefix_caching: bool = True
    kernels: str = "auto"  # embedded: a step's non-GEMM parts in C++ on the CPU (auto: when
    # they build, else plain torch with a warning; native: an error then; torch: never)
    # `tiderl engine serve`'s bounds on a request's arrival and a client's connections
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)

    @property
    def uses_server(self) -> bool:
        return self.backend in SERVER_BACKENDS

    def __post_init__(self) -> None:
        require_choice(self.backend, BACKENDS, "backend")
        require(not self.urls or self.backend in SERVER_BACKENDS, "urls",
                f"server URLs need a server backend ({', '.join(SERVER_BACKENDS)}), "
                f"not {short(self.backend)}")
        require(0.0 < self.gpu_memory_utilization < 1.0, "gpu_memory_utilization",
                f"expected a fraction in (0, 1), got {self.gpu_memory_utilization}")
        require_choice(self.kv_on_update, KV_ON_UPDATE, "kv_on_update")
        require_choice(self.kernels, KERNEL_CHOICES, "kernels")
        require(self.keep_versions >= 2, "keep_versions",  # a server may load the one before
                f"expected at least 2, got {self.keep_versions}")
        require_non_negative(self.host_kv_gib, "host_kv_gib")
        require(not self.host_kv_gib or self.backend == "vllm", "host_kv_gib",
                f"KV offload to host is set for vllm servers only, not {short(self.backend)} "
                "(SGLang's hierarchical cache: engine.server_args)")
        for name in ("kv_cache_tokens", "block_size", "max_num_seqs", "max_num_batched_tokens",
                     "max_new_tokens"):
            require_positive(getattr(self, name), name)
        require(self.kv_cache_tokens >= self.block_size, "kv_cache_tokens",
                f"expected >= block_size ({self.block_size}), got {self.kv_cache_tokens}")
        require_non_negative(self.temperature, "temperature")
        require(0.0 < self.top_p <= 1.0, "top_p", f"expected a number in (0, 1], got {self.top_p}")

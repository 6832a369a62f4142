"""A rollout rank's engine, one interface for the in-process engine and an engine server:

    EmbeddedEngine  the LLMEngine in the rank's process (``engine.backend: embedded``): joining
                    rollout builds it, leaving drops it, new weights are copied in place
    ServerEngine    the rank's own server (``http``: ``tiderl engine serve``; ``vllm``; ``sglang``)
                    through its EngineClient: joining rollout wakes it with the current weights,
                    leaving puts it to sleep (weights and KV freed), new weights go by disk (the
                    version's HF folder, then the server loads it)

The agent loop talks to ``client`` either way; the rank reads ``stats`` for its heartbeat
metrics. Counters in ``stats`` count from the last ``start``, so the rank adds up what each
stint reported, whichever engine it has.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from tiderl.engine.client_metrics import ClientMetrics
from tiderl.engine.clients import (
    EmbeddedClient,
    EngineClient,
    NotSupported,
    _HTTPClient,
)
from tiderl.engine.config import SERVER_UP_TIMEOUT_S, EngineConfig
from tiderl.engine.llm_engine import LLMEngine
from tiderl.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
from tiderl.trainer.export import export_version
from tiderl.trainer.worker import release_free_memory

log = logging.getLogger("tiderl.rank")

SERVER_POLL_S = 0.2


@dataclass(frozen=True, slots=True)
class EngineStats:
    used_tokens: int = 0
    capacity_tokens: int = 0
    running: int = 0
    waiting: int = 0
    prefix_queries: int = 0  # since the last start
    prefix_hits: int = 0
    prefill_tokens_per_s: float = 0.0  # measured by the engine (0: not measured)


class RankEngine(abc.ABC):
    """What the rank does with its engine; ``version`` is that of the weights it serves."""

    version: int = 0

    @property
    @abc.abstractmethod
    def client(self) -> EngineClient: ...

    @abc.abstractmethod
    async def update(self, state: dict[str, torch.Tensor], version: int) -> None: ...

    @abc.abstractmethod
    async def stats(self) -> EngineStats: ...

    @abc.abstractmethod
    async def stop(self) -> EngineStats:
        """Leave rollout (no task runs here any more); the stint's last stats."""

    @abc.abstractmethod
    async def close(self) -> None:
        """The rank exits."""


class EmbeddedEngine(RankEngine):
    def __init__(self, model: Qwen2ForCausalLM, config: EngineConfig, version: int,
                 state: dict[str, torch.Tensor] | None = None,
                 model_folder: str | None = None) -> None:
        """``model_folder``: the profile's (a model that reads images keeps its image
        settings there)."""
        model.eval()
        self.engine = LLMEngine(model, config, model.config.eos_token_id, version,
                                model_folder)
        if state is not None:
            self.engine.update_weights(state, version)
        self.version = version
        self._client = EmbeddedClient(self.engine)

    @property
    def client(self) -> EngineClient:
        return self._client

    async def update(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Load the version's weights, then hand the C allocator's free pages back to the OS:
        the steps' activations come in every size and glibc keeps what they freed, fragmented
        (a rollout rank's RSS settled ~55 MiB lower with this trim at each boundary,
        ``bench/memory_soak.py``; the actors trim after each step for the same reason)."""
        self.engine.update_weights(state, version)
        self.version = version
        await asyncio.to_thread(release_free_memory)  # milliseconds: off the event loop

    async def stats(self) -> EngineStats:
        usage, m = self.engine.token_usage(), await self._client.metrics()
        return EngineStats(usage.num_used_tokens, usage.num_total_tokens,
                           int(m.num_requests_running), int(m.num_requests_waiting),
                           int(m.prefix_cache_queries or 0), int(m.prefix_cache_hits or 0),
                           m.prefill_tokens_per_s or 0.0)

    async def stop(self) -> EngineStats:
        last = await self.stats()
        await self.engine.close()
        return last

    async def close(self) -> None:
        await self.engine.close()


class ServerEngine(RankEngine):
    """A server beside the rank; it outlives the rank's stints in rollout (asleep between)."""

    def __init__(self, client: _HTTPClient, config: EngineConfig, weights_root: Path,
                 model_config: Qwen2Config, tokenizer: Tokenizer, model_path: str = "") -> None:
        self._client = client
        self.config = config
        self.weights_root = weights_root
        self.model_config, self.tokenizer = model_config, tokenizer
        self.model_path = model_path  # the job's model folder: its tokenizer extras go along
        self.asleep = False
        self._base = (0, 0)  # the server's counters at the stint's start

    @property
    def client(self) -> EngineClient:
        return self._client

    async def wait_up(self, serving: bool, timeout_s: float = SERVER_UP_TIMEOUT_S) -> None:
        """Until the server answers /health (the launcher stops the job if it exits); then it
        serves (the rank rolls out) or goes to sleep until the rank joins rollout."""
        deadline = time.monotonic() + timeout_s
        while not await self._client.is_up():
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine server {self._client.base_url} did not answer "
                                   f"/health within {timeout_s:.0f} s")
            await asyncio.sleep(SERVER_POLL_S)
        self._base = await self._counters()
        if not serving:
            await self.sleep()
        log.info("engine server %s up (%s)", self._client.base_url,
                 "serving" if serving else "asleep")

    async def sleep(self) -> None:
        await self._client.sleep()
        self.asleep = True
        log.info("engine server %s: asleep", self._client.base_url)

    async def start(self, version: int, state: dict[str, torch.Tensor] | Path) -> None:
        """Join rollout serving ``version``: wake the server with those weights (``state``,
        exported to disk, or a folder that holds them); an awake server loads them."""
        if not self.asleep:
            if isinstance(state, Path):
                await self._client.update_weights(str(state), version)
            else:
                await self.update(state, version)
        else:
            folder = str(state) if isinstance(state, Path) else await self._export(state, version)
            await self._client.wake_up(folder, version)
            self.asleep = False
            log.info("engine server %s: awake, version %d from %s", self._client.base_url,
                     version, folder)
        self.version = version
        self._base = await self._counters()

    async def update(self, state: dict[str, torch.Tensor], version: int) -> None:
        folder = await self._export(state, version)
        await self._client.update_weights(folder, version)
        self.version = version
        log.info("engine server %s: version %d from %s", self._client.base_url, version, folder)

    async def _export(self, state: dict[str, torch.Tensor], version: int) -> str:
        """The version's folder (off the event loop: heartbeats go on while it is written)."""
        folder = await asyncio.to_thread(export_version, state, self.model_config,
                                         self.tokenizer, self.weights_root, version,
                                         self.config.keep_versions,
                                         source=self.model_path or None)
        return str(folder.resolve())

    async def _usage(self, m: ClientMetrics) -> tuple[int, int]:
        """KV tokens used and held: our server says; vLLM and SGLang give a usage fraction
        and their capacity in ``/metrics``."""
        try:
            usage = await self._client.token_usage()
        except NotSupported:
            capacity = int(m.kv_capacity_tokens or 0)
            return round(m.kv_cache_usage_perc * capacity), capacity
        return usage.num_used_tokens, usage.num_total_tokens

    async def _counters(self) -> tuple[int, int]:
        m = await self._client.metrics()
        return int(m.prefix_cache_queries or 0), int(m.prefix_cache_hits or 0)

    async def stats(self) -> EngineStats:
        m = await self._client.metrics()
        used, capacity = await self._usage(m)
        queries, hits = int(m.prefix_cache_queries or 0), int(m.prefix_cache_hits or 0)
        return EngineStats(used, capacity, int(m.num_requests_running),
                           int(m.num_requests_waiting), queries - self._base[0],
                           hits - self._base[1], m.prefill_tokens_per_s or 0.0)

    async def stop(self) -> EngineStats:
        last = await self.stats()
        await self.sleep()
        return last

    async def close(self) -> None:
        await self._client.close()

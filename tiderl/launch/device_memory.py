"""Whether the ranks sharing a GPU can each fit in their share of its memory, checked before a
CUDA job on this machine starts (``tiderl.launch.job.check_here``).

A rank may hold, at one time, whichever of its roles needs more (ERS moves it between them; the
role it leaves is freed, ``torch.cuda.empty_cache``):

    rollout (embedded engine)   weights (model.dtype) + the KV pool (engine.kv_cache_tokens x
                                layers x 2 x KV heads x head dim, model.dtype)
    trainer                     weights + gradients + AdamW's two moments (model.dtype: 4 copies)
                                + a Ref's weights when trainer.kl_beta > 0

Activations are not counted (they depend on the micro-batch): the check refuses only what cannot
fit at all. With engine servers (vLLM, SGLang) a rank's share is what the servers leave
(``plan.memory_shares``) and only the trainer's part is counted. The parameters are counted from
the model folder's safetensors headers (no tensor is read); a random-init model (no
``model.path``) is small and not checked. The GPUs' memory comes from ``nvidia-smi``; without it
nothing is checked.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tiderl.profile import Profile

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GIB = 2**30


@dataclass(frozen=True)
class RankMemory:
    """What one rank may hold, in bytes, by role."""

    rollout: int
    trainer: int

    @property
    def most(self) -> int:
        return max(self.rollout, self.trainer)


def num_parameters(folder: str | Path) -> int:
    """The parameters of a model folder's ``*.safetensors`` files, from their headers."""
    total = 0
    for file in sorted(Path(folder).glob("*.safetensors")):
        with file.open("rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                count = 1
                for dim in entry["shape"]:
                    count *= dim
                total += count
    return total


def rank_memory(profile: Profile, num_params: int, config: dict) -> RankMemory:
    """A rank's bytes by role (the module docstring)."""
    b = DTYPE_BYTES.get(profile.model.dtype, 4)
    weights = num_params * b
    trainer = 4 * weights + (weights if profile.trainer.kl_beta else 0)
    text = config.get("text_config") or config
    heads = text.get("num_key_value_heads") or text.get("num_attention_heads") or 0
    head_dim = text.get("head_dim") or (text.get("hidden_size", 0)
                                        // max(1, text.get("num_attention_heads") or 1))
    kv = profile.engine.kv_cache_tokens * text.get("num_hidden_layers", 0) * 2 * heads \
        * head_dim * b
    engine = profile.engine
    rollout = 0 if engine.uses_server and not engine.urls else weights + kv
    return RankMemory(rollout=rollout, trainer=trainer)


def gpu_memory_bytes() -> list[int] | None:
    """Each visible GPU's memory, from ``nvidia-smi`` (None without it)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return [int(float(line)) * 2**20 for line in out.split()]
    except (subprocess.SubprocessError, OSError, ValueError):
        return None


def shortfall(profile: Profile, share: int, device_bytes: int, fraction: float,
              folder: str) -> str | None:
    """Why a rank cannot fit in ``fraction`` of a GPU of ``device_bytes`` that ``share`` ranks
    share (one line), or None when it can."""
    config = json.loads((Path(folder) / "config.json").read_text())
    need = rank_memory(profile, num_parameters(folder), config)
    have = device_bytes * fraction
    if need.most <= have:
        return None
    role = "its trainer role" if need.trainer >= need.rollout else "its rollout role"
    return (f"runtime.num_ranks {profile.runtime.num_ranks}: {share} ranks share each "
            f"{device_bytes / GIB:.1f} GiB GPU, so a rank has {have / GIB:.2f} GiB, but "
            f"{role} needs {need.most / GIB:.2f} GiB before activations (docs/launch.md); "
            "use fewer ranks, more GPUs or a smaller model")


def check_device_memory(profile: Profile, gpus: list[int] | None, num_devices: int | None
                        ) -> str | None:
    """The one line that refuses a CUDA job on this machine whose ranks cannot fit their share
    of its GPUs (``gpus``: each one's bytes; None or no model folder: not checked)."""
    folder = profile.model.path
    if not gpus or not folder or profile.runtime.device != "cuda":
        return None
    from tiderl.launch.plan import memory_shares

    count = num_devices or len(gpus)
    share = -(-profile.runtime.num_ranks // count)
    if share > 1:
        fraction = memory_shares(profile, share)[0]
    else:
        uses_servers = profile.engine.uses_server and not profile.engine.urls
        fraction = 1.0 - profile.engine.gpu_memory_utilization if uses_servers else 1.0
    return shortfall(profile, share, min(gpus), fraction, folder)

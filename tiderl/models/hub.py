"""Models by hub id: a ``model.path`` that is not a folder, such as ``Qwen/Qwen2.5-7B-Instruct``,
is resolved with ``huggingface_hub`` to a snapshot folder in its cache.

    resolve_model("Qwen/Qwen2.5-0.5B", "main") -> Resolved(folder=<HF_HOME>/hub/models--Qwen--
        Qwen2.5-0.5B/snapshots/<commit>, repo_id="Qwen/Qwen2.5-0.5B", revision=<commit>)

``huggingface_hub`` does the work, as a user of transformers or vLLM expects: it honours
``HF_HOME`` / ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE`` (the cache only) and ``HF_TOKEN``, downloads
what is missing once (file locks make concurrent resolutions on one node safe) and answers from
the cache when the hub cannot be reached. Only the files a model folder needs are fetched
(:data:`MODEL_FILES`: configs, safetensors shards, tokenizer files), not other weight formats.
The launcher resolves once per node before anything starts (``tiderl.launch.nodectl model``)
and pins the commit it got (``model.revision``), so every process of a job loads the same
weights; every failure is one line naming the id.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

# "name" or "owner/name": letters, digits, "-", "_", "." (hub ids; no leading "." or "-")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
MODEL_TIMEOUT_S = 3600  # a node's resolution, over SSH or in a job step: a first download
MAX_ID_LEN = 200  # the hub's owner and name are 96 characters at most each
MODEL_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt",
               "*.jinja"]


class HubError(ValueError):
    """A hub id that cannot be resolved here (one line, naming it)."""


@dataclass(frozen=True)
class Resolved:
    folder: str  # the folder to load (the path itself when it is not a hub id)
    repo_id: str = ""  # the hub id ("" for a local folder)
    revision: str = ""  # the commit the id resolved to ("" for a local folder)


def is_hub_id(path: str) -> bool:
    """Whether ``path`` names a hub model rather than a folder: not an existing path, and
    spelled as a hub id (a relative path such as ``models/qwen`` that does not exist is one,
    as transformers reads it)."""
    if not path or len(path) > MAX_ID_LEN or HUB_ID.match(path) is None or ".." in path:
        return False
    try:
        return not Path(path).exists()
    except OSError:  # not a name the system takes: the folder check says why
        return False


def resolve_model(path: str, revision: str = "") -> Resolved:
    """``path`` itself when it is empty or a folder; a hub id's snapshot folder (downloaded when
    missing and the hub is reachable) and the commit it resolved to, at ``revision`` (a branch,
    tag or commit; empty: ``main``). HubError (one line) when it cannot be."""
    if not is_hub_id(path):
        return Resolved(path)
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f"{path}@{revision}" if revision else path
    try:
        folder = snapshot_download(path, revision=revision or None, allow_patterns=MODEL_FILES)
    except GatedRepoError:
        raise HubError(f"model.path {at}: a gated model; accept its terms on the hub and set "
                       "HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise HubError(f"model.path {at}: no such model on the hub (a typo, or private: set "
                       "HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise HubError(f"model.revision {revision}: not a branch, tag or commit of {path}") \
            from None
    except IncompleteSnapshotError:
        raise HubError(f"model.path {at}: its snapshot in the hub cache ({constants.HF_HUB_CACHE}) "
                       "is incomplete and the hub could not complete it") from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE \
            else "the hub could not be reached"
        raise HubError(f"model.path {at}: not in the hub cache ({constants.HF_HUB_CACHE}) and "
                       f"{why}") from None
    except (HfHubHTTPError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise HubError(f"model.path {at}: {first}") from None
    return Resolved(folder, path, Path(folder).name)

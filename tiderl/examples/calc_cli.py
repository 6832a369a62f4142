"""The calc task as a command-line agent: its own process, configured by its environment alone
(``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``TIDERL_TASK``), its reward printed last. It runs the
OpenAI agent's loop (:mod:`tiderl.examples.calc_openai`).

In a profile::

    env:
      envs: [calc-cli]
      agents:
        calc-cli: {command: "python -m tiderl.examples.calc_cli"}

Any language does the same: read ``TIDERL_TASK``, call the model at ``OPENAI_BASE_URL`` with
``OPENAI_API_KEY``, print ``{"reward": r}``.
"""

from __future__ import annotations

import asyncio
import json
import os
from types import SimpleNamespace

import openai

from tiderl.examples.calc_openai import run


async def play(task: SimpleNamespace) -> float:
    async with openai.AsyncOpenAI() as client:  # the base URL and key from the environment
        return await run(task, client)


def main() -> None:
    task = SimpleNamespace(**json.loads(os.environ["TIDERL_TASK"]))
    print(json.dumps({"reward": asyncio.run(play(task))}))


if __name__ == "__main__":
    main()

"""TRL's GRPOTrainer on the one-turn guess game, as a user would run it: the peer of
``bench/job_vs_bare.py --game one-token``.

It runs in a virtual environment of its own (TRL pins its own transformers; TideRL does not
depend on either), made once:

    python3 -m venv /tmp/trl-venv
    /tmp/trl-venv/bin/pip install torch==2.13.0 && /tmp/trl-venv/bin/pip install trl msgspec

and is started by ``job_vs_bare.py --trl-python /tmp/trl-venv/bin/python`` with a JSON spec on
stdin (written by the job's side, so both sides play the same tasks):

- ``model``: an HF folder (the job's export of its step-0 model: same config, same weights,
  same word-level ``tokenizer.json``); ``prompts``: one row per group (the guess game's first
  observation, the task's range, its seed); ``group_size``, ``groups`` per step, ``steps``,
  ``lr``, ``max_turns``, ``partial_credit``; ``config``: GRPOConfig fields to set (``bf16``).

The game is one turn of one token: each completion is scored by ``GuessEnv.step`` on the
decoded token (TideRL's own environment, imported from this checkout). GRPOConfig: B = groups x
group_size completions per optimizer step (``per_device_train_batch_size`` = B,
``num_generations`` = group_size), ``max_completion_length`` 1, temperature 1, ``beta`` 0 (no
Ref, as the job's ``kl_beta=0``), the job's learning rate, no checkpoints, no logging, torch on
every core. Measured: the wall time of ``trainer.train()`` (model and data already built, as
the job's clock starts once its ranks are up); prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tiderl.env.guess only


def main() -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    from tiderl.env.guess import GuessEnv

    spec = json.load(sys.stdin)
    torch.set_num_threads(os.cpu_count() or 1)
    folder = spec["model"]
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(Path(folder) / "tokenizer.json"),
                                        pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                        unk_token="<unk>", padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    rows = spec["prompts"] * spec["steps"]  # one pass: a step takes `groups` rows in order
    data = Dataset.from_list(rows)

    def reward(prompts, completions, task, seed, **_):
        scores = []
        for completion, text, s in zip(completions, task, seed, strict=True):
            env = GuessEnv(max_turns=spec["max_turns"], partial_credit=spec["partial_credit"])
            env.reset(text, s)
            scores.append(env.step(completion).reward)
        return scores

    batch = spec["groups"] * spec["group_size"]
    config = GRPOConfig(output_dir=spec["out_dir"], max_steps=spec["steps"],
                        per_device_train_batch_size=batch, num_generations=spec["group_size"],
                        max_completion_length=1, temperature=1.0, beta=0.0,
                        learning_rate=spec["lr"], lr_scheduler_type="constant",
                        use_cpu=True, report_to="none", save_strategy="no",
                        logging_strategy="no", shuffle_dataset=False, seed=0,
                        dataloader_num_workers=0, disable_tqdm=True, **spec.get("config", {}))
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data,
                          processing_class=tokenizer)
    start = time.monotonic()
    trainer.train()
    wall = time.monotonic() - start
    episodes = spec["steps"] * batch
    print(json.dumps({"episodes_per_s": round(episodes / wall, 3), "wall_s": round(wall, 2),
                      "steps": spec["steps"], "episodes": episodes,
                      "threads": torch.get_num_threads(),
                      "versions": {m: sys.modules[m].__version__
                                   for m in ("trl", "transformers", "torch")}}))


if __name__ == "__main__":
    main()

"""`tiderl model init`: a seeded random checkpoint and tokenizer for CPU runs."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from tiderl.cli.errors import EXIT_USAGE, CLIError
from tiderl.cli.options import MAX_SEED, count_option
from tiderl.cli.output import JsonFlag, Output, table
from tiderl.core.quote import short
from tiderl.models.config import MODEL_SIZES, TOKENIZER_KINDS

app = typer.Typer(help="Local model checkpoints.", no_args_is_help=True)


@app.command("init")
def init(
    size: str = typer.Option(
        "tiny", "--size",
        help="tiny, small, or tiny-vl: a Qwen2-VL (tiny's language part and a small vision "
             "tower) whose tokenizer adds <|vision_start|>, <|vision_end|> and <|image_pad|>."),
    out: Path = typer.Option(..., "--out", help="Output folder."),
    seed: int = count_option(0, "--seed", maximum=MAX_SEED),
    tokenizer: str = typer.Option(
        "word", "--tokenizer",
        help="word: the word list of the built-in environments (the embedded default); bpe: a "
             "byte-level BPE trained here on their text, with a chat template (any text)."),
    force: bool = typer.Option(
        False, "--force", help="Write into a folder that is not empty: the model files in it "
                               "are replaced, other files are left."),
    json_mode: bool = JsonFlag,
) -> None:
    """Write config.json, model.safetensors and the tokenizer files for a random-init model
    (tiny-vl: also generation_config.json and preprocessor_config.json).

    The folder must be new or empty, unless --force."""
    if size not in MODEL_SIZES:
        raise CLIError(f"tiderl model init: unknown --size {short(size)} "
                       f"(known: {', '.join(MODEL_SIZES)})", EXIT_USAGE)
    if tokenizer not in TOKENIZER_KINDS:
        raise CLIError(f"tiderl model init: unknown --tokenizer {short(tokenizer)} "
                       f"(known: {', '.join(TOKENIZER_KINDS)})", EXIT_USAGE)
    _check_out(out, force)
    from tiderl.models.random_init import (
        write_random_checkpoint,  # late: `tiderl --help` stays fast
    )

    paths = write_random_checkpoint(size, out, seed, tokenizer)
    payload = {"size": size, "seed": seed, "tokenizer": tokenizer, "out": str(out),
               "files": {p.name: p.stat().st_size for p in paths}}
    Output(json_mode).result(payload, lambda console: _render(console, payload))


def _check_out(out: Path, force: bool) -> None:
    """Exit 2 before anything is loaded when --out is a file, or a folder with files in it and
    no --force."""
    if out.exists() and not out.is_dir():
        raise CLIError(f"tiderl model init: --out {out} is a file, not a folder", EXIT_USAGE)
    if not force and out.is_dir() and any(out.iterdir()):
        raise CLIError(f"tiderl model init: --out {out} is not empty; choose a new folder, or "
                       "give --force to replace the model files in it", EXIT_USAGE)


def _render(console: Console, payload: dict) -> None:
    console.print(table(f"model init: {payload['size']}, seed {payload['seed']}",
                        ("file", "bytes"), list(payload["files"].items())))
    console.print(f"written to {payload['out']}", markup=False)

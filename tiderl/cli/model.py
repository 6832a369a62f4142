"""`tiderl model init`: a seeded random checkpoint and tokenizer for CPU runs."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from tiderl.cli.errors import EXIT_USAGE, CLIError
from tiderl.cli.output import JsonFlag, Output, table
from tiderl.models.config import MODEL_SIZES, TOKENIZER_KINDS

app = typer.Typer(help="Local model checkpoints.", no_args_is_help=True)


@app.command("init")
def init(
    size: str = typer.Option("tiny", "--size", help="tiny or small."),
    out: Path = typer.Option(..., "--out", help="Output folder."),
    seed: int = typer.Option(0, "--seed"),
    tokenizer: str = typer.Option(
        "word", "--tokenizer",
        help="word: the word list of the built-in environments (the embedded default); bpe: a "
             "byte-level BPE trained here on their text, with a chat template (any text)."),
    json_mode: bool = JsonFlag,
) -> None:
    """Write config.json, model.safetensors and the tokenizer files for a random-init model."""
    if size not in MODEL_SIZES:
        raise CLIError(f"tiderl model init: unknown --size {size!r} "
                       f"(known: {', '.join(MODEL_SIZES)})", EXIT_USAGE)
    if tokenizer not in TOKENIZER_KINDS:
        raise CLIError(f"tiderl model init: unknown --tokenizer {tokenizer!r} "
                       f"(known: {', '.join(TOKENIZER_KINDS)})", EXIT_USAGE)
    from tiderl.models.init import write_random_checkpoint  # late: `tiderl --help` stays fast

    paths = write_random_checkpoint(size, out, seed, tokenizer)
    payload = {"size": size, "seed": seed, "tokenizer": tokenizer, "out": str(out),
               "files": {p.name: p.stat().st_size for p in paths}}
    Output(json_mode).result(payload, lambda console: _render(console, payload))


def _render(console: Console, payload: dict) -> None:
    console.print(table(f"model init: {payload['size']}, seed {payload['seed']}",
                        ("file", "bytes"), list(payload["files"].items())))
    console.print(f"written to {payload['out']}", markup=False)

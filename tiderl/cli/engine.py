"""`tiderl engine serve`: run the embedded rollout engine alone behind its HTTP API."""

from __future__ import annotations

from pathlib import Path

import typer

from tiderl.cli.errors import EXIT_USAGE, CLIError
from tiderl.cli.output import Output

app = typer.Typer(help="The embedded rollout engine.", no_args_is_help=True)


@app.command("serve")
def serve(
    model: Path = typer.Option(..., "--model", help="HF-format model folder."),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port"),
    kv_cache_tokens: int = typer.Option(16384, "--kv-cache-tokens", help="KV pool size."),
) -> None:
    """OpenAI-compatible /v1/completions with token ids, /metrics, admin routes."""
    if not model.is_dir():
        raise CLIError(f"tiderl engine serve: --model {model}: no such folder", EXIT_USAGE)
    # late imports: torch loads only when a server really starts
    from tiderl.engine.config import EngineConfig
    from tiderl.engine.llm_engine import LLMEngine
    from tiderl.engine.server import serve as serve_app
    from tiderl.models.config import ModelConfig
    from tiderl.models.loading import ModelLoadError, load_tokenizer

    engine_config = EngineConfig(kv_cache_tokens=kv_cache_tokens)
    try:
        engine = LLMEngine.from_configs(ModelConfig(path=str(model)), engine_config)
        tokenizer = load_tokenizer(model)
    except ModelLoadError as exc:
        raise CLIError(f"tiderl engine serve: {exc}", EXIT_USAGE) from exc
    Output().note(f"tiderl engine: {model} on http://{host}:{port} "
                  f"(KV pool {kv_cache_tokens} tokens)")
    serve_app(engine, host, port, tokenizer, model_name=model.name)

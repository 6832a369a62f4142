"""`tiderl engine serve`: run the embedded rollout engine alone behind its HTTP API."""

from __future__ import annotations

from pathlib import Path

import typer

from tiderl.cli.errors import EXIT_USAGE, CLIError, check_port_free
from tiderl.cli.output import Output

app = typer.Typer(help="The embedded rollout engine.", no_args_is_help=True)


@app.command("serve")
def serve(
    model: Path | None = typer.Option(None, "--model",
                                      help="HF-format model folder (default: a seeded random "
                                           "model of --size)."),
    size: str = typer.Option("tiny", "--size", help="Random-init model size without --model."),
    seed: int = typer.Option(0, "--seed", help="Its seed (the profile's model.seed)."),
    dtype: str = typer.Option("float32", "--dtype", help="float32 or bfloat16."),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port", min=1, max=65535),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda:N."),
    kv_cache_tokens: int = typer.Option(16384, "--kv-cache-tokens", help="KV pool size."),
    block_size: int = typer.Option(16, "--block-size"),
    max_num_seqs: int = typer.Option(64, "--max-num-seqs"),
    max_num_batched_tokens: int = typer.Option(2048, "--max-num-batched-tokens"),
    prefix_caching: bool = typer.Option(True, "--prefix-caching/--no-prefix-caching"),
    kv_on_update: str = typer.Option("flush", "--kv-on-update",
                                     help="flush or keep the cached KV on a weight update."),
    kernels: str = typer.Option("auto", "--kernels",
                                help="auto, native or torch: a step's non-GEMM parts in C++ on "
                                     "the CPU (auto: when they build)."),
    admin_token: str | None = typer.Option(
        None, "--admin-token", envvar="TIDERL_ADMIN_TOKEN", show_envvar=True,
        help="Bearer token the /tiderl/ admin routes require (without one they answer "
             "loopback clients only)."),
) -> None:
    """OpenAI-compatible /v1/completions with token ids, /metrics, admin routes."""
    if model is not None and not model.is_dir():
        raise CLIError(f"tiderl engine serve: --model {model}: no such folder", EXIT_USAGE)
    from tiderl.core.config import ConfigError
    from tiderl.engine.config import EngineConfig
    from tiderl.models.config import ModelConfig

    try:
        engine_config = EngineConfig(
            kv_cache_tokens=kv_cache_tokens, block_size=block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=prefix_caching,
            kv_on_update=kv_on_update, kernels=kernels)
        model_config = ModelConfig(path=str(model or ""), size=size, seed=seed, dtype=dtype)
    except ConfigError as exc:
        raise CLIError(f"tiderl engine serve: {exc}", EXIT_USAGE) from None
    check_port_free("tiderl engine serve", host, port)  # before torch and the model load
    name = model.name if model is not None else f"tiderl-{size}"

    def load():  # in the server's loader thread, while /health answers 503 "loading"
        from tiderl.engine.llm_engine import LLMEngine
        from tiderl.models.loading import ModelLoadError, model_from_config

        try:
            weights, tokenizer = model_from_config(model_config, device)
        except (ModelLoadError, RuntimeError) as exc:
            raise CLIError(f"tiderl engine serve: {exc}", EXIT_USAGE) from None
        engine = LLMEngine(weights, engine_config, weights.config.eos_token_id,
                           model_folder=str(model) if model else None)
        Output().note(f"tiderl engine: {model or name} on http://{host}:{port} "
                      f"(KV pool {kv_cache_tokens} tokens, {device})")
        return engine, tokenizer

    # uvicorn only: the socket opens at once, torch and the model load behind it
    from tiderl.engine.starting import serve_loading

    serve_loading(load, host, port, model_name=name, admin_token=admin_token)

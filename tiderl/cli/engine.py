"""`tiderl engine serve`: run the embedded rollout engine alone behind its HTTP API."""

from __future__ import annotations

from pathlib import Path

import typer

from tiderl.cli.errors import EXIT_USAGE, CLIError, check_port_free
from tiderl.cli.options import ProfileOpt, SetOpt, port_option
from tiderl.cli.output import Output

app = typer.Typer(help="The embedded rollout engine.", no_args_is_help=True)


@app.command("serve")
def serve(
    profile: str = ProfileOpt,
    overrides: list[str] | None = SetOpt,
    model: Path | None = typer.Option(None, "--model", metavar="DIR",
                                      help="HF-format model folder: the same as --set "
                                           "model.path=DIR."),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = port_option(8000),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda:N."),
    admin_token: str | None = typer.Option(
        None, "--admin-token", envvar="TIDERL_ADMIN_TOKEN", show_envvar=True,
        help="Bearer token the /tiderl/ admin routes require (without one they answer "
             "loopback clients only)."),
) -> None:
    """OpenAI-compatible /v1/completions with token ids, /metrics, admin routes.

    The profile's model and engine sections configure it, as they configure every daemon of a
    job: the model folder (model.path, or a seeded random model of model.size), its dtype, the
    KV pool and the scheduler's limits, e.g. --set engine.kv_cache_tokens=4096."""
    if model is not None and not model.is_dir():
        raise CLIError(f"tiderl engine serve: --model {model}: no such folder", EXIT_USAGE)
    from tiderl.profile import load_profile

    resolved = load_profile(profile, [*(overrides or []),
                                      *([f"model.path={model}"] if model is not None else [])])
    model_config, engine_config = resolved.model, resolved.engine
    folder = Path(model_config.path) if model_config.path else None
    if folder is not None and not folder.is_dir():
        raise CLIError(f"tiderl engine serve: model.path {folder}: no such folder", EXIT_USAGE)
    check_port_free("tiderl engine serve", host, port)  # before torch and the model load
    name = folder.name if folder is not None else f"tiderl-{model_config.size}"

    def load():  # in the server's loader thread, while /health answers 503 "loading"
        from tiderl.engine.llm_engine import LLMEngine
        from tiderl.models.loading import ModelLoadError, model_from_config

        try:
            weights, tokenizer = model_from_config(model_config, device)
        except (ModelLoadError, RuntimeError) as exc:
            raise CLIError(f"tiderl engine serve: {exc}", EXIT_USAGE) from None
        engine = LLMEngine(weights, engine_config, weights.config.eos_token_id,
                           model_folder=str(folder) if folder is not None else None)
        Output().note(f"tiderl engine: {folder or name} on http://{host}:{port} "
                      f"(KV pool {engine_config.kv_cache_tokens} tokens, {device})")
        return engine, tokenizer

    # uvicorn only: the socket opens at once, torch and the model load behind it
    from tiderl.engine.loading_server import serve_loading

    serve_loading(load, host, port, model_name=name, admin_token=admin_token,
                  limits=engine_config.connections)

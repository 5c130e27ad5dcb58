"""The `wattserve` command line: serve, generate, config show, models, bench, device, fleet.

Parses flags into per-section config overrides and dispatches; errors the user can fix
(bad config, unloadable model) end as one line on stderr and a non-zero exit, never a
traceback. It must not hold serving logic itself.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from wattserve.daemon.config import Config, ConfigError, default_cache_dir, load_config, render_toml

# flag -> (section, key); the common keys a user sets from the shell.
_FLAGS: dict[str, tuple[str, str, type]] = {
    "--host": ("server", "host", str),
    "--port": ("server", "port", int),
    "--model": ("engine", "model", str),
    "--dtype": ("engine", "dtype", str),
    "--engine-device": ("engine", "device", str),
    "--max-num-seqs": ("engine", "max_num_seqs", int),
    "--max-num-batched-tokens": ("engine", "max_num_batched_tokens", int),
    "--max-model-len": ("engine", "max_model_len", int),
    "--kv-cache-bytes": ("engine", "kv_cache_bytes", int),
    "--threads": ("engine", "threads", int),
    "--device-backend": ("device", "backend", str),
    "--device-mode": ("device", "mode", str),
    "--controller-mode": ("controller", "mode", str),
    "--power-budget-w": ("controller", "power_budget_w", float),
}


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", help="TOML config file (also WATTSERVE_CONFIG)")
    for flag, (section, key, typ) in _FLAGS.items():
        p.add_argument(flag, dest=f"{section}__{key}", type=typ, default=None, metavar=key.upper())


def _config_from_args(args: argparse.Namespace) -> Config:
    overrides: dict[str, dict[str, object]] = {}
    for dest, value in vars(args).items():
        if "__" in dest and value is not None:
            section, key = dest.split("__", 1)
            overrides.setdefault(section, {})[key] = value
    return load_config(args.config, overrides)


REDACTED = "<redacted>"


def _is_secret(key: str) -> bool:
    """A field holding a secret itself (api_token, a password); *_file fields hold paths."""
    return key.endswith(("token", "password", "secret"))


def redact_secrets(cfg: Config) -> Config:
    """A copy for display with every secret that is set replaced by REDACTED."""
    sections = {}
    for name in type(cfg).model_fields:
        section = getattr(cfg, name)
        secrets = {
            key: REDACTED
            for key in type(section).model_fields
            if _is_secret(key) and getattr(section, key) is not None
        }
        if secrets:
            sections[name] = section.model_copy(update=secrets)
    return cfg.model_copy(update=sections)


def _cmd_config_show(args: argparse.Namespace) -> int:
    cfg = _config_from_args(args)
    print(render_toml(redact_secrets(cfg)), end="")  # it ends up in terminals and tickets
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from wattserve.daemon.engine.engine import Engine, EngineOptions
    from wattserve.daemon.engine.loader import load_model
    from wattserve.daemon.engine.placement import resolve_placement
    from wattserve.daemon.engine.request import SamplingParams

    cfg = _config_from_args(args)
    placement = resolve_placement(cfg.engine.device, cfg.device.gpu, cfg.device.backend)
    loaded = load_model(
        cfg.engine.model,
        cfg.engine.cache_dir or default_cache_dir(),
        cfg.engine.dtype,
        placement.device.type,
    )
    engine = Engine(loaded, EngineOptions.from_config(cfg.engine), placement.device)
    prompt = args.prompt
    if not args.raw:
        prompt = loaded.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    out = engine.generate([prompt], params)[0]
    print(out.text)
    print(
        f"[{out.completion_tokens} tokens, finish_reason={out.finish_reason}, "
        f"model loaded in {loaded.load_time_s:.1f} s]",
        file=sys.stderr,
    )
    return 0


def _cmd_device(args: argparse.Namespace) -> int:
    from wattserve.daemon.device.commands import device_info, device_reset

    if args.device_command == "trace":
        from wattserve.bench import device_trace

        return device_trace.main(args.trace_argv)
    cfg = _config_from_args(args)
    return device_info(cfg, args) if args.device_command == "info" else device_reset(cfg, args)


def _cmd_serve(args: argparse.Namespace) -> int:
    from wattserve.daemon import server

    return server.main(_config_from_args(args))


def _cmd_models_check(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from wattserve.daemon.engine.loader import _quiet_transformers
    from wattserve.daemon.engine.model_check import (
        check_model_dir,
        device_memory_bytes,
        format_report,
    )

    _quiet_transformers()
    report = check_model_dir(Path(args.dir).expanduser(), device_memory_bytes(args.device))
    print(json.dumps(report) if args.json else format_report(report))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.which == "models":
        from wattserve.bench import models as bench_models

        return bench_models.main(args.rest)
    if args.which == "engine":
        from wattserve.bench import engine as bench_engine

        return bench_engine.main(args.rest)
    if args.which == "quant":
        from wattserve.bench import quant as bench_quant

        return bench_quant.main(args.rest)
    if args.which == "serve":
        from wattserve.bench import serve as bench_serve

        return bench_serve.main(args.rest)
    if args.which == "prefix":
        from wattserve.bench import prefix as bench_prefix

        return bench_prefix.main(args.rest)
    if args.which == "control":
        from wattserve.bench import control as bench_control

        return bench_control.main(args.rest)
    if args.which == "gpu":
        from wattserve.bench import gpu as bench_gpu

        return bench_gpu.main(args.rest)
    if args.which == "control-ceiling":
        from wattserve.bench import control_ceiling

        return control_ceiling.main(args.rest)
    if args.which == "control-noise":
        from wattserve.bench import control_noise

        return control_noise.main(args.rest)
    if args.which == "fleet":
        from wattserve.bench import fleet as bench_fleet

        return bench_fleet.main(args.rest)
    print(f"wattserve: error: unknown benchmark {args.which!r}", file=sys.stderr)
    return 2


def _cmd_fleet(args: argparse.Namespace) -> int:
    from wattserve.daemon import fleet_service

    return fleet_service.main(args.config)


def _cmd_install_service(args: argparse.Namespace) -> int:
    """Print the systemd unit systemd/install.sh installs (from a checkout or the venv)."""
    from pathlib import Path

    if not args.print:
        print(
            "wattserve install-service: run systemd/install.sh as root to install the "
            "service; --print shows the unit",
            file=sys.stderr,
        )
        return 2
    name = "wattserve-control.conf" if args.control else "wattserve.service"
    places = [
        Path(__file__).resolve().parents[2] / "systemd",  # a source checkout
        Path(sys.prefix) / "share" / "wattserve" / "systemd",  # /opt/wattserve by install.sh
    ]
    for place in places:
        if (place / name).is_file():
            print((place / name).read_text(), end="")
            return 0
    print(
        f"wattserve install-service: {name} not found in {' or '.join(map(str, places))}",
        file=sys.stderr,
    )
    return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wattserve", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("config", help="configuration")
    csub = p.add_subparsers(dest="config_command", required=True)
    show = csub.add_parser(
        "show", help="print the effective configuration as TOML (secrets redacted)"
    )
    _add_config_flags(show)
    show.set_defaults(func=_cmd_config_show)

    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API until SIGTERM")
    _add_config_flags(p)
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("generate", help="generate one completion offline (no server)")
    _add_config_flags(p)
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--raw", action="store_true", help="no chat template around the prompt")
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("device", help="the GPU (or virtual GPU) the daemon would use")
    dsub = p.add_subparsers(dest="device_command", required=True)
    info = dsub.add_parser("info", help="identity, capabilities, one telemetry snapshot")
    _add_config_flags(info)
    info.add_argument("--json", action="store_true", help="one JSON object")
    info.set_defaults(func=_cmd_device)
    reset = dsub.add_parser("reset", help="restore the settings a run recorded (ExecStopPost)")
    _add_config_flags(reset)
    reset.set_defaults(func=_cmd_device)
    trace = dsub.add_parser(
        "trace", help="sweep the virtual GPU's clock under real load", add_help=False
    )
    # Its flags are wattserve/bench/device_trace.py's (main passes them on): bench is imported only
    # when it runs, never by the daemon.
    trace.set_defaults(func=_cmd_device)

    p = sub.add_parser("fleet", help="the fleet allocator: one site budget over many nodes")
    p.add_argument(
        "--config", "-c", required=True, help="the allocator's TOML file (docs/fleet.md)"
    )
    p.set_defaults(func=_cmd_fleet)

    p = sub.add_parser("install-service", help="the systemd unit (install: systemd/install.sh)")
    p.add_argument("--print", action="store_true", help="print the unit install.sh installs")
    p.add_argument("--control", action="store_true", help="print the control-mode drop-in instead")
    p.set_defaults(func=_cmd_install_service)

    p = sub.add_parser("models", help="model directories")
    msub = p.add_subparsers(dest="models_command", required=True)
    check = msub.add_parser(
        "check", help="architecture, parameters, bytes per level and fit, before a start"
    )
    check.add_argument("dir", help="a Hugging Face model directory")
    check.add_argument("--device", default="cpu", help="cpu or cuda[:N] (whose memory to fit)")
    check.add_argument("--json", action="store_true", help="one JSON object")
    check.set_defaults(func=_cmd_models_check)

    p = sub.add_parser("bench", help="benchmarks (each prints one JSON line last)")
    p.add_argument(
        "which",
        choices=[
            "engine",
            "serve",
            "quant",
            "prefix",
            "control",
            "control-ceiling",
            "control-noise",
            "gpu",
            "fleet",
            "models",
        ],
    )
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    from wattserve.daemon.engine.loader import LoadError
    from wattserve.daemon.engine.placement import PlacementError
    from wattserve.daemon.engine.request import InvalidRequestError

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if getattr(args, "device_command", None) == "trace":
        args.trace_argv = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except (ConfigError, LoadError, InvalidRequestError, PlacementError) as e:
        print(f"wattserve: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1


if __name__ == "__main__":
    raise SystemExit(main())

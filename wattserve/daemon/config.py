"""Effective configuration: defaults < TOML file < WATTSERVE_* environment < CLI flags.

Every key lives in one of the sections [server], [engine], [device], [controller],
[mqtt], [fleet], and every key can also be set as WATTSERVE_<SECTION>__<KEY>. The result is
frozen: nothing may write values back into it at runtime; values derived at runtime
(the KV pool size, the chosen device backend) live in their own objects.
Unknown keys and bad values raise ConfigError with one line naming the key.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from wattserve.daemon.engine.scheduler import DECODE_INTERVAL_MAX_MS  # plain Python, no torch

ENV_PREFIX = "WATTSERVE_"
# Stand-alone variables that are not section keys.
STANDALONE_ENV = {"WATTSERVE_CACHE", "WATTSERVE_API_TOKEN", "WATTSERVE_CONFIG"}


class ConfigError(ValueError):
    """A configuration problem, worded as one line that names the key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    allowed_hosts: list[str] = Field(
        default_factory=lambda: ["localhost", "127.0.0.1", "[::1]", "::1"],
        description="Host header allowlist (DNS-rebinding defence); the bound address is added.",
    )
    max_body_bytes: int = Field(1 << 20, gt=0)
    max_waiting_requests: int = Field(256, ge=0)
    drain_timeout_s: float = Field(30.0, ge=0)
    api_token: str | None = Field(None, description="Bearer token for /v1/control/*.")
    api_token_file: Path | None = None
    docs_enabled: bool = True
    dashboard_enabled: bool = Field(
        True, description="Serve the live dashboard (/) and its event stream (/v1/events/stream)."
    )
    max_connections: int = Field(
        2048,
        ge=1,
        description="Open TCP connections served; a request on one beyond this gets 503. "
        "The unit's LimitNOFILE= must stay above it.",
    )
    max_event_streams: int = Field(
        32, ge=1, description="Concurrent /v1/events/stream subscribers; beyond this, 503."
    )
    max_header_bytes: int = Field(
        64 << 10,
        ge=1024,
        le=16 << 20,
        description="Request line plus headers, bytes; a larger head gets 431 and a close.",
    )
    max_header_count: int = Field(
        100, ge=8, le=10_000, description="Header fields per request; more gets 431."
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="A request's head must arrive whole within this of the connection (or its "
        "previous response) being ready; a slower one is cut off.",
    )
    stream_write_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="A client that takes no response bytes for this long is cut off; its "
        "generation is aborted and its slot freed.",
    )
    body_timeout_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="A request body gets this long from the end of its head, plus one second "
        "per body_min_bytes_per_s bytes received; a slower body is cut off with 408.",
    )
    body_min_bytes_per_s: int = Field(
        16 << 10,
        ge=1,
        description="The slowest body rate kept beyond body_timeout_s (bytes per second).",
    )
    max_choices_per_request: int = Field(
        16,
        ge=1,
        le=256,
        description="Choices in one generation request (prompts x n); more gets 400.",
    )
    max_prompt_logprob_tokens: int = Field(
        32768,
        ge=1,
        description="Prompt tokens with logprobs in one request (echo + logprobs: prompt "
        "tokens x choices); more gets 400.",
    )
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs",
        description="fcfs: first come, first served, a request's priority must be 0; "
        "priority: lower `priority` values are admitted first and evicted last.",
    )
    max_concurrent_grammar_compiles: int = Field(
        2,
        ge=1,
        le=64,
        description="Structured-output grammars compiled at once on the tokenization pool; "
        "further requests wait their turn.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = "info"


class ApiConfig(_Section):
    tool_parser: Literal["auto", "hermes", "llama3"] = Field(
        "auto",
        description="How tool calls are read from an answer (tool_choice auto): hermes "
        "(<tool_call> JSON blocks), llama3 (a bare JSON object with name and parameters), "
        "auto: the format the chat template shows, else hermes.",
    )
    tools_without_template: Literal["system_message", "refuse"] = Field(
        "system_message",
        description="A chat template that does not render tools: list them in a system "
        "message (Hermes format) or refuse requests that offer tools (400).",
    )


# Weight quantization level names (wattserve/kernels/quant.py LEVEL_NAMES; kept equal by a test,
# spelled out here so that reading the config needs no torch).
QuantLevelName = Literal["fp32", "bf16", "int8", "int4", "int4-g128", "fp8"]


class EngineConfig(_Section):
    model: str = Field(
        "embedded",
        description="'embedded' (SmolLM2-135M-Instruct), a HF model directory or a .gguf file.",
    )
    served_model_name: str | None = None
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$",
        description="auto | cpu | cuda | cuda:N; auto: the CUDA device that is device.gpu, "
        "else the CPU.",
    )
    cache_dir: Path | None = Field(
        None, description="Converted-weights cache; default $WATTSERVE_CACHE or ~/.cache/wattserve."
    )
    cache_max_bytes: int = Field(
        20 * 2**30,
        gt=0,
        description="Converted weights and C++ kernel builds together are pruned to this at "
        "start, least recently used first (never the ones in use).",
    )
    block_size_tokens: int = Field(16, gt=0, le=1024)
    kv_cache_bytes: int | None = Field(None, gt=0)
    kv_cache_memory_fraction: float = Field(0.10, gt=0, le=0.9)
    gpu_memory_utilization: float = Field(
        0.90,
        gt=0,
        le=1,
        description="On CUDA: share of the GPU's memory the engine may use (weights, KV pool, "
        "activations); the KV pool gets what is left of it after the weights.",
    )
    max_num_seqs: int = Field(64, gt=0)
    max_num_batched_tokens: int = Field(512, gt=0)
    max_model_len: int | None = Field(None, gt=0)
    threads: int | None = Field(None, gt=0)
    default_max_tokens: int = Field(256, gt=0)
    quantization_levels: list[QuantLevelName] | None = Field(
        None,
        min_length=1,
        description="Weight quantization levels the controller and the API may switch to; "
        "unset: by device (CPU fp32, bf16, int8, int4; CUDA bf16, fp8, int8, int4).",
    )
    quantization_level: QuantLevelName | None = Field(
        None, description="Level at start; unset: the level of the loaded dtype."
    )
    quant_prepare: Literal["lazy", "start"] = Field(
        "lazy", description="Build each level's weights on first use, or all at start."
    )
    enable_prefix_caching: bool = Field(
        True, description="Reuse the KV blocks of prompt prefixes computed before."
    )
    cuda_graphs: bool = Field(
        True,
        description="On CUDA: replay every step (decode and mixed) from CUDA graphs captured "
        "at start per token-count and block-table-width bucket; ignored on the CPU.",
    )
    cuda_graph_max_tokens: int = Field(
        512,
        ge=1,
        le=16384,
        description="The largest step, in tokens (a power of two), captured as a CUDA graph "
        "at start; larger steps run eagerly. Fewer graphs: a shorter start, less memory.",
    )
    overlap_detokenize: bool | None = Field(
        None,
        description="Launch each step's forward before the step before is detokenized, "
        "so the host makes text while the device computes; unset: on for CUDA, off on "
        "the CPU (the same cores would do both).",
    )

    @field_validator("cuda_graph_max_tokens")
    @classmethod
    def _power_of_two(cls, tokens: int) -> int:
        if tokens & (tokens - 1):
            raise ValueError(f"must be a power of two (got {tokens})")
        return tokens

    @model_validator(mode="after")
    def _check_quant_level(self) -> EngineConfig:
        if (
            self.quantization_level is not None
            and self.quantization_levels is not None
            and self.quantization_level not in self.quantization_levels
        ):
            raise ValueError(
                f"quantization_level {self.quantization_level!r} is not one of "
                f"quantization_levels {self.quantization_levels}"
            )
        return self


class DeviceConfig(_Section):
    backend: Literal["auto", "nvml", "virtual"] = "auto"
    mode: Literal["control", "observe"] = "observe"
    gpu: str = Field("0", description="GPU index, UUID or PCI bus id.")
    sample_hz: float = Field(10.0, gt=0, le=1000)
    state_dir: Path | None = None
    virtual_seed: int = Field(0, ge=0, description="Noise seed of the virtual GPU.")
    virtual_ambient_c: float = Field(
        25.0, ge=-20, le=90, description="Inlet temperature of the virtual GPU at start."
    )
    virtual_power_calibration: Path | None = Field(
        None,
        description="A power calibration `wattserve bench gpu` wrote on a real GPU: the "
        "virtual GPU prices power from it instead of its profile's constants.",
    )

    @field_validator("virtual_power_calibration")
    @classmethod
    def _calibration_readable(cls, path: Path | None) -> Path | None:
        if path is not None:
            from wattserve.daemon.device.power_calibration import PowerCalibration

            PowerCalibration.load(path)  # raises, naming the file and the field
        return path


class ControllerConfig(_Section):
    mode: Literal["auto", "manual", "observe"] = "observe"
    power_budget_w: float = Field(700.0, gt=0)
    ttft_slo_ms: float = Field(2000.0, gt=0)
    tpot_slo_ms: float = Field(200.0, gt=0)
    slo_percentile: float = Field(99.0, gt=0, le=100)
    objective: Literal["min_energy_per_token", "min_latency"] = "min_energy_per_token"
    max_ppl_increase_pct: float | None = Field(
        None,
        ge=0,
        description="Never select a quantization level whose measured perplexity "
        "increase exceeds this; unset: any level in engine.quantization_levels.",
    )
    period_s: float = Field(0.25, gt=0, le=10, description="Control loop period (clock timescale).")
    batch_period_s: float = Field(2.0, gt=0, description="Batch caps change at most this often.")
    quant_dwell_s: float = Field(
        30.0, gt=0, description="Least time between quantization switches."
    )
    quant_gain_min_pct: float = Field(
        10.0, ge=0, description="Predicted J/token gain a quantization switch must bring."
    )
    quant_start_by_table: bool = Field(
        True,
        description="Before anything is learned, start on the allowed level bench quant's "
        "table ranks fastest.",
    )
    slo_margin: float = Field(0.85, gt=0, le=1, description="Predictions must meet SLO x this.")
    power_margin: float = Field(
        0.95, gt=0, le=1, description="Predictions must meet budget x this."
    )
    stale_hold_s: float = Field(
        2.0, gt=0, description="Stale telemetry: hold this long, then the fallback knobs."
    )
    fallback_sm_clock_mhz: int | None = Field(
        None, gt=0, description="Fallback SM clock; unset: the middle of the device's ladder."
    )
    fallback_max_num_seqs: int | None = Field(
        None, gt=0, description="Fallback batch cap; unset: half of engine.max_num_seqs."
    )
    thermal_derate_start_c: float = Field(
        6.0,
        gt=0,
        le=50,
        description="Thermal margin (degC to the slowdown threshold) below which the budget "
        "is derated, down to 0.6 x at no margin.",
    )
    decode_interval_max_ms: float = Field(
        1000.0,
        ge=0,
        le=DECODE_INTERVAL_MAX_MS,  # the engine's own bound, far below the watchdog's
        description="Longest decode pacing interval the controller and PUT knobs may set (a "
        "decode-only step no sooner than this after the step before, while no request "
        "waits); 0: no pacing.",
    )


class MqttConfig(_Section):
    """The MQTT telemetry feed and remote policy (docs/mqtt.md).

    Topics live under `<topic_prefix>/<node_id>/`; node_id defaults to the hostname
    (resolved at run time, never written back here). The password is read from
    password_file, never from the config itself. TLS is on only when tls_enabled is true;
    tls_ca_file unset then means the system trust store.
    """

    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = Field(1883, ge=1, le=65535)
    topic_prefix: str = Field("wattserve", min_length=1, max_length=128)
    node_id: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$",
        description="One topic level naming this node; unset: the hostname.",
    )
    client_id: str | None = Field(
        None, min_length=1, max_length=128, description="Unset: wattserve-<node_id>."
    )
    username: str | None = Field(None, min_length=1)
    password_file: Path | None = None
    tls_enabled: bool = False
    tls_ca_file: Path | None = None
    tls_cert_file: Path | None = Field(None, description="Client certificate (PEM).")
    tls_key_file: Path | None = Field(None, description="Client key (PEM); unset: in the cert.")
    keepalive_s: int = Field(30, ge=5, le=3600)
    telemetry_interval_ms: int = Field(1000, ge=50)
    telemetry_queue_max: int = Field(16, ge=1, description="Oldest telemetry dropped beyond.")
    event_queue_max: int = Field(1000, ge=1, description="Oldest event dropped beyond.")
    reconnect_initial_ms: int = Field(500, ge=10)
    reconnect_max_ms: int = Field(30_000, ge=10)
    shutdown_timeout_ms: int = Field(
        2000, ge=0, description="At stop: time to flush queued events and publish offline."
    )
    home_assistant_discovery: bool = False
    home_assistant_prefix: str = Field("homeassistant", min_length=1, max_length=128)
    accept_policy: bool = Field(
        False, description="Take the policy from `policy/set`; false: not even subscribed."
    )
    accept_policy_unauthenticated: bool = Field(
        False,
        description="Allow accept_policy over a connection that carries no credentials "
        "(no username with password_file, no tls_cert_file).",
    )

    @property
    def authenticated(self) -> bool:
        """The connection carries credentials: a password, or a client certificate."""
        return (
            self.username is not None and self.password_file is not None
        ) or self.tls_cert_file is not None

    @property
    def remote_policy(self) -> Literal["off", "authenticated", "unauthenticated"]:
        """Whether `policy/set` is taken, and over what kind of connection."""
        if not (self.enabled and self.accept_policy):
            return "off"
        return "authenticated" if self.authenticated else "unauthenticated"

    @model_validator(mode="after")
    def _check_consistency(self) -> MqttConfig:
        for key in ("topic_prefix", "home_assistant_prefix"):
            value: str = getattr(self, key)
            levels = value.split("/")
            if any(c in value for c in "+#\0") or "" in levels or value.startswith("$"):
                raise ValueError(
                    f"{key} {value!r} must be topic levels joined by '/', with no wildcard, "
                    "no empty level and no leading '$'"
                )
        if self.password_file is not None and self.username is None:
            raise ValueError("password_file is set but username is not")
        if not self.tls_enabled:
            for key in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
                if getattr(self, key) is not None:
                    raise ValueError(f"{key} is set but tls_enabled is false")
        if self.tls_key_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_key_file is set but tls_cert_file is not")
        if self.event_queue_max < self.telemetry_queue_max:
            raise ValueError("event_queue_max must be >= telemetry_queue_max")
        if self.reconnect_max_ms < self.reconnect_initial_ms:
            raise ValueError("reconnect_max_ms must be >= reconnect_initial_ms")
        if self.accept_policy_unauthenticated and not self.accept_policy:
            raise ValueError("accept_policy_unauthenticated is set but accept_policy is not")
        if self.accept_policy and not self.authenticated and not self.accept_policy_unauthenticated:
            # Anyone who can reach the broker would steer this node's power and SLOs.
            raise ValueError(
                "accept_policy = true over an unauthenticated connection (no username with "
                "password_file, no tls_cert_file): configure broker credentials (and its ACL, "
                "systemd/mosquitto-wattserve.acl), or set accept_policy_unauthenticated = true"
            )
        return self


class FleetConfig(_Section):
    """This node's part in a fleet power budget (docs/fleet.md): off by default.

    With it on, the node publishes its `demand` and takes its power budget from the
    allocator's retained `grant` (MQTT 5, over the [mqtt] broker and credentials); when the
    grant's lease runs out it drops to safe_floor_w until a live grant comes.
    """

    enabled: bool = False
    safe_floor_w: float | None = Field(
        None, gt=0, description="Power budget once a lease expires; required when enabled."
    )
    demand_interval_ms: int = Field(1000, ge=100, le=60_000)
    max_lease_s: float = Field(
        60.0,
        gt=0,
        description="A grant is held no longer than this after it arrives, "
        "whatever its expires_at says (a bound on clock skew between allocator and node).",
    )
    need_margin_ratio: float = Field(
        0.1, ge=0, le=1, description="Asked for on top of the power the SLOs need now."
    )
    key_file: Path | None = Field(
        None,
        description="This node's HMAC key (mode 0600), which the allocator also holds: signs "
        "demands, verifies grants. Required when enabled.",
    )
    previous_key_file: Path | None = Field(
        None, description="During a key rotation: the old key, still accepted on grants."
    )
    max_clock_skew_s: float = Field(
        5.0,
        gt=0,
        le=60,
        description="A grant issued further ahead of this node's clock is refused.",
    )
    insecure_lab_waiver: bool = Field(
        False,
        description="Lab only: run the fleet without broker credentials or TLS (logged as a "
        "WARNING at start). Grants and demands are still signed.",
    )

    @model_validator(mode="after")
    def _check_floor(self) -> FleetConfig:
        if self.enabled and self.safe_floor_w is None:
            raise ValueError("enabled = true needs safe_floor_w (the budget after a lease)")
        if self.enabled and self.key_file is None:
            raise ValueError("enabled = true needs key_file (this node's signing key)")
        if self.previous_key_file is not None and self.key_file is None:
            raise ValueError("previous_key_file is set but key_file is not")
        return self


def fleet_transport_problems(mqtt: MqttConfig) -> list[str]:
    """What the broker connection lacks for a fleet: credentials, TLS (empty: nothing)."""
    problems = []
    if not mqtt.authenticated:
        problems.append(
            "no broker credentials (mqtt.username with mqtt.password_file, or mqtt.tls_cert_file)"
        )
    if not mqtt.tls_enabled:
        problems.append("no TLS to the broker (mqtt.tls_enabled)")
    return problems


class Config(BaseSettings):
    """The whole effective configuration."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
    )

    server: ServerConfig = ServerConfig()
    api: ApiConfig = ApiConfig()
    engine: EngineConfig = EngineConfig()
    device: DeviceConfig = DeviceConfig()
    controller: ControllerConfig = ControllerConfig()
    mqtt: MqttConfig = MqttConfig()
    fleet: FleetConfig = FleetConfig()

    @model_validator(mode="after")
    def _check_limits(self) -> Config:
        if self.engine.max_num_batched_tokens < self.engine.block_size_tokens:
            raise ValueError("engine.max_num_batched_tokens must be >= engine.block_size_tokens")
        if self.fleet.enabled:
            self._check_fleet()
        return self

    def _check_fleet(self) -> None:
        """A fleet node must enforce its grants and speak only for itself on the broker."""
        if not self.mqtt.enabled:
            raise ValueError("fleet.enabled needs mqtt.enabled (grants come over the broker)")
        # In observe mode a grant would never reach the GPU: the site budget would not hold.
        if self.device.mode != "control":
            raise ValueError(
                f'fleet.enabled needs device.mode = "control", not "{self.device.mode}"'
            )
        if self.controller.mode != "auto":
            raise ValueError(
                f'fleet.enabled needs controller.mode = "auto", not "{self.controller.mode}"'
            )
        problems = fleet_transport_problems(self.mqtt)
        if problems and not self.fleet.insecure_lab_waiver:
            raise ValueError(
                f"fleet.enabled with {'; '.join(problems)}: configure them, or set "
                "fleet.insecure_lab_waiver = true for a lab"
            )
        node_id, username = self.mqtt.node_id, self.mqtt.username
        if node_id is not None and username is not None and node_id != username:
            raise ValueError(
                f"fleet.enabled needs mqtt.username to be the node id: {username!r} is not "
                f"mqtt.node_id {node_id!r} (the broker's ACL keys each node's topics on it)"
            )


def _check_env_names(environ: dict[str, str]) -> None:
    sections = set(Config.model_fields)
    for name in environ:
        if not name.startswith(ENV_PREFIX) or name in STANDALONE_ENV:
            continue
        rest = name[len(ENV_PREFIX) :].lower()
        section = rest.split("__", 1)[0]
        if section not in sections or "__" not in rest:
            raise ConfigError(f"config error: unknown environment variable {name}")


def _format_error(err: ValidationError) -> str:
    first = err.errors()[0]
    key = ".".join(str(p) for p in first["loc"]) or "(top level)"
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        msg = "unknown key"
    got = first.get("input")
    shown = "" if first["type"] == "extra_forbidden" or isinstance(got, dict) else f" (got {got!r})"
    return f"config error: {key}: {msg}{shown}"


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config error: {path}: file not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config error: {path}: invalid TOML: {e}") from None
    unknown = sorted(set(data) - set(Config.model_fields))
    if unknown:
        raise ConfigError(f"config error: {unknown[0]}: unknown section (in {path})")
    return data


def load_config(
    path: str | Path | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
) -> Config:
    """Build the effective config from the TOML file, the environment and CLI flags.

    ``overrides`` holds CLI flags by section; a None value means "flag not given".
    Precedence: CLI overrides > WATTSERVE_* environment > TOML file > defaults.
    """
    _check_env_names(dict(os.environ))
    if path is None and os.environ.get("WATTSERVE_CONFIG"):
        path = os.environ["WATTSERVE_CONFIG"]
    file_data = _read_toml(Path(path)) if path is not None else {}
    cli = {
        section: {k: v for k, v in values.items() if v is not None}
        for section, values in (overrides or {}).items()
    }
    cli = {section: values for section, values in cli.items() if values}

    class _Layered(Config):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return (
                InitSettingsSource(settings_cls, cli),
                env_settings,
                InitSettingsSource(settings_cls, file_data),
            )

    try:
        return _Layered()
    except ValidationError as e:
        raise ConfigError(_format_error(e)) from None


def default_cache_dir(environ: dict[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    if env.get("WATTSERVE_CACHE"):
        return Path(env["WATTSERVE_CACHE"])
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "wattserve"


def render_toml(cfg: Config) -> str:
    """The effective configuration as TOML text (for `wattserve config show`)."""
    lines: list[str] = []
    for section, model in cfg.model_dump(mode="json").items():
        lines.append(f"[{section}]")
        for key, value in model.items():
            if value is None:
                lines.append(f"# {key} is unset")
                continue
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    escaped = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'

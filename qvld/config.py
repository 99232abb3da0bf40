"""YAML -> a frozen, typed configuration.

Every key has a default, so ``Config()`` plus a model path is a working configuration.
``load_config`` reads the file, applies ``--set key=value`` overrides (the value is read
as a YAML scalar and coerced to the key's type; an empty value means none/off for
optional keys; string keys such as modes take the text as written), and reports every
error of the load at once, unknown keys with a did-you-mean.
"""

from __future__ import annotations

import difflib
import os
import re
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

DEFAULT_CONFIG_PATH = Path("/etc/qvld/qvld.yaml")


class ConfigError(Exception):
    """Every problem of one configuration load (exit 78)."""

    def __init__(self, errors: Sequence[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = list(errors)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Section):
    path: Path | None = None
    device: Literal["CPU"] = "CPU"
    # openvino (openvino_*.xml from `qvlctl model convert`) or onnxruntime
    # (onnx_*.onnx from `qvlctl model export-onnx`; needs the onnxruntime extra).
    backend: Literal["openvino", "onnxruntime"] = "openvino"
    # auto: f32 for a language model with int8/int4 weights (OpenVINO quantises its
    # activations dynamically only at f32: the fastest decode), the runtime's default
    # (bf16 where the CPU has it) for the vision models and float weights.
    precision: Literal["auto", "f32", "bf16"] = "auto"
    kv_cache_precision: Literal["auto", "f32", "f16", "u8"] = "auto"
    cache_dir: Path | None = None
    warmup: bool = True
    # OpenVINO's dynamic quantisation of activations for int8/int4 weights (at f32):
    # auto (the weights' group size, 128 for per-channel weights), off, or a group size.
    dynamic_quantization: int | Literal["auto", "off"] = "auto"


class EngineConfig(_Section):
    threads: int | Literal["auto"] = "auto"
    streams: int = Field(1, ge=1)
    infer_requests: int = Field(4, ge=1, le=64)
    max_image_tokens: int = Field(1024, ge=1)
    default_image_tokens: int = Field(256, ge=1)
    max_images: int = Field(8, ge=0)
    # Decompression-bomb guard: images whose header declares more pixels are refused.
    max_decode_pixels: int = Field(64_000_000, ge=1)
    max_context_tokens: int = Field(8192, ge=16)
    max_new_tokens: int = Field(512, ge=1)
    default_max_tokens: int = Field(128, ge=1)
    prefill_chunk: int = Field(512, ge=1)
    image_cache_mb: int = Field(256, ge=0)
    kv_cache_mb: int = Field(2048, ge=0)
    sessions_max: int = Field(64, ge=0)
    session_ttl_s: float = Field(900, gt=0)

    @model_validator(mode="after")
    def _defaults_within_limits(self) -> EngineConfig:
        if isinstance(self.threads, int) and self.threads < 1:
            raise ValueError("threads must be 'auto' or >= 1")
        if self.default_image_tokens > self.max_image_tokens:
            raise ValueError("default_image_tokens must not exceed max_image_tokens")
        if self.default_max_tokens > self.max_new_tokens:
            raise ValueError("default_max_tokens must not exceed max_new_tokens")
        return self


class ServerConfig(_Section):
    socket: Path = Path("/run/qvld/qvld.sock")
    socket_mode: str = "0660"
    max_frame_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    max_connections: int = Field(256, ge=1)
    # A client whose unread replies pass this is cut off and its generations cancelled.
    send_buffer_bytes: int = Field(1024 * 1024, ge=4096)
    read_timeout_s: float = Field(30, gt=0)
    queue_max: int = Field(32, ge=0)
    request_timeout_s: float = Field(300, gt=0)
    drain_timeout_s: float = Field(30, ge=0)
    allow_uids: list[int] = Field(default_factory=list)
    allow_groups: list[str] = Field(default_factory=lambda: ["qvl"])
    admin_groups: list[str] = Field(default_factory=lambda: ["qvl-admin"])

    @field_validator("socket_mode", mode="before")
    @classmethod
    def _mode_is_octal_text(cls, value: Any) -> Any:
        if isinstance(value, int):
            raise ValueError('write the mode as a quoted octal string, e.g. "0660"')
        if isinstance(value, str) and not re.fullmatch(r"0?[0-7]{3}", value):
            raise ValueError(f'{value!r} is not an octal file mode such as "0660"')
        return value

    @property
    def socket_mode_bits(self) -> int:
        return int(self.socket_mode, 8)


class MetricsConfig(_Section):
    listen: str | None = "127.0.0.1:9464"  # none/empty: no HTTP exporter

    @field_validator("listen")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        if not value:
            return None
        _host, sep, port = value.rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{value!r} is not HOST:PORT")
        return value


class TuningConfig(_Section):
    apply: bool = True
    pin_cpus: str | None = "auto"  # auto, a CPU list such as "0-3,6", or none
    numa_node: int | Literal["auto"] | None = "auto"
    governor: Literal["leave", "performance"] = "leave"
    nofile: int = Field(65536, ge=64)


class LoggingConfig(_Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["text", "json"] = "text"
    log_prompts: bool = False


class Config(_Section):
    model: ModelConfig = ModelConfig()
    engine: EngineConfig = EngineConfig()
    server: ServerConfig = ServerConfig()
    metrics: MetricsConfig = MetricsConfig()
    tuning: TuningConfig = TuningConfig()
    logging: LoggingConfig = LoggingConfig()


# -- loading ------------------------------------------------------------------------


def _field(path: Sequence[str]) -> tuple[Any, int, list[str]]:
    """(annotation, -1, []) for a known dotted key, else (None, index of the bad part,
    the names valid there)."""
    model: Any = Config
    annotation: Any = None
    for i, part in enumerate(path):
        fields = getattr(model, "model_fields", None)
        if fields is None or part not in fields:
            return None, i, sorted(fields) if fields else []
        annotation = fields[part].annotation
        model = annotation
    return annotation, -1, []


def _did_you_mean(name: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _takes_text(annotation: Any) -> bool:
    """Whether a key is a string or path, so that '0660' stays '0660'."""
    options = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) \
        else (annotation,)
    return any(opt in (str, Path) for opt in options) and not any(
        opt is int or get_origin(opt) is Literal for opt in options)


def parse_override(item: str) -> tuple[list[str], Any]:
    """``section.key=value`` -> (path, typed value); raises ConfigError."""
    key, sep, text = item.partition("=")
    path = key.strip().split(".")
    if not sep or not key.strip():
        raise ConfigError([f"--set {item!r}: expected KEY=VALUE, e.g. engine.threads=4"])
    annotation, bad, choices = _field(path)
    if annotation is None or len(path) < 2:
        if annotation is not None:
            raise ConfigError([f"--set {key}: name a key inside the section, e.g. {key}.KEY"])
        what = "section" if bad == 0 else "key"
        hint = _did_you_mean(path[bad], choices)
        raise ConfigError([f"--set {key}: unknown {what} {path[bad]!r}{hint}"])
    if text == "":
        return path, None
    if _takes_text(annotation):
        return path, text
    try:
        return path, yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError([f"--set {key}: cannot read {text!r}: {exc}"]) from exc


def _describe(errors: Sequence[Any]) -> list[str]:
    """pydantic errors -> one line per key (the alternatives of a union joined)."""
    lines: dict[str, list[str]] = {}
    for error in errors:
        loc = [str(p) for p in error["loc"]]
        annotation, bad, choices = _field(loc)
        if error["type"] == "extra_forbidden":
            key = ".".join(loc)
            lines.setdefault(key, []).append(f"unknown key{_did_you_mean(loc[-1], choices)}")
            continue
        if annotation is None and bad > 0:  # a union member's tag, such as 'int'
            loc = loc[:bad]
        key = ".".join(loc) or "(top level)"
        message = str(error["msg"]).removeprefix("Value error, ")
        got = error.get("input")
        if got is not None and not isinstance(got, dict) and error["type"] != "missing":
            message += f" (got {got!r})"
        lines.setdefault(key, []).append(message)
    return [f"{key}: {'; or '.join(dict.fromkeys(msgs))}" for key, msgs in lines.items()]


def build_config(raw: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_describe(exc.errors())) from exc


def read_config_file(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read: {exc.strerror or exc}"]) from exc
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path}: not valid YAML: {exc}"]) from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: the top level must be a mapping of sections"])
    return data


def default_config_path() -> Path | None:
    env = os.environ.get("QVLD_CONFIG")
    if env:
        return Path(env)
    return DEFAULT_CONFIG_PATH if DEFAULT_CONFIG_PATH.is_file() else None


def load_config(path: Path | None, overrides: Sequence[str] = ()) -> Config:
    """Read ``path`` (None: defaults only), apply overrides, validate; all errors at once."""
    raw: dict[str, Any] = read_config_file(path) if path is not None else {}
    errors: list[str] = []
    for item in overrides:
        try:
            keys, value = parse_override(item)
        except ConfigError as exc:
            errors.extend(exc.errors)
            continue
        section = raw
        for part in keys[:-1]:
            if not isinstance(section.get(part), dict):
                section[part] = {}
            section = section[part]
        section[keys[-1]] = value
    try:
        config = build_config(raw)
    except ConfigError as exc:
        errors.extend(exc.errors)
    if errors:
        raise ConfigError(errors)
    return config


def iter_keys(model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    """Every dotted key of the schema, in declaration order."""
    keys: list[str] = []
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys.extend(iter_keys(annotation, f"{prefix}{name}."))
        else:
            keys.append(f"{prefix}{name}")
    return keys


def with_systemd_cache_dir(config: Config, environ: Mapping[str, str] | None = None) -> Config:
    """model.cache_dir, or else the unit's CacheDirectory= (systemd passes its path in
    $CACHE_DIRECTORY): a restart with the compiled-model cache takes half the time."""
    directory = (os.environ if environ is None else environ).get("CACHE_DIRECTORY", "")
    directory = directory.split(":")[0]
    if config.model.cache_dir is not None or not directory:
        return config
    model = config.model.model_copy(update={"cache_dir": Path(directory)})
    return config.model_copy(update={"model": model})

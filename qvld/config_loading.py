"""Where a ``Config`` comes from: the YAML file (``/etc/qvld/qvld.yaml``, or
``$QVLD_CONFIG``), ``--set key=value`` overrides (the value read as a YAML scalar and
coerced to the key's type; an empty value means none/off for optional keys; string keys
such as modes take the text as written), an instance's file or derived ports
(``qvld@NAME``), and systemd's CacheDirectory=. Every error of a load is reported at
once, unknown keys with a did-you-mean."""

from __future__ import annotations

import os
import re
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import ValidationError

from qvld.config import DEFAULT_CONFIG_PATH, Config, ConfigError, did_you_mean


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
        hint = did_you_mean(path[bad], choices)
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
            lines.setdefault(key, []).append(f"unknown key{did_you_mean(loc[-1], choices)}")
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


def load_config(path: Path | None, overrides: Sequence[str] = (),
                environ: Mapping[str, str] | None = None) -> Config:
    """Read ``path`` (None: defaults only), apply overrides, validate; all errors at once.

    The result is the effective configuration, the one place where the environment
    counts: systemd's CacheDirectory= fills an unset model.cache_dir."""
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
    return with_systemd_cache_dir(config, environ)


INSTANCE_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# An instance's HTTP port when the shared file sets none: qvld-http.socket's.
DEFAULT_HTTP_PORT = 8090


def _shift_port(listen: str, by: int) -> str:
    host, _, port = listen.rpartition(":")
    return f"{host}:{int(port) + by}"


def instance_source(path: Path | None, overrides: Sequence[str], name: str,
                    environ: Mapping[str, str] | None = None) -> tuple[Path | None, list[str]]:
    """The config file and overrides of instance ``name`` of the template units
    (qvld@NAME.service): ``NAME.yaml`` beside the shared config when it exists, read as
    is; else, when ``name`` is a NUMA node number N, the shared config with
    ``tuning.numa_node: N``, the socket ``qvld-N.sock`` beside the shared one, the
    HTTP and metrics ports moved up by N (HTTP from 8090 when the shared file sets
    none) and the compiled-model cache in subdirectory N, so that one instance per node
    runs from one file. The overrides are fixed here, at start: a reload re-reads the
    files with the same ones."""
    if not INSTANCE_NAME.fullmatch(name):
        raise ConfigError([f"instance {name!r}: a name is 1-64 of [A-Za-z0-9_-]"])
    directory = (path or DEFAULT_CONFIG_PATH).parent
    own = directory / f"{name}.yaml"
    if own.is_file():
        return own, list(overrides)
    if not name.isdigit():
        raise ConfigError([f"instance {name}: no {own}, and {name} is not a NUMA node number "
                           "(an instance of the shared file must be one)"])
    node = int(name)
    shared = load_config(path, overrides, environ)
    http = shared.http.listen or f"127.0.0.1:{DEFAULT_HTTP_PORT}"
    derived = [f"tuning.numa_node={node}",
               f"server.socket={shared.server.socket.with_name(f'qvld-{node}.sock')}",
               f"http.listen={_shift_port(http, node)}"]
    if shared.metrics.listen:
        derived.append(f"metrics.listen={_shift_port(shared.metrics.listen, node)}")
    if shared.model.cache_dir is not None:
        # a compiled-model cache of its own (qvld@.service's CacheDirectory=qvld/%i)
        derived.append(f"model.cache_dir={shared.model.cache_dir / name}")
    return path, [*overrides, *derived]


def with_systemd_cache_dir(config: Config, environ: Mapping[str, str] | None = None) -> Config:
    """model.cache_dir, or else the unit's CacheDirectory= (systemd passes its path in
    $CACHE_DIRECTORY): a restart with the compiled-model cache takes half the time."""
    directory = (os.environ if environ is None else environ).get("CACHE_DIRECTORY", "")
    directory = directory.split(":")[0]
    if config.model.cache_dir is not None or not directory:
        return config
    model = config.model.model_copy(update={"cache_dir": Path(directory)})
    return config.model_copy(update={"model": model})

"""The configuration's schema: a frozen, typed ``Config`` of sections, each key checked
(ranges, addresses, paths) with a message that names it.

Every key has a default, so ``Config()`` plus a model path is a working configuration.
Reading one from the file and ``--set`` overrides is ``config_loading``.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
import socket
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEFAULT_CONFIG_PATH = Path("/etc/qvld/qvld.yaml")

# What the runtime accepts, so that a value check-config passes cannot fail later:
C_INT_MAX = 2**31 - 1  # setsockopt() and OpenVINO's integer properties take a C int
FRAME_MAX = 2**32 - 1  # a frame's length prefix is 32 bits
UID_MAX = 2**32 - 2  # uid_t is 32 bits and (uid_t)-1 means "no uid"
MAX_THREADS = 1024  # more than any CPU qvld targets; OpenVINO clamps to the cores it has
MAX_CPU = 8191  # Linux's NR_CPUS is at most 8192
MAX_NUMA_NODE = 1023  # and MAX_NUMNODES at most 1024
MAX_SECONDS = 30 * 86400  # no sane timeout is longer; far below threading.TIMEOUT_MAX
SUN_PATH_MAX = 107  # sockaddr_un.sun_path holds 108 bytes with the terminating NUL
RESOLVE_TIMEOUT_S = 5.0  # a metrics host name must resolve within this


class ConfigError(Exception):
    """Every problem of one configuration load (exit 78)."""

    def __init__(self, errors: Sequence[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = list(errors)


class _Section(BaseModel):
    # allow_inf_nan: NaN fails every comparison (a NaN timeout never passes) and
    # time.monotonic() + inf cannot be waited on; no key means "forever".
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _no_nul(value: Any) -> Any:
    """The OS refuses a path or name with a NUL byte (ValueError at first use)."""
    if isinstance(value, str | Path) and "\0" in str(value):
        raise ValueError("must not contain a NUL byte")
    return value


class ModelConfig(_Section):
    path: Path | None = None
    device: Literal["CPU"] = "CPU"
    # openvino (openvino_*.xml from `qvlctl model convert`) or onnxruntime
    # (onnx_*.onnx from `qvlctl model export-onnx`; needs the onnxruntime extra). auto:
    # the runtime whose graphs the directory holds; with both, onnxruntime for
    # everything where its graphs have int8 weights and the CPU has no VNNI or AMX
    # (one copy of the weights; its integer kernels prefill and decode faster there).
    backend: Literal["auto", "openvino", "onnxruntime"] = "auto"
    # What encodes images and prefills prompts for the openvino backend (which decodes):
    # auto is onnxruntime where the directory also holds int8 ONNX graphs (`qvlctl model
    # export-onnx CHECKPOINT DIR --weights int8`) and onnxruntime is installed (its int8
    # MatMuls halve the time to the first token on CPUs without VNNI), else openvino.
    prompt_backend: Literal["auto", "openvino", "onnxruntime"] = "auto"
    # auto: f32 for a language model with int8/int4 weights (OpenVINO quantises its
    # activations dynamically only at f32: the fastest decode), the runtime's default
    # (bf16 where the CPU has it) for the vision models and float weights.
    precision: Literal["auto", "f32", "bf16"] = "auto"
    kv_cache_precision: Literal["auto", "f32", "f16", "u8"] = "auto"
    # Compiled models are kept in a subdirectory named by the model's content, the
    # runtime and the compile settings, and verified against a manifest before use.
    cache_dir: Path | None = None
    warmup: bool = True
    # OpenVINO's dynamic quantisation of activations for int8/int4 weights (at f32):
    # auto (the weights' group size, 128 for per-channel weights), off, or a group size
    # (0 is off; larger than any weight row is pointless; OpenVINO wraps negatives).
    dynamic_quantization: Annotated[int, Field(ge=0, le=65536)] | Literal["auto", "off"] = "auto"
    # A video's tokens at most (all its frames): fewer frames are sampled, then smaller
    # ones, to fit; also bounded by the model's own video_preprocessor_config.json.
    video_max_tokens: int = Field(2048, ge=16, le=32768)
    # The share of a clip's tokens dropped before the prompt (0: none): after the first
    # frame group, the tokens whose pixels changed least since the group before go first
    # (static background), every kept token at its unpruned position. Fewer rows to
    # prefill; it changes what the model sees (BENCHMARKS.md, "Video").
    video_pruning: float = Field(0.0, ge=0.0, le=0.95)

    _no_nul_in_paths = field_validator("path", "cache_dir")(_no_nul)


class EngineConfig(_Section):
    threads: Annotated[int, Field(ge=1, le=MAX_THREADS)] | Literal["auto"] = "auto"
    # Only 1: see _one_stream.
    streams: int = 1
    # Slots: sets of infer requests, each with a thread, that encode a request's images
    # and embed its prompt, then are free again. A runtime without paged attention
    # (onnxruntime, or continuous_batching off) also keeps this many sequences' KV
    # caches in the step loop's slots (more running sequences reload from their blocks).
    infer_requests: int = Field(4, ge=1, le=64)
    # Generations the step loop runs at once (continuous batching), KV cache allowing;
    # more wait (server.queue_max) and are admitted, or preempt, fairly between users.
    max_sequences: int = Field(8, ge=1, le=256)
    max_image_tokens: int = Field(1024, ge=1)
    default_image_tokens: int = Field(256, ge=1)
    max_images: int = Field(8, ge=0)
    # Decompression-bomb guard: images whose header declares more pixels are refused.
    max_decode_pixels: int = Field(64_000_000, ge=1)
    # What decoding one clip may cost: its frames up to the last one sampled (a decoder
    # cannot skip to a frame) times their pixels, checked from the header before a
    # frame is decoded. 8e9 is two minutes of 1080p at 30 fps (seconds of CPU).
    max_clip_decode_pixels: int = Field(8_000_000_000, ge=1)
    max_context_tokens: int = Field(8192, ge=16)
    # An operator's cap on any request's max_tokens (0: none but the context's end), and
    # max_tokens for a request that names none (0: until the model stops or the context
    # ends, as vLLM and OpenAI do: preemption and per-user fairness bound what one long
    # answer costs others).
    max_new_tokens: int = Field(0, ge=0)
    default_max_tokens: int = Field(0, ge=0)
    prefill_chunk: int = Field(512, ge=1)
    image_cache_mb: int = Field(256, ge=0)
    kv_cache_mb: int = Field(2048, ge=0)
    sessions_max: int = Field(64, ge=0)
    # Sessions one uid may hold (at most sessions_max): a user at the limit makes room
    # by losing their own least recently used idle session, never someone else's.
    sessions_per_user: int = Field(8, ge=1)
    session_ttl_s: float = Field(900, gt=0, le=MAX_SECONDS)
    # Raw bytes of session images kept for rebuilding a history whose KV cache and
    # image embeddings were evicted, all sessions together (least recently used dropped).
    session_image_mb: int = Field(64, ge=0)
    # Reuse KV prefixes and image embeddings across users. Cheaper shared prompts, but
    # cached_tokens and timings then tell a user what others asked: off by default.
    share_caches: bool = False
    # Every running generation advances in one pass over the weights per step (OpenVINO's
    # paged-attention model); off: the stateful model, one sequence per inference, in
    # the same step loop over the same KV blocks.
    continuous_batching: bool = True
    # Rows one step feeds the language model: every running generation's next token
    # first, then prompt chunks of new ones up to this many.
    max_batch_tokens: int = Field(512, ge=1)

    @model_validator(mode="after")
    def _a_step_holds_every_sequence(self) -> EngineConfig:
        if self.continuous_batching and self.max_batch_tokens < self.max_sequences:
            raise ValueError(f"max_batch_tokens ({self.max_batch_tokens}) must be at least "
                             f"max_sequences ({self.max_sequences}): every running "
                             "generation feeds one row per step")
        return self
    # Structured output (response_format): a grammar not compiled within this many
    # seconds of the request's arrival is a bad_request; compiled grammars kept by content.
    grammar_compile_timeout_s: float = Field(5.0, gt=0, le=MAX_SECONDS)
    grammar_cache_size: int = Field(64, ge=0, le=65_536)
    # Tokens a response format forces (a key, a quote, a brace) are fed in one step
    # beside the sampled one; off: one step each (the same tokens, for comparison).
    grammar_fast_forward: bool = True
    # Whether ONNX Runtime's threads spin between ops waiting for work. auto: not where
    # they share the cores with OpenVINO's (model.prompt_backend: a prompt prefilled
    # while others decode), where spinning threads take the CPU from the other runtime.
    spin_wait: bool | Literal["auto"] = "auto"
    # Deprecated (DEPRECATED_KEYS): kept so that a file that sets it still loads.
    batch_invariant: bool = False

    @field_validator("streams")
    @classmethod
    def _one_stream(cls, value: int) -> int:
        # Every generation owns one infer request per submodel, compiled for latency
        # (PERFORMANCE_HINT=LATENCY); concurrency is engine.max_sequences. N streams
        # would only split each generation's threads N ways (slower answers), and the
        # CPU plugin derives threads per stream from the topology it sees (pinning,
        # cgroups): a daemon with streams: 2 died of SIGFPE there, nothing logged, in a
        # restart loop (not reproduced on the 2-core dev box; openvino#27581 is the same
        # integer division by zero with NUM_STREAMS 2).
        if value != 1:
            raise ValueError(
                "must be 1 (each generation runs on its own infer request with all the "
                "inference threads; more streams only split them, and OpenVINO's CPU plugin "
                "can crash with SIGFPE); remedy: remove engine.streams, and raise "
                "engine.max_sequences for more concurrent generations")
        return value

    @model_validator(mode="after")
    def _defaults_within_limits(self) -> EngineConfig:
        if self.default_image_tokens > self.max_image_tokens:
            raise ValueError("default_image_tokens must not exceed max_image_tokens")
        if self.max_new_tokens and self.default_max_tokens > self.max_new_tokens:
            raise ValueError("default_max_tokens must not exceed max_new_tokens")
        return self

    # Budgets derived from kv_cache_mb here, once, each with one meaning (the scheduler
    # and the engine used to read 0 in two ways).

    @property
    def kv_admission_bytes(self) -> int | None:
        """KV-cache bytes the admitted generations may reserve together; None: no limit
        (kv_cache_mb 0)."""
        return self.kv_cache_mb << 20 or None


class ServerConfig(_Section):
    socket: Path = Path("/run/qvld/qvld.sock")
    socket_mode: str = "0660"
    max_frame_bytes: int = Field(32 * 1024 * 1024, ge=1024, le=FRAME_MAX)
    max_connections: int = Field(256, ge=1)
    # A client whose unread replies pass this is cut off and its generations cancelled.
    # Also the socket's SO_SNDBUF, a C int.
    send_buffer_bytes: int = Field(1024 * 1024, ge=4096, le=C_INT_MAX)
    read_timeout_s: float = Field(30, gt=0, le=MAX_SECONDS)
    # A connection with no request in flight that sends no complete frame for this long
    # is closed (qvlctl reconnects on its own), so idle ones cannot hold every slot.
    idle_timeout_s: float = Field(120, gt=0)
    # Bytes of incomplete frames being received, all connections together; one uid may
    # hold at most max_frame_bytes of it. Past either: busy, and the line is closed.
    max_pending_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    # Requests one connection may have in flight at once (more: busy).
    max_requests_per_connection: int = Field(16, ge=1)
    # Generations waiting for a slot or a place in the step loop; more are busy for a
    # user past its fair share of them (fairqueue.within_share).
    queue_max: int = Field(32, ge=0)
    # Requests waiting for their images to be decoded and their text tokenised (the
    # prepare stage's threads); more are busy likewise.
    prepare_queue_max: int = Field(32, ge=0)
    request_timeout_s: float = Field(300, gt=0, le=MAX_SECONDS)
    drain_timeout_s: float = Field(30, ge=0, le=MAX_SECONDS)
    allow_uids: list[Annotated[int, Field(ge=0, le=UID_MAX)]] = Field(default_factory=list)
    allow_groups: list[str] = Field(default_factory=lambda: ["qvl"])
    admin_groups: list[str] = Field(default_factory=lambda: ["qvl-admin"])

    @field_validator("socket")
    @classmethod
    def _socket_path_fits(cls, value: Path) -> Path:
        _no_nul(value)
        if len(os.fsencode(value)) > SUN_PATH_MAX:
            raise ValueError(f"a Unix socket path is at most {SUN_PATH_MAX} bytes "
                             f"({len(os.fsencode(value))} given); choose a shorter path")
        return value

    @field_validator("allow_groups", "admin_groups")
    @classmethod
    def _group_names(cls, names: list[str]) -> list[str]:
        for name in names:
            _no_nul(name)
        return names

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
    # 8479: outside the Prometheus exporter registry's 9100-9999 (allocated in full;
    # 9464, the old default, is OpenTelemetry's exporter), absent from /etc/services,
    # clear of the usual 8000/8080/8443/8888 and below the ephemeral range.
    listen: str | None = "127.0.0.1:8479"  # none/empty: no HTTP exporter

    @field_validator("listen")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        return _listen_address(value)


def _listen_address(value: str | None) -> str | None:
    """HOST:PORT a listener can bind: an IPv4 literal, [IPv6], a name that resolves
    now, or empty for every interface; a port 1..65535. Empty: none."""
    if not value:
        return None
    host, sep, port = value.rpartition(":")
    if not sep or not re.fullmatch(r"[0-9]{1,5}", port) or not 0 < int(port) < 65536:
        raise ValueError(f"{value!r} is not HOST:PORT (a port 1..65535)")
    problem = _listen_host_problem(host, int(port))
    if problem:
        raise ValueError(problem)
    return value


def _listen_host_problem(host: str, port: int) -> str | None:
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return f"{host} is not an IPv6 address"
        return None
    if ":" in host:
        return f"write an IPv6 address in brackets, e.g. [{host}]:{port}"
    if not host:
        return None  # every interface
    try:
        ipaddress.IPv4Address(host)
        return None
    except ValueError:
        if re.fullmatch(r"[0-9.]+", host):  # not a name: do not ask the resolver
            return f"{host!r} is not an IPv4 address"
    return _resolve_problem(host, port)


def _resolve_problem(host: str, port: int) -> str | None:
    """Resolve as the exporter will (passive TCP), in a thread: a dead resolver must not
    hang a start or a reload for long."""
    outcome: list[str | None] = []

    def lookup() -> None:
        try:
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            outcome.append(None)
        except (OSError, UnicodeError, ValueError) as exc:
            reason = getattr(exc, "strerror", None) or str(exc)
            outcome.append(f"host {host!r} does not resolve ({reason}); use an IP address "
                           "such as 127.0.0.1 or [::1], or a name in /etc/hosts or DNS")

    worker = threading.Thread(target=lookup, name="qvld-resolve", daemon=True)
    worker.start()
    worker.join(RESOLVE_TIMEOUT_S)
    if not outcome:
        return (f"host {host!r} did not resolve within {RESOLVE_TIMEOUT_S:g} s; use an IP "
                "address such as 127.0.0.1")
    return outcome[0]


class HttpConfig(_Section):
    """The OpenAI-compatible HTTP listener (qvld.http); off unless listen is set or
    systemd passes a socket named "http" (qvld-http.socket)."""

    # HOST:PORT (e.g. 127.0.0.1:8090) or unix:/ABSOLUTE/PATH (mode server.socket_mode);
    # none/empty: off.
    listen: str | None = None
    # Another HOST:PORT serving the same API, for clients that only know Ollama's port
    # (e.g. 127.0.0.1:11434); none/empty: off. Needs the HTTP API on.
    ollama_listen: str | None = None
    # "NAME:sha256:HEX" lines (qvld api-key NAME); none: local callers only, each the
    # user the kernel says it is (loopback TCP or the Unix socket), allowed as on the
    # protocol socket. Must be writable by root or the daemon's user only.
    api_keys_file: Path | None = None
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024, le=FRAME_MAX)
    # Bytes of request bodies being received, all connections together; one user may
    # hold at most max_body_bytes of it. Past either: 503 / 429 at once.
    max_pending_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    max_connections: int = Field(256, ge=1)
    # A request head or body must arrive within this, and a connection with no request
    # for this long is closed (a slowloris client holds a connection at most this long).
    read_timeout_s: float = Field(30, gt=0, le=MAX_SECONDS)
    # Token events a streaming client may leave unread before it is cut off (its
    # generation cancelled), so a reader that stalls never grows the daemon's memory.
    max_unsent_events: int = Field(4096, ge=16)
    # What a stream may leave in the kernel and the transport before writes wait (the
    # socket's SO_SNDBUF too, a C int); server.send_buffer_bytes is the Unix socket's.
    send_buffer_bytes: int = Field(1024 * 1024, ge=4096, le=C_INT_MAX)
    # Browser origins (scheme://host[:port]) whose pages may call the API (CORS): their
    # preflights are answered and responses to them name them; empty: no CORS headers.
    cors_allow_origins: list[str] = Field(default_factory=list)
    # Without api_keys_file: the Host names the listener answers to besides localhost,
    # loopback addresses and its own listen address (a name /etc/hosts or a local proxy
    # gives it). Any other Host gets 421: a DNS-rebound page reads nothing.
    allowed_hosts: list[str] = Field(default_factory=list)
    # The built-in web page at / (ask about an image from a browser; it uses the API
    # above, with a key when api_keys_file is set). false: / is a 404.
    web_ui: bool = True
    # image_url parts with detail "low": this image-token budget (≈ 256×256 pixels).
    low_detail_image_tokens: int = Field(64, ge=1)
    # http(s) image URLs: refused unless on, and then only from fetch_allow_hosts
    # (names, *.domain, IP literals, "*" for any public host); hosts that resolve to
    # private, loopback or link-local addresses only when also in fetch_allow_private.
    fetch_image_urls: bool = False
    fetch_allow_hosts: list[str] = Field(default_factory=list)
    fetch_allow_private: list[str] = Field(default_factory=list)
    fetch_max_bytes: int = Field(10 * 1024 * 1024, ge=1024, le=FRAME_MAX)
    fetch_timeout_s: float = Field(10, gt=0, le=3600)

    @field_validator("cors_allow_origins")
    @classmethod
    def _origins(cls, origins: list[str]) -> list[str]:
        for origin in origins:
            if origin == "*":
                raise ValueError("'*' would let any web page use the API with a visitor's "
                                 "local identity; list the origins")
            if not re.fullmatch(r"https?://[^/\s?#*]+", origin):
                raise ValueError(f"{origin!r} is not an origin: scheme://host[:port], "
                                 "no path and no wildcard, which a browser's Origin never "
                                 "matches (e.g. http://localhost:3000)")
        return origins

    @field_validator("allowed_hosts")
    @classmethod
    def _hosts(cls, hosts: list[str]) -> list[str]:
        for host in hosts:
            if not re.fullmatch(r"[A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\]", host):
                raise ValueError(f"{host!r} is not a host name (no scheme, port, path or "
                                 "wildcard: e.g. qvld.lan)")
        return hosts

    @field_validator("listen")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        if value and value.startswith("unix:"):
            path = value[len("unix:"):]
            if not path.startswith("/"):
                raise ValueError(f"{value!r}: write unix:/ABSOLUTE/PATH")
            _no_nul(Path(path))
            if len(os.fsencode(path)) > SUN_PATH_MAX:
                raise ValueError(f"a Unix socket path is at most {SUN_PATH_MAX} bytes")
            return value
        return _listen_address(value)

    @field_validator("ollama_listen")
    @classmethod
    def _ollama_port(cls, value: str | None) -> str | None:
        return _listen_address(value)

    @model_validator(mode="after")
    def _pending_holds_a_body(self) -> HttpConfig:
        if self.max_pending_bytes < self.max_body_bytes:
            raise ValueError(f"http.max_pending_bytes ({self.max_pending_bytes}) is below "
                             f"http.max_body_bytes ({self.max_body_bytes}): no body of the "
                             "largest size could ever be received")
        return self

    @field_validator("api_keys_file")
    @classmethod
    def _path(cls, value: Path | None) -> Path | None:
        return _no_nul(value)  # type: ignore[no-any-return]


class TuningConfig(_Section):
    apply: bool = True
    pin_cpus: str | None = "auto"  # auto, a CPU list such as "0-3,6", or none
    numa_node: Annotated[int, Field(ge=0, le=MAX_NUMA_NODE)] | Literal["auto"] | None = "auto"
    governor: Literal["leave", "performance"] = "leave"
    # setrlimit() takes it; the kernel's own ceiling (fs.nr_open) is below a C int.
    nofile: int = Field(65536, ge=64, le=C_INT_MAX)

    @field_validator("pin_cpus", mode="before")
    @classmethod
    def _cpu_list(cls, value: Any) -> Any:
        """Parsed at start-up by tuning: a typo or a huge range must fail here instead."""
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # `pin_cpus: 3` in YAML is CPU 3
        if not isinstance(value, str) or value in ("auto", ""):
            return value
        for part in value.split(","):
            if not part.strip():
                continue  # "0-3," reads as "0-3", as tuning parses it
            match = re.fullmatch(r"\s*([0-9]+)(?:-([0-9]+))?\s*", part)
            if match is None:
                raise ValueError(f"{value!r} is not 'auto' or a CPU list such as \"0-3,6\"")
            low, high = int(match[1]), int(match[2] or match[1])
            if low > high or high > MAX_CPU:
                raise ValueError(f"{part.strip()!r}: CPUs are 0..{MAX_CPU}, low-high")
        return value


class LoggingConfig(_Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["text", "json"] = "text"
    log_prompts: bool = False


class Config(_Section):
    model: ModelConfig = ModelConfig()
    engine: EngineConfig = EngineConfig()
    server: ServerConfig = ServerConfig()
    metrics: MetricsConfig = MetricsConfig()
    http: HttpConfig = HttpConfig()
    tuning: TuningConfig = TuningConfig()
    logging: LoggingConfig = LoggingConfig()

    def deprecations(self) -> list[str]:
        """What to tell the operator about each deprecated key this configuration sets
        (whatever its value): the engine logs it, check-config prints it."""
        found = []
        for key, why in DEPRECATED_KEYS.items():
            section, name = key.split(".")
            if name in getattr(self, section).model_fields_set:
                found.append(f"{key} is deprecated and has no effect: {why}; remove it")
        return found


# Keys that still load but do nothing; not in the shipped file nor among iter_keys().
DEPRECATED_KEYS: dict[str, str] = {
    "engine.batch_invariant": "a batched answer equals the answer alone on every backend "
                              "(int8 ONNX graphs quantise each token's activations with "
                              "a scale of its own)",
}


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices``, or nothing (config keys
    and request params alike)."""
    close = difflib.get_close_matches(name, sorted(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def iter_keys(model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    """Every dotted key of the schema in declaration order, but the deprecated ones."""
    keys: list[str] = []
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys.extend(iter_keys(annotation, f"{prefix}{name}."))
        elif f"{prefix}{name}" not in DEPRECATED_KEYS:
            keys.append(f"{prefix}{name}")
    return keys

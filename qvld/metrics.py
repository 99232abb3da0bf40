"""Prometheus metrics on an injected registry, and the HTTP exporter.

Names follow Prometheus conventions (base units, ``_total`` counters, ``qvld_`` prefix).
Label values never come from client input: ``api`` is ``socket``, ``http`` (the
OpenAI-compatible chat completions), ``responses`` (OpenAI's Responses API),
``anthropic`` (the Messages API) or ``ollama``, ``op`` is a
known op or ``unknown`` and ``outcome`` is ``ok``, ``cancelled`` or an error code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import choose_encoder

from qvld import protocol
from qvld.errors import ERRORS_BY_CODE

log = logging.getLogger("qvld.metrics")

# CPU latencies: dense from 50 ms to 2 minutes.
LATENCY_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0,
                   5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0)
# Stages that are often nearly free (a queue wait with an idle worker, a cached image, a
# cached prefix): from 1 ms, so an idle dashboard reads 1 ms rather than 47.
STAGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, *LATENCY_BUCKETS)
# Per-token gaps: 5 ms to 2 s.
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.125, 0.15, 0.2, 0.25,
                 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0)
# The HTTP front adds its own: a missing or wrong key, a path or method it does not serve.
OUTCOMES = ("ok", "cancelled", *ERRORS_BY_CODE, "invalid_api_key", "not_found",
            "method_not_allowed")
APIS = ("socket", "http", "responses", "anthropic", "ollama")
# What the HTTP front calls its routes in metrics (the chat completions are "generate").
HTTP_OPS = frozenset({"generate", "health", "models", "metrics"})
# Generations per batched step, and prompt rows fed per step.
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
PREFILL_ROW_BUCKETS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# Structured output: a grammar's compile (a cached one is not observed), and the token
# mask of one step (computed and applied to the logits).
COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0)
MASK_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
                0.01, 0.025, 0.05)
RESPONSE_FORMATS = ("json_schema", "json_object", "regex", "grammar")




def outcome_label(outcome: str) -> str:
    return outcome if outcome in OUTCOMES else "internal"


class Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        # No `_created` series: twelve extra names that no rule or dashboard reads (a
        # process-wide switch of prometheus_client; qvld's registries are all its own).
        disable_created_metrics()  # type: ignore[no-untyped-call]

        def histogram(name: str, doc: str, buckets: tuple[float, ...],
                      labels: tuple[str, ...] = ()) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry)

        self.request_duration = histogram(
            "qvld_request_duration_seconds", "Time from a request's arrival to its final reply.",
            LATENCY_BUCKETS, ("api", "op"))
        self.ttft = histogram("qvld_time_to_first_token_seconds",
                              "Time from a generate request's arrival to its first token.",
                              LATENCY_BUCKETS)
        self.inter_token = histogram("qvld_inter_token_latency_seconds",
                                     "Time between consecutive generated tokens.", TOKEN_BUCKETS)
        self.queue_wait = histogram("qvld_queue_wait_seconds",
                                    "Time a generation waited for a worker.", STAGE_BUCKETS)
        self.image_encode = histogram("qvld_image_encode_seconds",
                                      "Image decoding and vision encoding per request.",
                                      STAGE_BUCKETS)
        self.prefill = histogram("qvld_prefill_seconds", "Prompt prefill per request.",
                                 STAGE_BUCKETS)
        self.requests = Counter("qvld_requests", "Requests by front door (the Unix socket "
                                "or HTTP), op and outcome.", ("api", "op", "outcome"),
                                registry=registry)
        self.prompt_tokens = Counter("qvld_prompt_tokens", "Prompt tokens of generations.",
                                     registry=registry)
        self.generated_tokens = Counter("qvld_generated_tokens", "Tokens generated.",
                                        registry=registry)
        self.image_cache_hits = Counter("qvld_image_cache_hits",
                                        "Images whose embeddings came from the cache.",
                                        registry=registry)
        self.image_cache_misses = Counter("qvld_image_cache_misses",
                                          "Images that had to be encoded.", registry=registry)
        self.session_cache_hits = Counter(
            "qvld_session_cache_hits",
            "Generations that reused KV-cache rows (sessions, repeated prefixes).",
            registry=registry)
        self.in_flight = Gauge("qvld_requests_in_flight", "Generations admitted (running or "
                               "waiting).", registry=registry)
        # The load signals of the Gateway API Inference Extension's model-server protocol
        # (docs/scale-out.md maps each to its endpoint-picker flag): queue depth,
        # running generations, KV-cache use 0..1 (qvld_kv_cache_usage_ratio below),
        # prefix-cache hits and queries in tokens, the KV block layout.
        self.queue_depth = Gauge("qvld_queue_depth", "Generations waiting for a worker "
                                 "(TotalQueuedRequests).", registry=registry)
        self.running = Gauge("qvld_requests_running", "Generations running now "
                             "(TotalRunningRequests).", registry=registry)
        self.prefix_queries = Counter("qvld_prefix_cache_queries", "Prompt tokens looked up "
                                      "in the prefix (KV) cache.", registry=registry)
        self.prefix_hits = Counter("qvld_prefix_cache_hits", "Prompt tokens whose KV rows "
                                   "came from the prefix cache.", registry=registry)
        self.cache_config = Gauge("qvld_cache_config_info", "The KV cache's layout: tokens "
                                  "per block and blocks (1 for the current one).",
                                  ("block_size", "num_blocks"), registry=registry)
        self.sessions_active = Gauge("qvld_sessions_active", "Open sessions.",
                                     registry=registry)
        self.model_load = Gauge("qvld_model_load_seconds",
                                "Time the current model took to load and warm up.",
                                registry=registry)
        self.ready = Gauge("qvld_ready", "1 when the daemon serves generations.",
                           registry=registry)
        self.build_info = Gauge("qvld_build_info", "Version, runtime and model.",
                                ("version", "backend", "runtime_version", "model",
                                 "precision"), registry=registry)
        self.preflight = Gauge("qvld_preflight_check",
                               "Preflight checks: 1 for the status each check has.",
                               ("check", "status"), registry=registry)
        self.kv_usage = Gauge("qvld_kv_cache_usage_ratio",
                              "KV-cache blocks held by running generations, 0 to 1 (cached "
                              "prefixes count as free: they give way).", registry=registry)
        self.kv_blocks = Gauge("qvld_kv_cache_blocks", "KV-cache blocks by state: held by "
                               "generations, kept for sessions' histories, cached "
                               "prefixes, free (together every block).", ("state",),
                               registry=registry)
        self.batch_sequences = Gauge("qvld_batch_sequences", "Generations in the batched step "
                                     "loop, decoding or feeding their prompt.", ("state",),
                                     registry=registry)
        self.batch_size = histogram("qvld_batch_sequences_per_step",
                                    "Generations advanced by one batched step.", BATCH_BUCKETS)
        self.step_prefill = histogram("qvld_batch_prefill_tokens_per_step",
                                      "Prompt rows fed in one batched step.", PREFILL_ROW_BUCKETS)
        self.prefill_tokens = Counter("qvld_prefill_tokens", "Prompt rows the language model "
                                      "computed under continuous batching, by the runtime "
                                      "that did (model.prompt_backend moves them).",
                                      ("runtime",), registry=registry)
        self.constrained = Counter("qvld_constrained_requests",
                                   "Generations whose answer a response format constrained, "
                                   "by its type.", ("format",), registry=registry)
        self.forced_tokens = Counter("qvld_constrained_forced_tokens",
                                     "Completion tokens a response format forced (a key, a "
                                     "quote, a brace: fed without sampling), by its type.",
                                     ("format",), registry=registry)
        self.grammar_compile = histogram("qvld_grammar_compile_seconds",
                                         "Compiling a response format (cached ones are not "
                                         "compiled again).", COMPILE_BUCKETS)
        self.grammar_mask = histogram("qvld_grammar_mask_seconds",
                                      "Computing and applying a response format's token "
                                      "mask, per generated token.", MASK_BUCKETS)
        for fmt in RESPONSE_FORMATS:
            self.constrained.labels(fmt)
            self.forced_tokens.labels(fmt)
        ProcessCollector(registry=registry)
        # Pre-create the request series that alert rules divide by, so they exist at 0.
        for op in ("generate", "health"):
            self.requests.labels("socket", op, "ok")

    def bind(self, in_flight: Callable[[], float], queue_depth: Callable[[], float],
             sessions: Callable[[], float],
             batch: Callable[[], dict[str, Any]] = dict,
             running: Callable[[], float] | None = None) -> None:
        """Live gauges, read at scrape time (``batch``: the engine's batch_stats)."""
        self.in_flight.set_function(in_flight)
        self.queue_depth.set_function(queue_depth)
        if running is not None:
            self.running.set_function(running)
        self.sessions_active.set_function(sessions)

        def read(*path: str) -> Callable[[], float]:
            def value() -> float:
                node: Any = batch()
                for key in path:
                    node = node.get(key, {}) if isinstance(node, dict) else {}
                return float(node) if isinstance(node, int | float) else 0.0
            return value

        self.kv_usage.set_function(read("kv_usage_ratio"))
        for state in ("held", "kept", "cached", "free"):
            self.kv_blocks.labels(state).set_function(read("kv_blocks", state))
        for state in ("decoding", "prefilling"):
            self.batch_sequences.labels(state).set_function(read(state))

    def observe_step(self, sequences: int, prefill_rows: int) -> None:
        """One batched step: how many generations it advanced, how many prompt rows."""
        self.batch_size.observe(sequences)
        self.step_prefill.observe(prefill_rows)

    def observe_prefill(self, runtime: str, rows: int) -> None:
        """Prompt rows one runtime computed (a step's, or a prompt backend's prefill)."""
        self.prefill_tokens.labels(runtime).inc(rows)

    def observe_request(self, op: object, outcome: str, seconds: float,
                        api: str = "socket") -> None:
        api = api if api in APIS else "socket"
        label = op if api != "socket" and isinstance(op, str) and op in HTTP_OPS \
            else protocol.op_label(op)
        self.requests.labels(api, label, outcome_label(outcome)).inc()
        self.request_duration.labels(api, label).observe(seconds)

    def observe_generation(self, result: Any) -> None:
        """A finished generation's timings and counts (a GenerateResult)."""
        t, usage = result.timings, result.usage
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.generated_tokens.inc(usage.completion_tokens)
        if usage.completion_tokens:
            self.ttft.observe(t.ttft_s)
        self.queue_wait.observe(t.queue_s)
        self.prefill.observe(t.prefill_s)
        if usage.image_tokens:
            self.image_encode.observe(t.image_s)
        for gap in result.token_gaps:
            self.inter_token.observe(gap)
        self.image_cache_hits.inc(result.image_cache_hits)
        self.image_cache_misses.inc(result.image_cache_misses)
        if usage.cached_tokens:
            self.session_cache_hits.inc()
        self.prefix_queries.inc(usage.prompt_tokens)
        self.prefix_hits.inc(usage.cached_tokens)
        if result.response_format in RESPONSE_FORMATS:
            self.constrained.labels(result.response_format).inc()
            self.forced_tokens.labels(result.response_format).inc(usage.forced_tokens)
            if result.grammar_compile_s is not None:
                self.grammar_compile.observe(result.grammar_compile_s)
            for seconds in result.mask_s:
                self.grammar_mask.observe(seconds)

    def set_model(self, version: str, backend: str, runtime_version: str, model: str,
                  precision: str, load_s: float) -> None:
        """The model being served: ``backend`` is the runtime that runs it (openvino,
        onnxruntime), ``runtime_version`` that runtime's version."""
        self.build_info.clear()
        self.build_info.labels(version, backend, runtime_version, model, precision).set(1)
        self.model_load.set(load_s)

    def set_cache_layout(self, block_size: int | None, blocks: int | None) -> None:
        """The KV cache's blocks (none: one cache per generation, no blocks)."""
        self.cache_config.clear()
        if block_size and blocks:
            self.cache_config.labels(str(block_size), str(blocks)).set(1)

    def set_preflight(self, checks: list[dict[str, Any]]) -> None:
        self.preflight.clear()
        for check in checks:
            for status in ("ok", "warn", "fail", "n/a"):
                self.preflight.labels(check["id"], status).set(
                    1 if check["status"] == status else 0)

    def exposition(self) -> str:
        return generate_latest(self.registry).decode()


class Exporter:
    """The HTTP endpoint Prometheus scrapes (`metrics.listen`), served on the event loop.

    Anyone on the host can connect to it (no socket permission is needed), so what a
    connection may cost is bounded: at most ``max_connections`` at once (more are
    answered 503 and closed without being read), a request head of at most
    ``max_head_bytes`` that must arrive within ``timeout_s``, one request per
    connection, and the reply must be taken within ``timeout_s``. prometheus_client's
    own server starts a thread per connection with no timeout: 1000 idle connections
    were 1000 threads. The exposition itself (and its format negotiation) is still
    prometheus_client's.
    """

    def __init__(self, registry: CollectorRegistry, listen: str, max_connections: int = 16,
                 timeout_s: float = 5.0, max_head_bytes: int = 8192) -> None:
        self.registry = registry
        self.listen = listen
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self.max_head_bytes = max_head_bytes
        self.connections = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        host, _, port = self.listen.rpartition(":")
        self._server = await asyncio.start_server(
            self._serve, host.strip("[]") or "0.0.0.0", int(port),
            limit=self.max_head_bytes, reuse_address=True)
        log.info("metrics on http://%s/metrics", self.listen)

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            if self.connections > self.max_connections:
                writer.write(_response(503, b"too many connections\n"))
            else:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.timeout_s)
                writer.write(self._answer(head))
            await asyncio.wait_for(writer.drain(), self.timeout_s)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ValueError, ConnectionError):
            pass  # a client that stalls, overflows or leaves gets nothing more
        finally:
            self.connections -= 1
            if writer.transport.get_write_buffer_size():
                writer.transport.abort()  # unread: do not wait for the client
            else:
                writer.close()

    def _answer(self, head: bytes) -> bytes:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return _response(400, b"bad request\n")
        method, target = parts[0], parts[1].split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return _response(405, b"only GET\n", [("Allow", "GET, HEAD")])
        if target != "/metrics":  # a probe aimed at another path must not pass
            return _response(404, b"metrics are at /metrics\n")
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        encoder, content_type = choose_encoder(headers.get("accept", ""))
        body = encoder(self.registry)
        return _response(200, body, [("Content-Type", content_type)],
                         send_body=method == "GET")

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), self.timeout_s)
            self._server = None


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            503: "Service Unavailable"}


def _response(status: int, body: bytes, headers: list[tuple[str, str]] | None = None,
              send_body: bool = True) -> bytes:
    fields = [("Content-Type", "text/plain; charset=utf-8"), *(headers or [])]
    fields = list(dict(fields).items())  # a later Content-Type replaces the default
    fields += [("Content-Length", str(len(body))), ("Connection", "close")]
    head = f"HTTP/1.1 {status} {_REASONS[status]}\r\n" + "".join(
        f"{name}: {value}\r\n" for name, value in fields) + "\r\n"
    return head.encode("latin-1") + (body if send_body else b"")

"""The daemon's own routes: health for probes, metrics, the built-in web page."""

from __future__ import annotations

from aiohttp import web
from prometheus_client.exposition import choose_encoder

from qvld.http import openai, webui
from qvld.http.routing import Front, Route, error_response


class DaemonRoutes:
    def __init__(self, front: Front, *, serve_metrics: bool) -> None:
        self.front = front
        self.serve_metrics = serve_metrics  # not when metrics.listen serves them apart
        self.assets = webui.load_assets()

    def routes(self) -> list[Route]:
        return [Route("GET", "/health", self.health, "health"),
                *([Route("GET", "/metrics", self.metrics_text, "metrics")]
                  if self.serve_metrics else []),
                # http.web_ui is checked per request (a reload may turn it off).
                Route("GET", "/", self.web_page, "web"),
                Route("GET", "/ui/{name}", self.web_page, "web"),
                Route("GET", "/favicon.ico", self.web_page, "web")]

    async def health(self, request: web.Request) -> web.StreamResponse:
        """For load balancers and probes, without a key: 200 while generations are
        served (a reload keeps serving the old model), else 503."""
        state = self.front.state
        serving = state.engine is not None and state.state in ("ready", "reloading")
        body = {"status": state.state, "ready": serving}
        if serving:
            return web.json_response(body)
        request["outcome"] = "unavailable"
        return web.json_response(body, status=503, headers={"Retry-After": "1"})

    async def web_page(self, request: web.Request) -> web.StreamResponse:
        """The built-in page and its files (``webui``); 404 with http.web_ui off."""
        web_ui = self.front.config.web_ui
        asset = self.assets.get(request.path) if web_ui else None
        if asset is None:
            request["outcome"] = "not_found"
            why = "" if web_ui else " (http.web_ui is off)"
            return error_response(*openai.error_body(
                code="not_found", message=f"GET {request.path} is not served here{why}"))
        return webui.respond(asset, request)

    async def metrics_text(self, request: web.Request) -> web.StreamResponse:
        await self.front.callers.identify(request)
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encoder(self.front.metrics.registry),
                            headers={"Content-Type": content_type})

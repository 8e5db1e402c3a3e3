"""The API key (`--api-key KEY` or ADASPARK_API_KEY): an ASGI middleware in front of every route.

With a key, every request needs `Authorization: Bearer KEY`, else a 401 in OpenAI's error shape
(code invalid_api_key), except the routes that are open by design:
  /health                              a load balancer's probe; says only ready or not
  /dashboard, /dashboard/static/*      the page and its script, no data: the page asks for the
                                       key and sends it as a header on its data fetches
  /metrics, /dashboard/data            only with --public-metrics (for a Prometheus scraper or
                                       a dashboard without the key)
Everything else is closed, unknown paths included, so a new route is never open by accident;
/v1/* always needs the key. The comparison is timing-safe: both sides are hashed to the same
length, then compared with hmac.compare_digest.
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from adaspark.errors import UserError
from adaspark.server.errors import error_response

ALWAYS_OPEN = ("/health", "/dashboard")
OPEN_PREFIXES = ("/dashboard/static/",)
METRICS_ROUTES = ("/metrics", "/dashboard/data")
ENV_VAR = "ADASPARK_API_KEY"


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).digest()


class ApiKey:
    def __init__(self, key: str) -> None:
        if not key or key != key.strip():
            raise UserError("the API key must be non-empty, without surrounding spaces")
        self._digest = _digest(key)

    def accepts(self, authorization: str | None) -> bool:
        """Whether an Authorization header carries the key as a Bearer token."""
        scheme, _, token = (authorization or "").partition(" ")
        # compared even when the scheme is wrong, so the answer's timing says nothing
        same = hmac.compare_digest(_digest(token.strip()), self._digest)
        return same and scheme.lower() == "bearer"


def is_open(path: str, public_metrics: bool) -> bool:
    if path in ALWAYS_OPEN or path.startswith(OPEN_PREFIXES):
        return True
    return public_metrics and path in METRICS_ROUTES


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, key: ApiKey, public_metrics: bool = False) -> None:
        self.app, self.key, self.public_metrics = app, key, public_metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not is_open(scope["path"], self.public_metrics):
            if not self.key.accepts(Headers(scope=scope).get("authorization")):
                response = error_response(
                    401, "missing or wrong API key: send the header 'Authorization: Bearer "
                    "<key>' (the key given to adaspark serve --api-key)", code="invalid_api_key")
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

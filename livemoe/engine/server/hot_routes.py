"""The generation routes, POST /v1/completions and /v1/chat/completions, on a lean path: an ASGI layer
between the RequestGuard (so host, API key and body limits apply first) and FastAPI's middleware stack
(app.GuardedApp), which validates the body with the same pydantic models and calls the same OpenAIServer
methods as the FastAPI routes, without FastAPI's routing, dependency solving, error, exception and
telemetry middleware and per-request exit stacks. Those layers were a third of the API server's CPU per
request, which a burst of requests pays in series before the last of them reaches the engine
(bench/results/2026-12-01-cpu-serve-lean).

Only what validates goes this way: a body that is not JSON, is sent without `Content-Type:
application/json`, or fails the model's validation goes on to the FastAPI route, whose 400 names the
field as before, so every error body stays FastAPI's by construction. Every other path and method goes
on to FastAPI too.
"""
import json

from pydantic import ValidationError

from livemoe.engine.server.guard import read_body, replay
from livemoe.engine.server.protocol import ChatCompletionRequest, CompletionRequest

JSON_CONTENT_TYPE = b"application/json"


class HotRoutes:
    def __init__(self, app, server, on_error):
        """server: the OpenAIServer; on_error(exc, path): the response to a request that raised (app.py's
        error_response, which the FastAPI routes' exception handlers give too)."""
        self.app, self.on_error = app, on_error
        self.routes = {"/v1/completions": (CompletionRequest, server.completions),
                       "/v1/chat/completions": (ChatCompletionRequest, server.chat_completions)}

    async def __call__(self, scope, receive, send):
        route = None
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            route = self.routes.get(scope["path"])
        if route is None:
            return await self.app(scope, receive, send)
        body = await read_body(receive)  # the guard has read it (and held it to its limit): one message
        if body is None:
            return  # the client left while sending
        model, handler = route
        request = _validated(model, body, scope["headers"])
        if request is None:  # FastAPI's route gives the 400 that names what is wrong
            return await self.app(scope, replay(body, receive), send)
        try:
            response = await handler(request, receive)
        except Exception as exc:
            response = self.on_error(exc, scope["path"])
        await response(scope, receive, send)


def _validated(model, body: bytes, headers):
    """The request model for a JSON body that validates, else None. FastAPI reads the body as JSON for
    more content types (none, `application/*+json`); those go its way."""
    content_type = next((value for name, value in headers if name == b"content-type"), None)
    if content_type is None or content_type.split(b";", 1)[0].strip().lower() != JSON_CONTENT_TYPE:
        return None
    try:
        return model.model_validate(json.loads(body))  # the parser and validator FastAPI's route uses
    except (ValueError, ValidationError):  # (a JSONDecodeError or UnicodeDecodeError is a ValueError)
        return None


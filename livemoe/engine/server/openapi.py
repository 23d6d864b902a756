"""The OpenAPI document (/openapi.json with --enable-docs) with the error answers the server really gives.

FastAPI documents a 422 on every route with parameters; this server answers a bad body with a 400 (and never a 422),
and refuses in the guard and the routes with the codes below, each with the OpenAI error body. document_errors()
replaces FastAPI's schema function with one that lists them per operation.
"""
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from livemoe.engine.server.admin import ADMIN_WRITE_PATHS

ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
EVERY_ROUTE = {  # the guard's, and the app's own
    "400": "A bad request: a body that is not valid (named in the message), JSON nested too deep or holding a lone "
           "surrogate, a parameter out of range or over a server limit, a Host header not answered",
    "401": "No or a wrong API key (when the server has one)",
    "404": "An unknown model, session or route",
    "500": "An internal error (logged); the server goes on",
    "503": "The engine is asleep or no engine core is alive",
}
WITH_A_BODY = {
    "408": "The body did not arrive within --body-timeout-s",
    "413": "The body is over --max-body-bytes",
}
ADMIN = {
    "403": "Admin routes are off: start the server with --enable-admin-routes or --api-key",
    "409": "The engine cannot do it now (asleep already, no weight-update group, an update while asleep)",
}
LIVE_CREATE = {"429": "--max-live-sessions sessions are open"}


def document_errors(app: FastAPI) -> None:
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR_SCHEMA
            for name in ("HTTPValidationError", "ValidationError"):
                schema["components"]["schemas"].pop(name, None)
            for path, operations in schema.get("paths", {}).items():
                for method, op in operations.items():
                    op["responses"].pop("422", None)
                    codes = dict(EVERY_ROUTE)
                    if method in ("post", "put", "patch"):
                        codes.update(WITH_A_BODY)
                    if path in ADMIN_WRITE_PATHS:
                        codes.update(ADMIN)
                    if path == "/v1/live/sessions" and method == "post":
                        codes.update(LIVE_CREATE)
                    for code, why in codes.items():
                        op["responses"].setdefault(code, {"description": why, "content": {
                            "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}})
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

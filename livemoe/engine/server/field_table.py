"""The request-field table of docs/serving.md, generated from the request models themselves (their fields,
EXTENSIONS, REFUSED_WHEN and NO_EFFECT): `python -m livemoe.engine.server.field_table` prints it, and a test keeps
the doc's copy equal to it. A field not in the table is an unknown field: a 400 naming it."""
from livemoe.engine.server.protocol import ChatCompletionRequest, CompletionRequest, ResponseFormat, StreamOptions
from livemoe.engine.server.responses_api import ResponsesRequest

ENDPOINTS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
             "/v1/responses": ResponsesRequest}
NESTED = {"stream_options": StreamOptions, "response_format": ResponseFormat}  # sub-fields with rows of their own


def field_names(model) -> list[str]:
    names = []
    for name, info in model.model_fields.items():
        name = info.alias or name
        names.append(name)
        sub = NESTED.get(name)
        if sub is not None and name in model.model_fields:
            names += [f"{name}.{s.alias or k}" for k, s in sub.model_fields.items()]
    return names


def cell(model, name: str) -> str:
    if name not in field_names(model):
        return "400 (unknown)"
    if name in model.NO_EFFECT:
        return "no effect"
    refused = model.REFUSED_WHEN.get(name)
    if refused and refused.startswith("always"):  # a field named only to be refused with a reason
        return f"400 {refused.removeprefix('always').strip()}"
    return f"yes; 400 {refused}" if refused else "yes"


def table() -> str:
    rows: dict[str, str] = {}
    for model in ENDPOINTS.values():
        for name in field_names(model):
            rows.setdefault(name, model.EXTENSIONS.get(name, rows.get(name, "")))
    for model in ENDPOINTS.values():  # an extension on one endpoint may be OpenAI's on another (seed)
        for name in field_names(model):
            if name not in model.EXTENSIONS:
                rows[name] = "OpenAI"
    lines = ["| field | from | " + " | ".join(f"`{e}`" for e in ENDPOINTS) + " |",
             "| --- | --- | " + " | ".join("---" for _ in ENDPOINTS) + " |"]
    for name, origin in rows.items():
        lines.append(f"| `{name}` | {origin} | " + " | ".join(cell(m, name) for m in ENDPOINTS.values()) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())

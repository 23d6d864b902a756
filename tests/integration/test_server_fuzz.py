"""Schemathesis over the server's own OpenAPI document, against the server as the CLI starts it (engine core in
its own process): generated requests for every operation, valid ones (with the served model's name and an open
live session's id, so they reach the engine) and, where a body or parameter can be broken, invalid ones; each
must be answered without a 5xx and with a status the document lists. Bounded (MAX_EXAMPLES per operation and
mode, a fixed seed: the same requests every run; ~1 minute here) and run with small limits, so that the generated
requests stay cheap on a CPU. Admin routes stay off, as shipped (a 403, documented)."""
import pytest

from fixtures import http_json, require_server_extras
from tiny_tokenizer import make_text_checkpoint

require_server_extras()
schemathesis = pytest.importorskip("schemathesis", reason="needs schemathesis (pip install -e .[test])")
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import status_code_conformance  # noqa: E402

MAX_EXAMPLES = 25
FLAGS = ["--num-kv-blocks", "64", "--block-size", "16", "--threads", "1", "--device", "cpu", "--dtype", "float32",
         "--max-model-len", "384", "--max-n", "2", "--max-prompts", "2", "--max-sequences", "4",
         "--max-live-sessions", "8", "--max-grammar-compile-s", "2", "--enable-docs"]


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    from livemoe.engine.server import ServerProcess

    path = make_text_checkpoint(tmp_path_factory.mktemp("fuzz") / "ckpt", moe=True)[0]
    with ServerProcess(path, "tiny", FLAGS) as server:
        yield server


@pytest.mark.parametrize("mode", ["POSITIVE", "NEGATIVE"])
def test_no_5xx_and_only_documented_statuses(fuzz_server, mode):
    """Every operation in turn, each with its own seeded hypothesis run (schemathesis's pytest plugin does not run
    under pytest 9, so the operations are walked here)."""
    status, session = http_json(fuzz_server.url + "/v1/live/sessions", {"system": "a live room"})
    assert status == 200, session
    api = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert len(operations) >= 15
    answered = 0

    def reach_the_engine(case):
        if mode == "POSITIVE" and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = "tiny"  # (another name is a 404 before anything else is looked at)
        if mode == "POSITIVE" and "session_id" in (case.path_parameters or {}):
            case.path_parameters["session_id"] = session["id"]
        return case

    for operation in operations:

        @seed(35)
        @settings(max_examples=MAX_EXAMPLES, derandomize=True, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=getattr(schemathesis.GenerationMode, mode))
               .map(reach_the_engine))
        def run(case):
            nonlocal answered
            response = case.call(timeout=60)
            answered += 1
            case.validate_response(response, checks=[not_a_server_error, status_code_conformance])

        try:
            run()
        except Unsatisfiable:  # nothing of this operation can be made invalid (no body, no parameter)
            assert mode == "NEGATIVE"
    assert answered >= (200 if mode == "POSITIVE" else 100)
    assert http_json(fuzz_server.url + "/health")[0] == 200

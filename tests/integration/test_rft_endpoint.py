"""The OpenAI-compatible path against a local fake server: the teacher (n samples, retries with backoff
after 503s, reasoning_content put back into <think>), the Appendix B judge over HTTP, and fail-fast errors."""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from test_data import MUSIQUE
from test_rft import student  # noqa: F401  (the tiny student fixture)
from livemoe.train.endpoint import ChatEndpoint, EndpointError
from livemoe.train.judges import LLMJudge
from livemoe.train.synthetic import make_rooms
from livemoe.train.teachers import EndpointTeacher


class Fake(BaseHTTPRequestHandler):
    plan = []  # status codes to answer before succeeding
    seen = []

    def log_message(self, *a):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        type(self).seen.append(body)
        if type(self).plan:
            self.send_response(type(self).plan.pop(0))
            self.end_headers()
            return
        prompt = body.get("messages", [{}])[-1].get("content", "")
        if "judge the correctness" in prompt:
            msgs = [{"content": '{"Reason for Judgment": "ok", "Is the Response Correct": "yes"}'}]
        elif "was helpful" in prompt:
            msgs = [{"content": "no json here"}]
        elif "Which river" in prompt:  # MuSiQue: one right answer, one wrong
            msgs = [{"content": a, "reasoning_content": "paris is on the seine"} for a in ("Seine", "Thames")]
        else:
            msgs = [{"content": f"answer {i}", "reasoning_content": f"thought {i}"} for i in range(body.get("n", 1))]
        data = json.dumps({"choices": [{"index": i, "message": {"role": "assistant", **m}} for i, m in enumerate(msgs)]})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(data.encode())


@pytest.fixture
def server():
    Fake.plan, Fake.seen = [], []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Fake)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()


def test_teacher_over_http_with_retries(server):
    ep = ChatEndpoint(server, model="teacher-x", concurrency=2, retries=3, backoff_s=0.01)
    teacher = EndpointTeacher(ep)  # its reachability check happens here
    Fake.plan = [503, 429]  # two transient failures, then success
    rooms = make_rooms(3, seed=0)
    out = teacher.sample(rooms, k=2, temperature=0.7)
    assert out == [["<think>thought 0</think>answer 0", "<think>thought 1</think>answer 1"]] * 3
    assert ep.failures == 2
    sent = [b for b in Fake.seen if b.get("messages")]
    assert all(b["model"] == "teacher-x" and b["n"] == 2 and b["temperature"] == 0.7 for b in sent)
    assert sent[-1]["messages"][0]["role"] == "system" and "products:" in sent[-1]["messages"][0]["content"]


def test_non_transient_error_and_exhausted_retries_name_the_url(server):
    Fake.plan = [400]
    with pytest.raises(EndpointError, match=r"/v1/chat/completions: HTTP 400"):
        ChatEndpoint(server, backoff_s=0.01).chat([{"role": "user", "content": "x"}])
    Fake.plan = [503] * 3
    with pytest.raises(EndpointError, match="HTTP 503"):
        ChatEndpoint(server, retries=2, backoff_s=0.01).chat([{"role": "user", "content": "x"}])


def test_llm_judge_over_http_counts_unparseable(server):
    j = LLMJudge(url=server, model="judge-x")
    rooms = make_rooms(2, seed=1)
    vs = j.judge_batch(rooms, ["<think>t</think>r."] * 2)
    assert [(v.correct, v.helpful, v.unparseable) for v in vs] == [(True, False, True)] * 2
    assert j.unparseable == 2


def test_bad_url():
    with pytest.raises(EndpointError, match="must start with http"):
        ChatEndpoint("localhost:8000")


def test_musique_run_with_an_endpoint_teacher_and_em_f1(server, student, tmp_path, capsys):  # noqa: F811
    from livemoe.train.rft.__main__ import main

    data = tmp_path / "musique.jsonl"
    data.write_text("\n".join(json.dumps({**MUSIQUE, "id": f"q{i}"}) for i in range(3)) + "\n")
    out = tmp_path / "o"
    code = main(["--model", student, "--data", str(data), "--eval_data", str(data), "--teacher", server,
                 "--k", "2", "--max_steps", "1", "--batch_size", "2", "--eval_max_new_tokens", "4",
                 "--output_dir", str(out), "--progress", "false"])
    assert code == 0, capsys.readouterr().err
    selected = [json.loads(x) for x in (out / "selected.jsonl").read_text().splitlines()]
    assert [s["completion"] for s in selected] == ["<think>paris is on the seine</think>Seine"] * 3
    table = (out / "eval_table.md").read_text()
    assert "| EM | F1 |" in table and "Correct." not in table

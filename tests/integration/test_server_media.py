"""The server with media content parts (a tiny Qwen3-Omni-MoE thinker): OpenAI's and vLLM's shapes (input_audio,
audio_url, image_url, video_url; data URLs, and local paths under --allowed-local-media-path) are answered, and the
answer is the offline engine's; malformed media and parts the protocol does not know are 400s naming them."""
import base64

import pytest
import torch

from fixtures import http_json, require_server_extras

require_server_extras()

from livemoe import LLM, SamplingParams  # noqa: E402
from livemoe.engine.async_llm import AsyncLLM  # noqa: E402
from livemoe.engine.server import BackgroundServer, ServerConfig  # noqa: E402
from test_omni_engine import image_url, wav_b64  # noqa: E402
from tiny_omni import make_omni_checkpoint  # noqa: E402
from tiny_tokenizer import train_tokenizer  # noqa: E402

MODEL = "omni"
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    path, _ = make_omni_checkpoint(root / "ckpt", seed=2, tokenizer=train_tokenizer())
    (root / "files").mkdir()
    (root / "files" / "cat.png").write_bytes(base64.b64decode(image_url(4).split(",", 1)[1]))
    options = dict(dtype=torch.float32, device="cpu", block_size=16, num_kv_blocks=96, max_audio_seconds=5.0)
    engine = AsyncLLM(path, use_tqdm=False, **options)
    server = BackgroundServer(engine, MODEL, config=ServerConfig(allowed_local_media_path=str(root / "files"))).start()
    yield server, path, root, options
    server.stop()
    engine.shutdown()


def chat(server, parts, max_tokens=4):
    body = {"model": MODEL, "messages": [{"role": "user", "content": parts}], "max_tokens": max_tokens,
            "temperature": 0}
    return http_json(server.url + "/v1/chat/completions", body)


def test_content_part_shapes_are_answered_as_offline(served):
    server, path, root, options = served
    parts = [{"type": "text", "text": "listen"},
             {"type": "input_audio", "input_audio": {"data": wav_b64(1.1), "format": "wav"}},
             {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + wav_b64(0.6, seed=2)}},
             {"type": "image_url", "image_url": {"url": image_url(1), "detail": "auto"}},
             {"type": "image_url", "image_url": {"url": str(root / "files" / "cat.png")}},
             {"type": "video_url", "video_url": {"url": image_url(3, (32, 32), "GIF", frames=4)}},
             {"type": "text", "text": "what now?"}]
    status, body = chat(server, parts)
    assert status == 200, body
    llm = LLM(path, **options)
    offline = llm.chat([{"role": "user", "content": parts}], SamplingParams(temperature=0, max_tokens=4))[0]
    assert body["choices"][0]["message"]["content"] == offline.outputs[0].text
    assert body["usage"]["prompt_tokens"] == len(offline.prompt_token_ids) > 100


BAD = {
    "undecodable audio": ({"type": "input_audio", "input_audio": {"data": base64.b64encode(b"xx").decode()}},
                          "not a PCM WAV"),
    "wrong sample rate": ({"type": "input_audio", "input_audio": {"data": wav_b64(0.4, rate=22050)}}, "22050 Hz"),
    "too long": ({"type": "input_audio", "input_audio": {"data": wav_b64(6.0)}}, "at most 5 s"),
    "undecodable image": ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                          "not a readable image"),
    "not a data URL": ({"type": "image_url", "image_url": {"url": "data:image/png,raw"}}, "base64"),
    "path outside": ({"type": "image_url", "image_url": {"url": "/etc/passwd"}}, "outside the allowed"),
    "unknown part": ({"type": "input_file", "file": {"data": "x"}}, "input_file"),
    "missing field": ({"type": "image_url"}, "image_url"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_media_is_a_400_naming_it(served, case):
    part, message = BAD[case]
    status, body = chat(served[0], [{"type": "text", "text": "hi"}, part])
    assert status == 400, body
    assert message in body["error"]["message"]
    if case not in ("unknown part", "missing field"):  # the protocol's own 400s name the field path
        assert "message 0 content part 1" in body["error"]["message"]


def test_live_session_steps_take_audio_and_video(served):
    server = served[0]
    status, body = http_json(server.url + "/v1/live/sessions", {"system": "You watch a live stream."})
    assert status == 200, body
    step = f"{server.url}/v1/live/sessions/{body['id']}/step"
    events = [{"type": "comment", "user": "amy", "text": "price?"},
              {"type": "audio", "data": wav_b64(0.5)},
              {"type": "video", "frames": [image_url(1, (32, 32)), image_url(2, (32, 32))]}]
    status, first = http_json(step, {"events": events})
    assert status == 200 and first["kind"] in ("OBS", "MEM", "ANS"), first
    status, second = http_json(step, {"events": events[:1] + [{"type": "audio", "path": "/etc/hostname"}]})
    assert status == 400 and "outside the allowed media directory" in second["error"]["message"], second
    status, third = http_json(step, {"events": [{"type": "audio", "data": wav_b64(0.5, seed=1)}]})
    assert status == 200 and third["metrics"]["cached_prompt_tokens"] >= first["metrics"]["prompt_tokens"] - 16


def test_media_reach_engine_core_processes(served):
    """AsyncLLM(engine_core="process"): media are processed in the caller's process and their tensors pickled to the
    core, which encodes them; the tokens are the in-thread engine's."""
    import asyncio

    from livemoe.engine.multimodal.chat import media_chat_prompt

    _, path, _, options = served
    parts = [{"type": "input_audio", "input_audio": {"data": wav_b64(0.8, seed=5)}},
             {"type": "image_url", "image_url": {"url": image_url(6)}}, {"type": "text", "text": "so?"}]
    params = SamplingParams(temperature=0, max_tokens=5)
    llm = LLM(path, **options)
    want = llm.chat([{"role": "user", "content": parts}], params)[0].outputs[0].token_ids
    engine = AsyncLLM(path, engine_core="process", use_tqdm=False, **options)
    try:
        prompt = media_chat_prompt(engine.tokenizer, [{"role": "user", "content": parts}], engine.media_processor)

        async def run():
            ids = []
            async for delta in engine.generate(prompt, params):
                ids += delta.token_ids
            return ids

        assert asyncio.run(run()) == want
    finally:
        engine.shutdown()

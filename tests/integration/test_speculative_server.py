"""The server started as users start it, with `--speculative-config`: completions equal the Python API's without
speculation, and /metrics counts the drafts and the acceptance length."""
import json

import torch

from fixtures import http_json, require_server_extras
from livemoe.engine.llm import LLM
from livemoe.engine.sampling.params import SamplingParams
from tiny_tokenizer import make_text_checkpoint


def test_server_with_speculative_config(tmp_path):
    openai = require_server_extras()
    import urllib.request

    from livemoe.engine.server import ServerProcess

    path, _ = make_text_checkpoint(tmp_path / "ckpt", moe=True)
    prompts = [f"ab ab ab ab {i} cd cd cd" for i in range(3)]
    expected = LLM(path, dtype=torch.float32, device="cpu", block_size=16, num_kv_blocks=64, use_tqdm=False).generate(
        prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    server = ServerProcess(path, "tiny", ["--num-kv-blocks", "64", "--block-size", "16", "--threads", "1",
                                          "--device", "cpu", "--dtype", "float32",
                                          "--speculative-config", json.dumps(spec)]).start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        for prompt, ref in zip(prompts, expected):
            out = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert out.choices[0].text == ref.text
        status, _ = http_json(server.url + "/health")
        assert status == 200
        with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
            metrics = r.read().decode()
        values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
                  if line and not line.startswith("#")}
        assert values['livemoe_spec_accepted_tokens_total{replica="0"}'] > 0
        assert values["livemoe_spec_acceptance_length_count"] == len(prompts)
    finally:
        server.stop()

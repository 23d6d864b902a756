"""Teachers: `sample(records, k, temperature) -> [[completion] * k] * len(records)`.

  scripted       the synthetic world's offline teacher (livemoe.train.synthetic.teacher)
  a directory    any checkpoint the engine loads, sampled with the engine decoder
  http(s)://...  any OpenAI-compatible chat endpoint (concurrency cap, retries with backoff, timeouts)
A completion is `<think>T</think>R`; an endpoint that returns its reasoning separately
(`reasoning_content`, as DeepSeek-R1's API does) is put back into that shape.
"""
import os

from livemoe.train.data import build_messages, build_prompt
from livemoe.train.endpoint import ChatEndpoint
from livemoe.train.synthetic.teacher import ScriptedTeacher, TeacherRates


class EngineTeacher:
    def __init__(self, path: str, max_new_tokens: int = 384, seed: int = 0, device=None, progress: bool = True,
                 speculative_config: str | None = None):
        from livemoe.engine.llm import LLM

        self.llm = LLM(path, device=device, seed=seed, use_tqdm=progress, speculative_config=speculative_config)
        self.max_new_tokens, self.seed = max_new_tokens, seed

    def sample(self, records: list, k: int = 4, temperature: float = 0.7) -> list:
        from livemoe.engine.sampling.params import SamplingParams

        params = SamplingParams(temperature=temperature, n=k, max_tokens=self.max_new_tokens, seed=self.seed)
        prompts = [build_prompt(r, self.llm.tokenizer) for r in records]
        outs = self.llm.generate(prompts, params)
        self.llm.release_kv_cache()
        return [[c.text for c in o.outputs] for o in outs]


class EndpointTeacher:
    def __init__(self, endpoint: ChatEndpoint):
        self.endpoint = endpoint
        endpoint.check()  # fail fast, naming the URL

    def sample(self, records: list, k: int = 4, temperature: float = 0.7) -> list:
        return self.endpoint.chat_many([build_messages(r) for r in records], temperature=temperature, n=k)


def make_teacher(cfg):
    """The teacher named by an RFTConfig."""
    if cfg.teacher == "scripted":
        rates = TeacherRates(cfg.wrong_link_rate, cfg.deflect_rate, cfg.verbose_rate)
        return ScriptedTeacher(rates, seed=cfg.seed)
    if cfg.teacher.startswith(("http://", "https://")):
        return EndpointTeacher(ChatEndpoint(cfg.teacher, model=cfg.teacher_model,
                                            api_key=os.environ.get(cfg.teacher_api_key_env),
                                            concurrency=cfg.teacher_concurrency, retries=cfg.teacher_retries,
                                            timeout_s=cfg.teacher_timeout_s, max_tokens=cfg.teacher_max_new_tokens))
    return EngineTeacher(cfg.teacher, cfg.teacher_max_new_tokens, cfg.seed,
                         device=None if cfg.device == "auto" else cfg.device, progress=cfg.progress,
                         speculative_config=cfg.teacher_speculative_config or None)

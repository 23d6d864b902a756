"""LLM: the decoder's API for one process. `generate` and `chat` for offline batches, `stream` for one request's
deltas; `add_request` / `step` / `abort` for callers that drive the loop themselves (the GRPO trainer).

    llm = LLM("path/to/checkpoint", max_num_seqs=64)
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))

In-process use by a trainer (no weight copy): `LLM.from_model(model, tokenizer)`. The KV cache can be
released around a training update (`release_kv_cache()`, or `with llm.kv_cache_released(): ...`) and
comes back at the next step. The engine sets torch's CPU thread count (EngineConfig.threads) when it is built.

LLM tokenizes and hands requests to its EngineCore (`llm.core`: livemoe/engine/decoder/engine_core.py), which
validates them, steps, handles the faults of single requests (`take_failed()`) and owns the weights and the KV
cache; the methods below that only pass through say so.
"""
import torch

from livemoe.engine.decoder.config import DEFAULT_THREADS, EngineConfig, apply_threads
from livemoe.engine.decoder.engine_core import EngineCore
from livemoe.engine.decoder.input_processor import tokenize_prompt
from livemoe.engine.errors import EngineConfigError, RequestError
from livemoe.engine.model.loader import load_model, load_tokenizer
from livemoe.engine.outputs import RequestOutput
from livemoe.engine.sampling.params import SamplingParams
from livemoe.engine.multimodal.chat import media_chat_prompt
from livemoe.engine.multimodal.media import MultimodalPrompt, split_media
from livemoe.engine.multimodal.processor import MediaProcessor
from livemoe.engine.text.streaming import stream
from livemoe.engine.text.tool_parser import parse_tool_calls, tool_choice_constraint


class LLM:
    def __init__(self, model_path: str, dtype=None, device=None, text_in_flight: bool = True, **options):
        """options: EngineConfig's fields. text_in_flight=False: outputs in flight carry token ids only (an engine
        core whose client detokenizes)."""
        config = EngineConfig.from_options(**options)  # bad options fail before the weights load
        self.threads = DEFAULT_THREADS if config.threads is None else config.threads
        apply_threads(self.threads)  # before loading: the loader's copies run on them too
        workers = None
        if config.tensor_parallel_size == 1:
            model = load_model(model_path, dtype=dtype, device=device)
        else:
            from livemoe.engine.decoder.workers import start_tensor_parallel  # one process: never loaded

            model, workers = start_tensor_parallel(model_path, dtype, device, config)
        try:
            self.core = EngineCore(model, load_tokenizer(model_path), config, workers, text_in_flight)
        except BaseException:
            if workers is not None:
                workers.close()
            raise

    @classmethod
    def from_model(cls, model: torch.nn.Module, tokenizer=None, **options) -> "LLM":
        """An engine over an existing module (shared, not copied: the trainer's updates are seen)."""
        config = EngineConfig.from_options(**options)
        if config.tensor_parallel_size > 1:
            raise EngineConfigError(f"EngineConfig: tensor_parallel_size={config.tensor_parallel_size} needs "
                                    f"LLM(model_path, ...): each rank loads its own shard; LLM.from_model shares "
                                    f"one module of this process")
        llm = cls.__new__(cls)
        llm.threads = config.threads or 0  # None: the caller's (a trainer's) setting stays
        apply_threads(llm.threads)
        llm.core = EngineCore(model, tokenizer, config)
        return llm

    # what callers read of the engine
    @property
    def model(self) -> torch.nn.Module:
        return self.core.model

    @property
    def media_processor(self) -> MediaProcessor | None:
        """Turns media into what the model's encoders take (None: a text model)."""
        omni = self.core.model.config.omni
        if omni is None:
            return None
        if getattr(self, "_media_processor", None) is None:
            self._media_processor = MediaProcessor(omni, self.config)
        return self._media_processor

    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def config(self) -> EngineConfig:
        return self.core.config

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def eos_token_ids(self) -> set[int]:
        return self.core.eos_token_ids

    @property
    def sleep_level(self) -> int:
        """0 awake; 1 the KV cache is freed; 2 also the weights moved to the host (sleep())."""
        return self.core.sleep_level

    # -- requests -----------------------------------------------------------------------------------

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queues a request (validated first: a bad one raises RequestError and changes nothing); its id."""
        params = SamplingParams() if params is None else params
        request_id = self.core.new_request_id() if request_id is None else str(request_id)
        prompt, media = split_media(prompt)
        text, ids = tokenize_prompt(self.tokenizer, prompt)
        self.core.add_request(request_id, text, ids, params, media=media)
        return request_id

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """EngineCore.step: one scheduled step's outputs."""
        return self.core.step(finished_only)

    def abort(self, request_id: str) -> bool:
        """Stops a request and frees its blocks; False if it is not in flight."""
        return self.core.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def take_failed(self) -> dict[str, str]:
        """EngineCore.take_failed: the requests the engine ended since the last call, and why."""
        return self.core.take_failed()

    def compile_grammar(self, spec, field: str = "structured"):
        """InputProcessor.compile_grammar: compiles (and caches) an output constraint; RequestError if bad."""
        return self.core.input_processor.compile_grammar(spec, field)

    # -- offline API --------------------------------------------------------------------------------

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """prompts: a string, a list of strings, a list of token ids, or a list of token-id lists (or
        MultimodalPrompts: ids with media, as chat() makes them from content parts).
        Returns one finished RequestOutput per prompt, in input order. Every prompt is validated before
        any is queued, so a bad one raises RequestError and leaves the engine as it was."""
        if isinstance(prompts, (str, MultimodalPrompt)) or (isinstance(prompts, (list, tuple)) and prompts
                                                            and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = SamplingParams() if params is None else params
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise RequestError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        core = self.core
        split = [split_media(prompt) for prompt in prompts]
        tokenized = [tokenize_prompt(self.tokenizer, prompt) for prompt, _ in split]
        for (_, prompt_ids), (_, media), p in zip(tokenized, split, params):  # all validated before any is queued
            core.validate(prompt_ids, p, media)
        ids = [core.new_request_id() for _ in prompts]
        for rid, (text, prompt_ids), (_, media), p in zip(ids, tokenized, split, params):
            core.add_request(rid, text, prompt_ids, p, validated=True, media=media)
        show = self.config.use_tqdm if use_tqdm is None else use_tqdm
        bar = None
        if show and len(prompts) > 16:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(prompts), desc="generate", unit="req")
        try:
            results = core.run_until_finished(ids, on_finished=None if bar is None else lambda _: bar.update(1))
        except BaseException:
            for rid in ids:
                core.abort(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]

    def stream(self, prompt, params: SamplingParams | None = None, request_id: str | None = None):
        """Yields livemoe.engine.text.streaming.StreamDelta's of one request as its tokens are made (see there)."""
        return stream(self, prompt, params, request_id)

    def chat(self, conversations, params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool | None = None, tools: list[dict] | None = None, tool_choice: str = "auto",
             special_tokens_in_content: bool = False) -> list[RequestOutput]:
        """conversations: one list of {"role", "content"} messages, or a list of them; the checkpoint's
        chat template (with the generation prompt) makes each prompt. Special tokens written inside a
        content stay text unless special_tokens_in_content (see livemoe.engine.text.prompts).

        tools: OpenAI-style [{"type": "function", "function": {"name", "parameters", ...}}], given to the
        template; each completion's `tool_calls` then holds the Qwen3 / Hermes calls parsed from its text
        ([{"name", "arguments": JSON text}]). tool_choice: "auto" (the model decides), "required" or a
        function's name (the grammar makes the output one call, whose arguments match the parameters)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        if tools:
            params = tool_choice_constraint(tools, tool_choice, params)
        elif tool_choice != "auto":
            raise RequestError(f"chat: tool_choice {tool_choice!r} needs tools")
        prompts = [media_chat_prompt(self.tokenizer, c, self.media_processor, "/", special_tokens_in_content,
                                     tools or None) for c in conversations]
        outputs = self.generate(prompts, params, use_tqdm)
        if tools:
            for out in outputs:
                for c in out.outputs:
                    c.tool_calls = parse_tool_calls(c.text)[1]
        return outputs

    # -- weights, memory and the KV cache: EngineCore's (rollout servers for RL: livemoe/engine/core) --------

    def update_weights(self, named_tensors, in_flight: str = "finish", weight_version: int | None = None) -> int:
        """EngineCore.update_weights: (name, tensor) pairs copied in place; the number copied."""
        return self.core.update_weights(named_tensors, in_flight, weight_version)

    def update_weights_from_disk(self, model_path: str, in_flight: str = "finish",
                                 weight_version: int | None = None) -> int:
        """EngineCore.update_weights_from_disk: every tensor of a checkpoint of the same architecture."""
        return self.core.update_weights_from_disk(model_path, in_flight, weight_version)

    def sleep(self, level: int = 1, in_flight: str = "abort") -> None:
        """EngineCore.sleep: frees the KV cache (level 2: and moves the weights to the host)."""
        self.core.sleep(level, in_flight)

    def wake_up(self) -> None:
        self.core.wake_up()

    def release_kv_cache(self) -> None:
        """Frees the KV cache memory (e.g. for a training update); the next request brings it back."""
        self.core.release_kv_cache()

    def reserve_kv_cache(self, num_blocks: int | None = None) -> None:
        self.core.reserve_kv_cache(num_blocks)

    def kv_cache_released(self):
        """A context manager: the KV cache is freed inside it."""
        return self.core.kv_cache_released()

    def reset_prefix_cache(self) -> None:
        self.core.reset_prefix_cache()

    def stats(self) -> dict:
        return self.core.stats()

    def close(self) -> None:
        """Aborts what is in flight, frees the KV cache and CUDA graphs, stops the tensor-parallel workers (if any);
        new requests are refused after it (EngineDeadError)."""
        if getattr(self, "core", None) is not None:
            self.core.close()

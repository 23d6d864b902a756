"""LLM: the decoder's API. `generate` for offline batches; `add_request` / `step` / `abort` for callers
that drive the loop themselves (the GRPO trainer, the streaming server).

    llm = LLM("path/to/checkpoint", max_num_seqs=64)
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))

In-process use by a trainer (no weight copy): `LLM.from_model(model, tokenizer)`. The KV cache can be
released around a training update (`release_kv_cache()`, or `with llm.kv_cache_released(): ...`) and
comes back at the next step. Cached prefixes are dropped automatically when the weights change (any
in-place update of a parameter bumps its version counter, which each step checks).

A step that fails because of one request (its row gives non-finite logits, or cannot be sampled or
detokenized) ends that request alone (`take_failed()` says which, and why); the others go on. The
engine sets torch's CPU thread count (EngineConfig.threads) when it is built.
"""
import contextlib
import logging
import math
import threading
import time
import weakref
from itertools import count

import torch

from livemoe.engine.model import flops
from livemoe.engine.decoder.block_manager import BlockManager
from livemoe.engine.text.detokenizer import IncrementalDetokenizer
from livemoe.engine.decoder.config import EngineConfig
from livemoe.engine.errors import EngineConfigError
from livemoe.engine.errors import RequestFailedError
from livemoe.engine.sampling.params import check_vocab
from livemoe.engine.decoder.model_runner import ModelRunner
from livemoe.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from livemoe.engine.text.prompts import chat_prompt_ids, encode_text
from livemoe.engine.sampling.sampler import SampleResult, Sampler
from livemoe.engine.sampling.params import SamplingParams
from livemoe.engine.errors import RequestError
from livemoe.engine.decoder.scheduler import Scheduler
from livemoe.engine.decoder.sequence import Sequence

log = logging.getLogger(__name__)

IN_FLIGHT_MODES = ("finish", "abort")  # update_weights / sleep: what happens to requests in flight
DEFAULT_THREADS = 1  # CPU decode of small models: 0.8-1.2 ms/step with 1 thread, 7-30 with 2 (shared 2-core host)


class Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                 seqs: list[Sequence]):
        self.request_id, self.prompt, self.prompt_ids, self.params, self.seqs = request_id, prompt, prompt_ids, params, seqs
        self.arrival_time = seqs[0].arrival_time
        self.finish_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class LLM:
    def __init__(self, model_path: str, dtype=None, device=None, **options):
        from livemoe.engine.model.loader import load_model, load_tokenizer

        config = EngineConfig.from_options(**options)  # bad options fail before the weights load
        self.threads = DEFAULT_THREADS if config.threads is None else config.threads
        apply_threads(self.threads)  # before loading: the loader's copies run on them too
        self.workers = None
        if config.tensor_parallel_size == 1:
            model = load_model(model_path, dtype=dtype, device=device)
        else:
            model = self._start_workers(model_path, dtype, device, config)
        try:
            self._setup(model, load_tokenizer(model_path), config)
        except BaseException:
            self.close()
            raise

    def _start_workers(self, model_path: str, dtype, device, config: EngineConfig) -> torch.nn.Module:
        """Rank 0 of tensor_parallel_size ranks: checks what it can, starts the workers, loads its own
        shard while they load theirs (livemoe/engine/decoder/workers.py)."""
        import torch.distributed as dist

        from livemoe.engine.model.config import load_config
        from livemoe.engine.model.loader import resolve_device
        from livemoe.engine.decoder.workers import WorkerGroup, check_parallel_sizes, load_rank_model, rank_device

        mc = load_config(model_path)
        device = resolve_device(device)
        check_parallel_sizes(mc, config.tensor_parallel_size, config.enable_expert_parallel, device)
        self.workers = WorkerGroup(model_path, dtype, device, config, max_model_len(config, mc),
                                   logging.getLogger().level)
        # LLM.close(), garbage collection or interpreter exit: the workers stop (the callback holds no LLM)
        self._finalizer = weakref.finalize(self, self.workers.close)
        try:
            model = load_rank_model(model_path, dtype, rank_device(device, 0), 0, config.tensor_parallel_size,
                                    dist.group.WORLD, config.enable_expert_parallel)
            self.workers.wait_ready()
        except BaseException:
            self.close()
            raise
        return model

    def close(self) -> None:
        """Stops the tensor-parallel worker processes (if any); the engine cannot step after it."""
        if getattr(self, "workers", None) is not None:
            self._finalizer()

    def refuse_tensor_parallel(self, what: str, instead: str = "restart the engine on the new checkpoint") -> None:
        """What a multi-process engine does not do: a clear error naming it."""
        n = self.config.tensor_parallel_size
        if n > 1:
            raise RuntimeError(f"{what} is not supported with tensor_parallel_size={n} (the weights live in {n} "
                               f"processes): {instead}")

    @classmethod
    def from_model(cls, model: torch.nn.Module, tokenizer=None, **options) -> "LLM":
        """An engine over an existing module (shared, not copied: the trainer's updates are seen)."""
        llm = cls.__new__(cls)
        config = EngineConfig.from_options(**options)
        if config.tensor_parallel_size > 1:
            raise EngineConfigError(f"EngineConfig: tensor_parallel_size={config.tensor_parallel_size} needs "
                                    f"LLM(model_path, ...): each rank loads its own shard; LLM.from_model shares "
                                    f"one module of this process")
        llm.workers = None
        llm.threads = config.threads or 0  # None: the caller's (a trainer's) setting stays
        apply_threads(llm.threads)
        llm._setup(model, tokenizer, config)
        return llm

    def _setup(self, model, tokenizer, config: EngineConfig):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        mc = model.config
        self.max_model_len = max_model_len(config, mc)
        self.vocab_size = mc.vocab_size
        self.eos_token_ids = set(mc.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        if self.workers is None:
            self.runner = ModelRunner(model, config, self.max_model_len)
        else:
            from livemoe.engine.decoder.workers import DriverRunner

            self.runner = DriverRunner(model, config, self.max_model_len, self.workers)
        self.sampler = Sampler(config.seed, self.eos_token_ids)
        self._grammar_compiler = None  # livemoe.engine.sampling.structured.GrammarCompiler, made at the first structured request
        self._grammar_lock = threading.Lock()
        self.block_manager: BlockManager | None = None
        self.scheduler: Scheduler | None = None
        self.requests: dict[str, Request] = {}
        self._pending: list[RequestOutput] = []  # finished outside the caller's generate(): next step() returns them
        self._ids = count()
        self._params = list(model.parameters())
        self._weights_version = self._param_version()
        self._flops_per_token = flops.decode_flops(model.config, 1)
        self.num_steps = 0
        self.num_prefix_cache_resets = 0
        self.failed: dict[str, str] = {}  # request id -> why the engine ended it (see take_failed)
        self.num_failed_requests = 0
        self.num_nonfinite_logits_steps = 0
        self.last_logits_finite = True  # whether the last step that sampled got finite logits on every row
        self.reserve_kv_cache()

    # -- KV cache lifetime --------------------------------------------------------------------------

    def reserve_kv_cache(self, num_blocks: int | None = None) -> None:
        """Allocates the KV cache (the configured budget unless num_blocks is given)."""
        if self.runner.kv_cache is not None:
            return
        num_blocks = num_blocks or self.runner.budget_num_blocks()
        self.runner.allocate_kv_cache(num_blocks)
        self.block_manager = BlockManager(num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, self.config.max_num_seqs, self.config.max_num_batched_tokens,
                                   self.config.max_running_seqs_per_request)
        self._weights_version = self._param_version()

    def release_kv_cache(self) -> None:
        """Frees the KV cache memory (e.g. for a training update); the next request brings it back."""
        if self.requests:
            raise RuntimeError(f"release_kv_cache: {len(self.requests)} request(s) in flight; finish or abort them")
        self.runner.free_kv_cache()
        self.block_manager = self.scheduler = None

    @contextlib.contextmanager
    def kv_cache_released(self):
        self.release_kv_cache()
        try:
            yield
        finally:
            self.reserve_kv_cache()

    def reset_prefix_cache(self) -> None:
        if self.block_manager is not None:
            self.block_manager.reset_prefix_cache()
        self.num_prefix_cache_resets += 1

    def _param_version(self) -> int:
        return sum(p._version for p in self._params)

    # -- requests -----------------------------------------------------------------------------------

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("a text prompt needs a tokenizer, and this checkpoint has none; pass token ids")
            return prompt, encode_text(self.tokenizer, prompt)
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        if isinstance(prompt, torch.Tensor) and prompt.dim() == 1:
            return None, prompt.tolist()
        raise RequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise RequestError("the prompt is empty")
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"prompt token ids must be integers in the vocabulary [0, {self.vocab_size}); "
                               f"got {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(ids)} tokens; the model's context is {self.max_model_len} "
                               f"(max_model_len), which leaves no room to generate")
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be SamplingParams, got {type(params).__name__}")
        bad_stop = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stop:
            raise RequestError(f"stop_token_ids out of the vocabulary [0, {self.vocab_size}): {bad_stop}")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer, and this checkpoint has none; use stop_token_ids")
        check_vocab(params, self.vocab_size)
        if params.structured is not None:
            self.compile_grammar(params.structured)  # a bad schema fails here; the result is cached
        longest = min(len(ids) + params.max_tokens, self.max_model_len)
        capacity = self.block_manager.num_blocks * self.config.block_size
        if longest > capacity:
            raise RequestError(f"the request needs up to {longest} tokens of KV cache but the cache holds only "
                               f"{capacity}; raise the KV budget or lower max_tokens")

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queues a request (validated first: a bad one raises RequestError and changes nothing)."""
        params = SamplingParams() if params is None else params
        if self.scheduler is None:
            self.reserve_kv_cache()
        request_id = self._new_request_id() if request_id is None else str(request_id)
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in flight")
        text, ids = self._tokenize(prompt)
        self._validate(ids, params)
        self._queue(request_id, text, ids, params)
        return request_id

    def _new_request_id(self) -> str:
        """The next counter value that no request in flight uses (a caller may have chosen ids like "3")."""
        while (rid := str(next(self._ids))) in self.requests:
            pass
        return rid

    def _queue(self, request_id: str, text: str | None, ids: list[int], params: SamplingParams) -> None:
        """Queues a tokenized, validated request."""
        now = time.perf_counter()
        seqs = [Sequence(ids, params, request_id, i, None if params.seed is None else params.seed + i, now)
                for i in range(params.n)]
        if params.structured is not None:
            for seq in seqs:
                seq.grammar = self._grammars().state(params.structured, ids)
        self.requests[request_id] = Request(request_id, text, ids, params, seqs)
        for seq in seqs:
            self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Stops a request and frees its blocks; False if it is not in flight."""
        req = self.requests.pop(str(request_id), None)
        if req is None:
            return False
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- structured output ------------------------------------------------------------------------

    def _grammars(self):
        with self._grammar_lock:  # the server's worker threads and the engine thread may both ask first
            if self._grammar_compiler is None:
                from livemoe.engine.sampling.structured import GrammarCompiler

                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._grammar_compiler

    def compile_grammar(self, spec, field: str = "structured"):
        """The compiled grammar of a livemoe.engine.sampling.structured.StructuredOutput (cached by the spec): AsyncLLM
        calls it in a worker thread before a request reaches the engine loop, which then only looks it up.
        A bad spec raises RequestError naming `field`."""
        return self._grammars().compile(spec, field)

    # -- the loop -----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one scheduled step; returns an output for each request that got tokens or finished
        (cumulative; `finished` says whether it is the last)."""
        return self._step(finished_only=False)

    def _step(self, finished_only: bool) -> list[RequestOutput]:
        pending, self._pending = self._pending, []
        if not self.requests:
            return pending
        version = self._param_version()
        if version != self._weights_version:
            self._weights_version = version
            self.reset_prefix_cache()
        out = self.scheduler.schedule()
        if not out.seqs:
            raise RuntimeError("scheduler found nothing to run although requests are waiting (KV cache too small?)")
        was_training = self.model.training
        if was_training:  # a trainer's module: decode in eval mode, hand it back as it came
            self.model.eval()
        try:
            logits, sampling = self.runner.run(out)
        finally:
            if was_training:
                self.model.train()
        self.scheduler.update_computed(out)
        self.num_steps += 1
        seqs = self._drop_nonfinite_rows([out.seqs[i] for i in sampling], logits)
        for seq in seqs:
            if seq.generator is None and seq.seed is not None:
                try:
                    seq.generator = torch.Generator(device=logits.device).manual_seed(seq.seed)
                except Exception as e:  # noqa: BLE001 (one request's seed: fail it alone)
                    self._fail(seq.request_id, f"its generator could not be seeded with {seq.seed}: {e!r}")
        seqs, result = self._sample(logits, seqs)
        now = time.perf_counter()
        # the requests to report: every sampled one, or (generate) only those a finishing seq may complete
        touched: dict[str, Request] = {}
        for seq, token, lp in zip(seqs, result.token_ids, result.logprobs):
            if seq.request_id not in self.requests:
                continue  # failed earlier in this step (another of its n samples)
            seq.append_token(token, now)
            if seq.grammar is not None:
                seq.grammar.advance([token])
            if lp is not None:
                seq.logprobs.append(lp)
            try:
                self._check_stop(seq)
            except Exception as e:  # noqa: BLE001 (e.g. its stop strings could not be detokenized)
                self._fail(seq.request_id, f"checking its stop conditions failed: {e!r}")
                continue
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
                touched[seq.request_id] = self.requests[seq.request_id]
            elif not finished_only:
                touched[seq.request_id] = self.requests[seq.request_id]
        outputs = pending
        for req in touched.values():
            if req.finished:
                req.finish_time = now
                del self.requests[req.request_id]
                outputs.append(self._output(req))
            elif not finished_only:
                outputs.append(self._output(req))
        return outputs

    # -- faults of one request ----------------------------------------------------------------------

    def _drop_nonfinite_rows(self, seqs: list[Sequence], logits: torch.Tensor) -> list[Sequence]:
        """Fails the requests whose logits hold NaN or +inf (sampling them would pick garbage) and counts
        the step (`stats()["last_logits_finite"]`: /health reports a model that produces them). A max
        propagates NaN and shows +inf: one over the batch on the hot path (~2 us), per row only if it fails."""
        if not seqs:
            return seqs
        self.last_logits_finite = math.isfinite(logits.amax().item())
        if self.last_logits_finite:
            return seqs
        bad = (~torch.isfinite(logits.amax(-1))).nonzero()[:, 0].tolist()
        self.num_nonfinite_logits_steps += 1
        for i in bad:
            self._fail(seqs[i].request_id, "the model produced non-finite logits (NaN or inf) for it")
        log.error("step %d: the model produced non-finite logits for %d of %d rows", self.num_steps, len(bad),
                  len(seqs))
        return [seq for seq in seqs if seq.request_id in self.requests]

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[Sequence], SampleResult]:
        """The batch sampled at once; if that fails, row by row, so only the rows that fail lose their request."""
        rows = [i for i, seq in enumerate(seqs) if seq.request_id in self.requests]
        if len(rows) < len(seqs):
            seqs, logits = [seqs[i] for i in rows], logits[rows]
        try:
            return seqs, self.sampler(logits, [s.params for s in seqs], [s.generator for s in seqs], seqs)
        except Exception:  # noqa: BLE001
            log.exception("sampling a batch of %d rows failed; sampling them one by one", len(seqs))
        kept, tokens, logprobs = [], [], []
        for i, seq in enumerate(seqs):
            if seq.request_id not in self.requests:
                continue
            try:
                r = self.sampler(logits[i:i + 1], [seq.params], [seq.generator], [seq])
            except Exception as e:  # noqa: BLE001
                self._fail(seq.request_id, f"sampling failed: {e!r}")
                continue
            kept.append(seq)
            tokens += r.token_ids
            logprobs += r.logprobs
        return kept, SampleResult(tokens, logprobs)

    def _fail(self, request_id: str, why: str) -> None:
        if self.abort(request_id):
            log.error("request %s failed: %s", request_id, why)
            self.failed[request_id] = why
            self.num_failed_requests += 1

    def take_failed(self) -> dict[str, str]:
        """The requests the engine ended because of a fault of their own since the last call, and why
        (they get no further output)."""
        failed, self.failed = self.failed, {}
        return failed

    def _check_stop(self, seq: Sequence) -> None:
        p = seq.params
        token = seq.token_ids[-1]
        if not p.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif token in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif p.stop:
            text = self._text_so_far(seq)
            # only a stop string ending in the newest text can be new
            tail_from = max(0, len(seq.text) - max(map(len, p.stop)))
            hits = [(i, s) for s in p.stop if (i := text.find(s, tail_from)) >= 0] \
                if seq.num_output_tokens >= p.min_tokens else []
            seq.text = text
            if hits:
                i, s = min(hits)
                seq.text = text[:i]
                seq.finish_reason, seq.stop_reason = "stop", s
        if seq.finish_reason is None and (seq.num_output_tokens >= p.max_tokens or len(seq) >= self.max_model_len):
            seq.finish_reason = "length"

    def _decode(self, ids: list[int], params: SamplingParams) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)

    def _text_so_far(self, seq: Sequence) -> str:
        """The complete characters of seq's output so far, decoded incrementally (stop strings and streaming
        callers ask at every step: a step decodes its new tokens, not the whole output again)."""
        det = seq.detokenizer
        if det is None:
            det = seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.params.skip_special_tokens)
        if len(det.ids) < seq.num_output_tokens:
            det.push(seq.token_ids[seq.num_prompt_tokens + len(det.ids):])
        return det.decoded

    def _output(self, req: Request) -> RequestOutput:
        completions = []
        for seq in req.seqs:
            ids = seq.output_token_ids
            if seq.stop_reason is not None and isinstance(seq.stop_reason, str):
                text = seq.text
            elif seq.finish_reason is None:  # in flight (step()'s cumulative outputs)
                text = self._text_so_far(seq) if self.tokenizer is not None else ""
            else:
                ended_by_token = seq.finish_reason == "stop" and isinstance(seq.stop_reason, int)
                text = self._decode(ids[:-1] if ended_by_token else ids, req.params)
            completions.append(CompletionOutput(seq.index, text, list(ids), seq.finish_reason, seq.stop_reason,
                                                list(seq.logprobs) if req.params.logprobs is not None else None))
        return RequestOutput(req.request_id, req.prompt, req.prompt_ids, completions, req.finished, self._metrics(req))

    def _metrics(self, req: Request) -> RequestMetrics:
        firsts = [s.first_token_time for s in req.seqs if s.first_token_time is not None]
        n_out = sum(s.num_output_tokens for s in req.seqs)
        m = RequestMetrics(arrival_time=req.arrival_time, finish_time=req.finish_time,
                           num_prompt_tokens=len(req.prompt_ids), num_output_tokens=n_out,
                           num_cached_tokens=max(s.num_cached_prompt_tokens for s in req.seqs),
                           num_preemptions=sum(s.num_preemptions for s in req.seqs),
                           decode_flops=self._flops_per_token * n_out)
        if firsts:
            m.first_token_time = min(firsts)
            m.ttft = m.first_token_time - req.arrival_time
            spans = [(s.last_token_time - s.first_token_time, s.num_output_tokens - 1) for s in req.seqs
                     if s.first_token_time is not None and s.num_output_tokens > 1]
            if spans:
                m.tpot = sum(t for t, _ in spans) / sum(n for _, n in spans)
        return m

    # -- offline API --------------------------------------------------------------------------------

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """prompts: a string, a list of strings, a list of token ids, or a list of token-id lists.
        Returns one finished RequestOutput per prompt, in input order. Every prompt is validated before
        any is queued, so a bad one raises RequestError and leaves the engine as it was."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = SamplingParams() if params is None else params
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise RequestError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        if self.scheduler is None:
            self.reserve_kv_cache()
        tokenized = [self._tokenize(prompt) for prompt in prompts]  # all validated before any is queued
        for (_, prompt_ids), p in zip(tokenized, params):
            self._validate(prompt_ids, p)
        ids = [self._new_request_id() for _ in prompts]
        for rid, (text, prompt_ids), p in zip(ids, tokenized, params):
            self._queue(rid, text, prompt_ids, p)
        mine = set(ids)
        results: dict[str, RequestOutput] = {}
        show = self.config.use_tqdm if use_tqdm is None else use_tqdm
        bar = None
        if show and len(prompts) > 16:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(prompts), desc="generate", unit="req")
        try:
            while len(results) < len(ids):
                for o in self._step(finished_only=True):
                    if o.request_id in mine:
                        if o.finished:
                            results[o.request_id] = o
                            if bar is not None:
                                bar.update(1)
                    elif o.finished:
                        self._pending.append(o)  # someone else's: the next step() returns it
                mine_failed = [f"{rid}: {self.failed.pop(rid)}" for rid in ids if rid in self.failed]
                if mine_failed:
                    raise RequestFailedError("the engine ended request(s) " + "; ".join(mine_failed))
        except BaseException:
            for rid in ids:
                self.abort(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]

    def stream(self, prompt, params: SamplingParams | None = None, request_id: str | None = None):
        """Yields livemoe.engine.text.streaming.StreamDelta's of one request as its tokens are made (see there)."""
        from livemoe.engine.text.streaming import stream  # streaming builds on this module

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
            from livemoe.engine.text.tool_parser import tool_choice_constraint

            params = tool_choice_constraint(tools, tool_choice, params)
        elif tool_choice != "auto":
            raise RequestError(f"chat: tool_choice {tool_choice!r} needs tools")
        prompts = [chat_prompt_ids(self.tokenizer, c, special_tokens_in_content, tools=tools or None)
                   for c in conversations]
        outputs = self.generate(prompts, params, use_tqdm)
        if tools:
            from livemoe.engine.text.tool_parser import parse_tool_calls

            for out in outputs:
                for c in out.outputs:
                    c.tool_calls = parse_tool_calls(c.text)[1]
        return outputs

    # -- weights and memory (rollout servers for RL: livemoe/engine/core) ----------------------------------

    def _settle_in_flight(self, in_flight: str, why: str) -> None:
        """Requests in flight before the weights change: "finish" runs them to the end on the old weights
        (their outputs are kept for the next step()), "abort" ends each (take_failed() says why)."""
        if in_flight not in IN_FLIGHT_MODES:
            raise ValueError(f"in_flight must be one of {IN_FLIGHT_MODES}, got {in_flight!r}")
        if in_flight == "abort":
            for rid in list(self.requests):
                self._fail(rid, f"aborted: {why}")
            return
        finished = []
        while self.requests:
            finished += [o for o in self.step() if o.finished]
        self._pending += finished

    def update_weights(self, named_tensors, in_flight: str = "finish") -> int:
        """Copies (name, tensor) pairs into the loaded parameters in place (hub or engine names, any
        subset; checked whole before the first copy: CheckpointError and the old weights stay), then
        drops the cached prefixes. Returns the number of tensors copied."""
        from livemoe.engine.model.weights import copy_weights

        self.refuse_tensor_parallel("update_weights")
        named_tensors = list(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
        self._settle_in_flight(in_flight, "the weights were updated")
        return self._weights_changed(copy_weights(self.model, named_tensors))

    def update_weights_from_disk(self, model_path: str, in_flight: str = "finish") -> int:
        """update_weights with every tensor of a checkpoint of the same architecture."""
        from livemoe.engine.model.weights import copy_weights_from_disk

        self.refuse_tensor_parallel("update_weights_from_disk")
        self._settle_in_flight(in_flight, "the weights were updated")
        return self._weights_changed(copy_weights_from_disk(self.model, model_path))

    def _weights_changed(self, count: int) -> int:
        self.reset_prefix_cache()
        self._weights_version = self._param_version()
        return count

    @property
    def sleep_level(self) -> int:
        """0 awake; 1 the KV cache is freed; 2 also the weights moved to the host (sleep())."""
        return getattr(self, "_sleep_level", 0)

    def sleep(self, level: int = 1, in_flight: str = "abort") -> None:
        """Frees the KV cache (level 1) and moves the weights to host memory (level 2; on a CPU device they
        are there already); wake_up() brings them back. Requests in flight end as `in_flight` says."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self.sleep_level:
            raise RuntimeError(f"the engine is asleep already (level {self.sleep_level})")
        if level == 2:
            self.refuse_tensor_parallel("sleep(level=2)", "sleep(level=1) frees every rank's KV cache")
        self._settle_in_flight(in_flight, "the engine was put to sleep")
        self.release_kv_cache()
        if level == 2 and self.runner.device.type != "cpu":
            with torch.no_grad():
                for p in self._params:
                    p.data = p.data.to("cpu", non_blocking=True).pin_memory()
        self._sleep_level = level

    def wake_up(self) -> None:
        if self.sleep_level == 2 and self.runner.device.type != "cpu":
            with torch.no_grad():
                for p in self._params:
                    p.data = p.data.to(self.runner.device, non_blocking=True)
        self._sleep_level = 0
        self.reserve_kv_cache()

    # -- introspection ------------------------------------------------------------------------------

    def stats(self) -> dict:
        bm = self.block_manager
        return dict(
            num_requests=len(self.requests),
            num_running=len(self.scheduler.running) if self.scheduler else 0,
            num_waiting=len(self.scheduler.waiting) if self.scheduler else 0,
            kv_blocks_total=bm.num_blocks if bm else 0,
            kv_blocks_used=bm.num_used_blocks if bm else 0,
            prefix_cache_queries=bm.stats.queries if bm else 0,
            prefix_cache_hits=bm.stats.hits if bm else 0,
            prefix_cache_hit_rate=bm.stats.hit_rate if bm else 0.0,
            recompute_hits=bm.stats.recompute_hits if bm else 0,
            num_preemptions=self.scheduler.num_preemptions if self.scheduler else 0,
            num_eager_fallbacks=self.runner.num_eager_fallbacks,
            num_graph_replays=self.runner.num_graph_replays,
            num_steps=self.num_steps,
            num_failed_requests=self.num_failed_requests,
            num_nonfinite_logits_steps=self.num_nonfinite_logits_steps,
            last_logits_finite=self.last_logits_finite,
            tensor_parallel_size=self.config.tensor_parallel_size,  # the parallel layout (/metrics)
            expert_parallel=self.config.enable_expert_parallel,
        )


def max_model_len(config: EngineConfig, mc) -> int:
    """The context the engine serves: max_model_len, at most the model's max_position_embeddings."""
    limit = mc.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > limit:
        raise RequestError(f"max_model_len {config.max_model_len} exceeds the model's "
                           f"max_position_embeddings {limit}")
    return config.max_model_len or limit


def apply_threads(threads: int) -> None:
    """torch's CPU thread count for the engine (0: leave it). Process-wide; the AsyncLLM engine thread
    calls it again (OpenMP settings are per thread until a thread's first parallel region)."""
    if threads:
        torch.set_num_threads(threads)

"""EngineCore: the step loop. It owns the model runner, the scheduler and block manager, the sampler and the
requests in flight; `add_request` queues a tokenized request (validated here, once), `step` runs one scheduled
forward, samples, and returns the outputs the OutputProcessor assembles. Weight updates, sleep / wake and the KV
cache's lifetime are here too, because they must not overlap a step.

A step that fails because of one request (its row gives non-finite logits, or cannot be sampled or detokenized)
ends that request alone (`take_failed()` says which, and why); the others go on. Cached prefixes are dropped when
the weights change (any in-place update of a parameter bumps its version counter, which each step checks).

About 400 lines, above the ~350 of other modules: the step loop and the operations that must not overlap a step
(weight updates, sleep, the KV cache's lifetime) are one class on purpose, the single owner of the scheduler.
"""
import contextlib
import logging
import math
import operator
import time
import weakref
from itertools import accumulate, count

import torch

from livemoe.engine.decoder.block_manager import BlockManager
from livemoe.engine.decoder.config import EngineConfig, resolve_max_model_len
from livemoe.engine.decoder.input_processor import InputProcessor, check_media
from livemoe.engine.decoder.model_runner import ModelRunner
from livemoe.engine.decoder.output_processor import OutputProcessor
from livemoe.engine.decoder.prompt_logprobs import PromptLogprobs
from livemoe.engine.decoder.scheduler import Scheduler
from livemoe.engine.decoder.sequence import Request, Sequence
from livemoe.engine.decoder.spec.speculator import Speculator
from livemoe.engine.decoder.spec.verify import verified_tokens
from livemoe.engine.errors import EngineConfigError, EngineDeadError, RequestError, RequestFailedError
from livemoe.engine.model import flops
from livemoe.engine.model.qwen3 import Qwen3ForCausalLM
from livemoe.engine.decoder.weight_update import WeightUpdate
from livemoe.engine.multimodal.layout import MediaLayout
from livemoe.engine.outputs import RequestOutput
from livemoe.engine.sampling.params import SamplingParams
from livemoe.engine.sampling.sampler import SampleResult, Sampler, argmax_only, argmax_tokens
from livemoe.kernels.batch_invariant import batch_invariant_mode, unavailable_reason

log = logging.getLogger(__name__)
_VERSION = operator.attrgetter("_version")  # a tensor's in-place update counter

IN_FLIGHT_MODES = ("finish", "abort", "interrupt")  # update_weights / sleep: what happens to requests in flight


class EngineCore:
    def __init__(self, model: Qwen3ForCausalLM, tokenizer, config: EngineConfig, workers=None,
                 text_in_flight: bool = True):
        """workers: the tensor-parallel WorkerGroup when `model` is rank 0's shard (livemoe/engine/decoder/workers.py);
        the core stops them at close(). text_in_flight: see OutputProcessor."""
        self.model, self.tokenizer, self.config, self.workers = model, tokenizer, config, workers
        if workers is not None:  # close(), garbage collection or exit stop them (the callback holds no core)
            self._finalizer = weakref.finalize(self, workers.close)
        mc = model.config
        self.max_model_len = resolve_max_model_len(config, mc)
        if config.batch_invariant and (reason := unavailable_reason(model.lm_head_weight.device)):
            raise EngineConfigError(f"EngineConfig: batch_invariant: {reason}")
        self.vocab_size = mc.vocab_size
        self.eos_token_ids = set(mc.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        if workers is None:
            self.runner = ModelRunner(model, config, self.max_model_len)
        else:
            from livemoe.engine.decoder.workers import DriverRunner  # the worker protocol: only a TP engine loads it

            self.runner = DriverRunner(model, config, self.max_model_len, workers)
        self.sampler = Sampler(config.seed, self.eos_token_ids)
        self.speculator = None if config.speculative is None else Speculator.create(
            config, model, tokenizer, self.max_model_len, self.sampler)
        self.input_processor = InputProcessor(tokenizer, self.vocab_size, self.max_model_len, self.eos_token_ids)
        self.output_processor = OutputProcessor(tokenizer, self.eos_token_ids, self.max_model_len,
                                                flops.decode_flops(mc, 1), text_in_flight)
        self.prompt_logprobs = PromptLogprobs(model)
        self.block_manager: BlockManager | None = None
        self.scheduler: Scheduler | None = None
        self.requests: dict[str, Request] = {}
        self.pending: list[RequestOutput] = []  # finished outside their caller's loop: the next step() returns them
        self._ids = count()
        self._params = list(model.parameters())
        self._weights_version = self._param_version()
        # the label of the loaded weights (a trainer's policy version, given with an update; None: unlabelled), which
        # each sampled token records with return_weight_versions: partial rollouts tell their tokens' versions apart
        self.weight_version: int | None = None
        self.sleep_level = 0  # 0 awake; 1 the KV cache is freed; 2 also the weights moved to the host
        self.num_steps = 0
        self.num_prefix_cache_resets = 0
        self.failed: dict[str, str] = {}  # request id -> why the engine ended it (see take_failed)
        self.num_failed_requests = 0
        self.num_nonfinite_logits_steps = 0
        self.last_logits_finite = True  # whether the last step that sampled got finite logits on every row
        self.closed = False
        self.reserve_kv_cache()

    def close(self) -> None:
        """Aborts the requests in flight, frees the KV cache and the CUDA graphs, and stops the tensor-parallel
        worker processes (if any); new requests are refused after it. Freeing matters on a GPU: the next engine in
        this process sizes its cache from the memory in use (gpu_memory_utilization)."""
        if self.closed:
            return
        self.closed = True
        for rid in list(self.requests):
            self.abort(rid)
        self.block_manager = self.scheduler = None
        if self.workers is not None:
            self._finalizer()  # the workers' caches go with their processes
            ModelRunner.free_kv_cache(self.runner)  # rank 0's own, without a message to the stopped workers
        else:
            self.runner.free_kv_cache()
        self._free_draft_cache()

    def refuse_tensor_parallel(self, what: str, instead: str) -> None:
        """What a multi-process engine does not do: a clear error naming it."""
        n = self.config.tensor_parallel_size
        if n > 1:
            raise RuntimeError(f"{what} is not supported with tensor_parallel_size={n} (the weights live in {n} "
                               f"processes): {instead}")

    # -- KV cache lifetime --------------------------------------------------------------------------

    def reserve_kv_cache(self, num_blocks: int | None = None) -> None:
        """Allocates the KV cache (the configured budget unless num_blocks is given)."""
        if self.runner.kv_cache is not None:
            return
        spec = self.speculator
        num_blocks = num_blocks or self.runner.budget_num_blocks(spec.extra_block_bytes if spec is not None else 0)
        self.runner.allocate_kv_cache(num_blocks)
        self.block_manager = BlockManager(num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        if spec is not None:
            spec.allocate(num_blocks, self.block_manager)
        self.scheduler = Scheduler(self.block_manager, self.config.max_num_seqs, self.config.max_num_batched_tokens,
                                   self.config.max_running_seqs_per_request)
        self._weights_version = self._param_version()

    def release_kv_cache(self) -> None:
        """Frees the KV cache memory (e.g. for a training update); the next request brings it back."""
        if self.requests:
            raise RuntimeError(f"release_kv_cache: {len(self.requests)} request(s) in flight; finish or abort them")
        self.runner.free_kv_cache()
        self._free_draft_cache()
        self.block_manager = self.scheduler = None

    def _free_draft_cache(self) -> None:
        if self.speculator is not None:
            self.speculator.free()

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
        self.runner.encoder_cache.clear()  # what the encoders made may be stale too
        self.num_prefix_cache_resets += 1

    def _param_version(self) -> int:
        return sum(map(_VERSION, self._params))  # every step: a map, not a generator (~3x faster)

    # -- requests -----------------------------------------------------------------------------------

    def new_request_id(self) -> str:
        """The next counter value that no request in flight uses (a caller may have chosen ids like "3")."""
        while (rid := str(next(self._ids))) in self.requests:
            pass
        return rid

    def validate(self, prompt_ids: list[int], params: SamplingParams, media=None) -> None:
        """RequestError for a request this engine cannot serve as asked (it changes nothing). media: the prompt's
        PlacedMedia (livemoe.engine.multimodal)."""
        if self.closed:
            raise EngineDeadError("the engine is closed (close() was called): start a new one")
        if self.scheduler is None:
            self.reserve_kv_cache()
        assert self.block_manager is not None  # reserved just above
        self.input_processor.validate(prompt_ids, params, self.block_manager.num_blocks * self.config.block_size)
        if media:
            check_media(prompt_ids, media, self.model.config.omni)
        if params.prompt_logprobs is not None and self.config.tensor_parallel_size > 1:
            # the lm_head is split over the ranks, which would all have to join the log-probs' pass
            raise RequestError(f"prompt_logprobs is not supported with tensor_parallel_size="
                               f"{self.config.tensor_parallel_size}; serve the model on one rank to get them")
        if params.return_routed_experts and self.model.num_moe_layers == 0:
            raise RequestError("return_routed_experts: the model is dense (no MoE layer has experts to return)")
        why = self.runner.routing_capture_refusal() if params.return_routed_experts else None
        if why is not None:
            raise RequestError(why)

    def add_request(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                    validated: bool = False, media=None) -> None:
        """Queues a tokenized request, validated first unless the caller just did (a bad one raises RequestError
        and changes nothing). media: the prompt's PlacedMedia over its placeholder tokens."""
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in flight")
        if not validated:
            self.validate(prompt_ids, params, media)
        omni = self.model.config.omni
        layout = None
        if media:
            assert omni is not None, "validate() refuses media for a text model"
            layout = MediaLayout(media, len(prompt_ids), omni)
        if params.return_routed_experts and not self.runner.capture_routing:
            # the blocks cached so far hold no routing: a hit on them would return garbage ids
            self.reset_prefix_cache()
            self.runner.enable_routing_capture()
        now = time.perf_counter()
        seqs = [Sequence(prompt_ids, params, request_id, i, None if params.seed is None else params.seed + i, now,
                         layout) for i in range(params.n)]
        if params.structured is not None:
            for seq in seqs:
                seq.grammar = self.input_processor.grammars().state(params.structured, prompt_ids)
        self.requests[request_id] = req = Request(request_id, prompt, prompt_ids, params, seqs)
        self.prompt_logprobs.add(req)
        assert self.scheduler is not None  # validate() reserved the KV cache
        for seq in seqs:
            self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Stops a request and frees its blocks; False if it is not in flight."""
        req = self.requests.pop(str(request_id), None)
        if req is None:
            return False
        assert self.scheduler is not None  # a request in flight holds the KV cache (release_kv_cache refuses)
        for seq in req.seqs:
            self.prompt_logprobs.discard(seq)
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def take_failed(self) -> dict[str, str]:
        """The requests the engine ended because of a fault of their own since the last call, and why
        (they get no further output)."""
        failed, self.failed = self.failed, {}
        return failed

    def run_until_finished(self, request_ids: list[str], on_finished=None) -> dict[str, RequestOutput]:
        """Steps until these requests finish; their final outputs by id (on_finished(output) is called for each as
        it comes). Others' finished outputs wait for the next step(). RequestFailedError if the engine ended one
        of them."""
        mine = set(request_ids)
        results: dict[str, RequestOutput] = {}
        while len(results) < len(mine):
            for o in self.step(finished_only=True):
                if o.request_id in mine:
                    results[o.request_id] = o
                    if on_finished is not None:
                        on_finished(o)
                else:
                    self.pending.append(o)  # someone else's: the next step() returns it
            mine_failed = [f"{rid}: {self.failed.pop(rid)}" for rid in request_ids if rid in self.failed]
            if mine_failed:
                raise RequestFailedError("the engine ended request(s) " + "; ".join(mine_failed))
        return results

    # -- the loop -----------------------------------------------------------------------------------

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Runs one scheduled step; returns an output for each request that got tokens or finished (cumulative;
        `finished` says whether it is the last), or with finished_only only for those that finished."""
        with batch_invariant_mode(self.config.batch_invariant):  # the forward and the sampler's log-probs
            return self._step(finished_only)

    def _step(self, finished_only: bool) -> list[RequestOutput]:
        pending, self.pending = self.pending, []
        if not self.requests:
            return pending
        version = self._param_version()
        if version != self._weights_version:
            self._weights_version = version
            self.reset_prefix_cache()
        assert self.scheduler is not None  # requests are in flight: the KV cache is reserved
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self.max_model_len)
        try:
            out = self.scheduler.schedule()
            if not out.seqs:
                raise RuntimeError("scheduler found nothing to run although requests are waiting (KV cache too "
                                   "small?)")
            was_training = self.model.training
            if was_training:  # a trainer's module: decode in eval mode, hand it back as it came
                self.model.eval()
            self.runner.keep_hidden = self.prompt_logprobs.wanted(out)
            try:
                logits, sampling = self.runner.run(out)
                if self.runner.keep_hidden:
                    self._collect_prompt_logprobs(out)
            finally:
                if was_training:
                    self.model.train()
        except BaseException:
            for seq in self.scheduler.running:  # drafts never outlive their step
                seq.drop_drafts()
            raise
        self.scheduler.update_computed(out)
        self.num_steps += 1
        seqs = [out.seqs[i] for i in sampling]
        # a sequence verifying drafts has 1 + num_draft_tokens consecutive rows; the others one
        starts = list(accumulate((1 + seq.num_draft_tokens for seq in seqs), initial=0))
        # a greedy step takes its tokens from the sampler's argmax path before the non-finite check, which reuses the
        # batch's max where that path has it (CPU fp32: one numpy pass for both)
        plain = [i for i, seq in enumerate(seqs) if not seq.num_draft_tokens]
        greedy = None
        if seqs and len(plain) == len(seqs) and argmax_only([s.params for s in seqs]):
            greedy = argmax_tokens(logits)
        self._fail_nonfinite_rows([seq for seq in seqs for _ in range(1 + seq.num_draft_tokens)], logits,
                                  None if greedy is None else greedy[1])
        for seq in seqs:
            if seq.generator is None and seq.seed is not None:
                try:
                    seq.generator = torch.Generator(device=logits.device).manual_seed(seq.seed)
                except Exception as e:  # noqa: BLE001 (one request's seed: fail it alone)
                    self._fail(seq.request_id, f"its generator could not be seeded with {seq.seed}: {e!r}")
        touched: dict[str, Request] = {}
        if plain:
            if greedy is not None and all(seq.request_id in self.requests for seq in seqs):
                kept, result = seqs, SampleResult(greedy[0], [None] * len(seqs))
            elif len(plain) < len(seqs):
                kept, result = self._sample(logits[[starts[i] for i in plain]], [seqs[i] for i in plain])
            else:
                kept, result = self._sample(logits, seqs)
            now = time.perf_counter()
            for seq, token, lp in zip(kept, result.token_ids, result.logprobs):
                self._emit(seq, token, lp, now, touched, finished_only)
        for i, seq in enumerate(seqs):
            if seq.num_draft_tokens:
                self._verify(seq, logits[starts[i]:starts[i + 1]], touched, finished_only)
        return pending + self._outputs(touched, finished_only)

    def _verify(self, seq: Sequence, logits: torch.Tensor, touched: dict, finished_only: bool) -> None:
        """Emits what verification keeps of seq's drafts (spec/verify.py) and the target's own token; rejected
        drafts give their KV slots back."""
        assert self.speculator is not None and self.block_manager is not None  # seq has drafts; a step is running
        drafts, probs = seq.take_drafts()
        if seq.request_id not in self.requests:
            return  # failed earlier in this step
        accepted = 0
        now = time.perf_counter()
        try:
            for token, lp, is_draft in verified_tokens(self.sampler, seq, logits, drafts, probs):
                if is_draft:
                    seq.num_computed_tokens += 1  # its K/V were computed in this step's forward
                    accepted += 1
                if not self._emit(seq, token, lp, now, touched, finished_only) or seq.finish_reason is not None:
                    break
        except Exception as e:  # noqa: BLE001 (one request's verification: fail it alone)
            self._fail(seq.request_id, f"verifying its speculative tokens failed: {e!r}")
            return
        self.speculator.record(seq, len(drafts), accepted)
        if seq.finish_reason is None and seq.request_id in self.requests:
            self.block_manager.trim(seq)
            # a draft model's K/V hold for the kept positions only
            seq.num_draft_computed = min(seq.num_draft_computed, seq.num_computed_tokens)

    def _emit(self, seq: Sequence, token: int, lp: dict | None, now: float, touched: dict,
              finished_only: bool) -> bool:
        """Appends one new token to seq and ends seq if the token stops it; marks its request to report (every
        one, or with finished_only those a finishing sequence completes). False if the request is gone (failed
        earlier in this step, or now)."""
        if seq.request_id not in self.requests:
            return False
        seq.append_token(token, now)
        if seq.grammar is not None:
            seq.grammar.advance([token])
        if lp is not None:
            seq.logprobs.append(lp)
        if seq.params.return_weight_versions:
            seq.weight_versions.append(self.weight_version)
        try:
            self.output_processor.check_stop(seq)
        except Exception as e:  # noqa: BLE001 (e.g. its stop strings could not be detokenized)
            self._fail(seq.request_id, f"checking its stop conditions failed: {e!r}")
            return False
        if seq.finish_reason is not None:
            assert self.scheduler is not None  # a step runs with the KV cache reserved
            if seq.params.return_routed_experts:  # before finish() frees its blocks
                seq.routed_experts = self.runner.routed_experts_of(len(seq), seq.block_table)
            self.scheduler.finish(seq)
            if self.speculator is not None:
                self.speculator.finished(seq)
            touched[seq.request_id] = self.requests[seq.request_id]
        elif not finished_only:
            touched[seq.request_id] = self.requests[seq.request_id]
        return True

    def _outputs(self, touched: dict[str, Request], finished_only: bool) -> list[RequestOutput]:
        """The outputs of the requests a step touched; a finished request leaves the engine."""
        now = time.perf_counter()
        outputs = []
        for req in touched.values():
            if req.finished:
                req.finish_time = now
                del self.requests[req.request_id]
                outputs.append(self.output_processor.make_output(req))
            elif not finished_only:
                outputs.append(self.output_processor.make_output(req))
        return outputs

    def _collect_prompt_logprobs(self, out) -> None:
        hidden, self.runner.last_hidden, self.runner.keep_hidden = self.runner.last_hidden, None, False
        assert hidden is not None  # execute() kept it
        self.prompt_logprobs.collect(out, hidden)

    # -- faults of one request ----------------------------------------------------------------------

    def _fail_nonfinite_rows(self, row_seqs: list[Sequence], logits: torch.Tensor,
                             batch_max: float | None = None) -> None:
        """Fails the requests whose logits hold NaN or +inf (sampling them would pick garbage) and counts
        the step (`stats()["last_logits_finite"]`: /health reports a model that produces them). A max
        propagates NaN and shows +inf: one over the batch on the hot path (batch_max where the caller has it
        already, else logits.amax()), per row only if it fails. row_seqs: each logits row's sequence. The rows
        stay: sampling skips the failed requests' rows."""
        if not row_seqs:
            return
        self.last_logits_finite = math.isfinite(logits.amax().item() if batch_max is None else batch_max)
        if self.last_logits_finite:
            return
        bad = (~torch.isfinite(logits.amax(-1))).nonzero()[:, 0].tolist()
        self.num_nonfinite_logits_steps += 1
        for i in bad:
            self._fail(row_seqs[i].request_id, "the model produced non-finite logits (NaN or inf) for it")
        log.error("step %d: the model produced non-finite logits for %d of %d rows", self.num_steps, len(bad),
                  len(row_seqs))

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

    # -- weights and memory (rollout servers for RL: livemoe/engine/core) ----------------------------------

    def settle_in_flight(self, in_flight: str, why: str) -> None:
        """Requests in flight before the weights change: "finish" runs them to the end on the old weights
        (their outputs are kept for the next step()), "abort" ends each (take_failed() says why), "interrupt"
        preempts every running sequence: its KV blocks go (the prefix cache is dropped with the weights), and it
        resumes where it stopped, its prompt and tokens so far recomputed on the new weights, with its own sampling
        generator (the draws go on as if uninterrupted) and the log-probs of its earlier tokens kept (partial
        rollouts, as slime's and verl's)."""
        if in_flight not in IN_FLIGHT_MODES:
            raise ValueError(f"in_flight must be one of {IN_FLIGHT_MODES}, got {in_flight!r}")
        if in_flight == "abort":
            for rid in list(self.requests):
                self._fail(rid, f"aborted: {why}")
            return
        if in_flight == "interrupt":
            if self.scheduler is not None:
                self.scheduler.preempt_all()
            return
        finished = []
        while self.requests:
            finished += [o for o in self.step() if o.finished]
        self.pending += finished

    def update_weights(self, named_tensors, in_flight: str = "finish", weight_version: int | None = None) -> int:
        """Copies (name, tensor) pairs into the loaded parameters in place (hub or engine names, any
        subset; checked whole before the first copy: CheckpointError and the old weights stay), then
        drops the cached prefixes. Returns the number of tensors copied. A tensor-parallel engine broadcasts
        them to its workers, and each rank copies its own slices. weight_version: the new weights' label (every
        update sets it; None: unlabelled)."""
        self.refuse_asleep("update_weights")
        named_tensors = list(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
        self.settle_in_flight(in_flight, "the weights were updated")
        return self._weights_changed(self.runner.load_weights(WeightUpdate.of_tensors(named_tensors), named_tensors),
                                     weight_version)

    def update_weights_from_disk(self, model_path: str, in_flight: str = "finish",
                                 weight_version: int | None = None) -> int:
        """update_weights with every tensor of a checkpoint of the same architecture (each tensor-parallel rank
        reads only its slices)."""
        self.refuse_asleep("update_weights_from_disk")
        self.settle_in_flight(in_flight, "the weights were updated")
        return self._weights_changed(self.runner.load_weights(WeightUpdate("disk", path=str(model_path))),
                                     weight_version)

    def init_weights_update_group(self, **group) -> None:
        """Joins a trainer's weight-update group (livemoe.engine.core.weight_sync): rank group["rank"], and its
        tensor-parallel workers the next ranks."""
        self.runner.join_weight_group(**group)

    def update_weights_from_distributed(self, names, dtypes, shapes, in_flight: str = "finish",
                                        weight_version: int | None = None) -> int:
        """Receives the tensors the trainer broadcasts and copies them in (each rank its slices). Asleep, the
        broadcast is still received whole (the trainer is not left waiting), then refused."""
        self.settle_in_flight(in_flight, "the weights were updated")
        update = WeightUpdate("group", names=tuple(names), dtypes=tuple(dtypes), shapes=tuple(map(tuple, shapes)))
        refusal = self.asleep_refusal("update_weights_from_distributed")
        return self._weights_changed(self.runner.load_weights(update, refusal=refusal), weight_version)

    def refuse_asleep(self, what: str) -> None:
        """A weight update while asleep is refused (RuntimeError; the server's 409), not kept for the wake-up:
        the caller learns that the weights it sent are not the ones serving."""
        refusal = self.asleep_refusal(what)
        if refusal is not None:
            raise RuntimeError(refusal)

    def asleep_refusal(self, what: str) -> str | None:
        if not self.sleep_level:
            return None
        return (f"{what}: the engine is asleep (level {self.sleep_level}); wake it up first (wake_up(), "
                "POST /wake_up), then update the weights")

    def _weights_changed(self, num_copied: int, weight_version: int | None = None) -> int:
        self.reset_prefix_cache()
        self._weights_version = self._param_version()
        self.weight_version = weight_version
        return num_copied

    def sleep(self, level: int = 1, in_flight: str = "abort") -> None:
        """Frees the KV cache (level 1) and moves the weights to host memory (level 2; on a CPU device they
        are there already); wake_up() brings them back. Requests in flight end as `in_flight` says."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if in_flight == "interrupt":
            raise ValueError("sleep: in_flight must be finish or abort (an interrupted request would hold the KV "
                             "cache that sleep frees)")
        if self.sleep_level:
            raise RuntimeError(f"the engine is asleep already (level {self.sleep_level})")
        if level == 2:
            self.refuse_tensor_parallel("sleep(level=2)", "sleep(level=1) frees every rank's KV cache")
        self.settle_in_flight(in_flight, "the engine was put to sleep")
        self.release_kv_cache()
        if level == 2 and self.runner.device.type != "cpu":
            with torch.no_grad():
                for p in self._params:
                    p.data = p.data.to("cpu", non_blocking=True).pin_memory()
        self.sleep_level = level

    def wake_up(self) -> None:
        if self.sleep_level == 2 and self.runner.device.type != "cpu":
            with torch.no_grad():
                for p in self._params:
                    p.data = p.data.to(self.runner.device, non_blocking=True)
        self.sleep_level = 0
        self.reserve_kv_cache()

    # -- introspection ------------------------------------------------------------------------------

    def stats(self) -> dict:
        bm, sched = self.block_manager, self.scheduler
        return dict(
            num_requests=len(self.requests),
            num_running=len(sched.running) if sched else 0,
            num_waiting=len(sched.waiting) if sched else 0,
            kv_blocks_total=bm.num_blocks if bm else 0,
            kv_blocks_used=bm.num_used_blocks if bm else 0,
            kv_blocks_pinned=bm.num_pinned_blocks if bm else 0,  # kept for live sessions between their steps
            prefix_cache_queries=bm.stats.queries if bm else 0,
            prefix_cache_hits=bm.stats.hits if bm else 0,
            prefix_cache_hit_rate=bm.stats.hit_rate if bm else 0.0,
            recompute_hits=bm.stats.recompute_hits if bm else 0,
            num_preemptions=sched.num_preemptions if sched else 0,
            num_eager_fallbacks=self.runner.num_eager_fallbacks,
            num_graph_replays=self.runner.num_graph_replays,
            num_verify_graph_replays=self.runner.num_verify_graph_replays,
            encoder_cache_hits=self.runner.encoder_cache.hits,  # media items (the Omni thinker)
            encoder_cache_misses=self.runner.encoder_cache.misses,
            num_steps=self.num_steps,
            num_failed_requests=self.num_failed_requests,
            num_nonfinite_logits_steps=self.num_nonfinite_logits_steps,
            last_logits_finite=self.last_logits_finite,
            tensor_parallel_size=self.config.tensor_parallel_size,  # the parallel layout (/metrics)
            expert_parallel=self.config.enable_expert_parallel,
            **(self.speculator.stats() if self.speculator is not None else {}),
        )

"""GRPO rollouts from running servers (`python -m train.grpo --rollout_url URL[,URL...]`): the same
interface as livemoe.train.rollout.Rollouts (generate / greedy / release / temperature), but each prompt's K
samples are one /v1/completions request to a rollout server (`livemoe serve`, see docs/serving.md,
"Rollout servers for RL"), spread round-robin over the URLs. The request asks for the same seed as the
in-process decoder would use, the sampled tokens' ids and their raw log-probs (the old_logprobs), so a
run against a server draws the rollouts an in-process run draws.

After each optimizer step `weights_updated(model)` pushes the new weights to every server:
- "distributed" (default): the trainer is rank 0 of a torch.distributed group the servers' engine cores
  join (gloo; NCCL when the module is on a GPU); the tensors are broadcast, nothing touches the disk;
- "disk": the model is saved to a scratch directory the servers can read, then each loads it
  (POST /update_weights_from_disk).
The servers get the trainer's weights once at the start too, so they decode the policy being trained
whatever checkpoint they were started with (the architecture must match).

Under torchrun every rank sends its own prompts to the servers; rank 0 alone (`main`) joins the weight-update
group and pushes the weights, broadcast once to every replica (or written once to disk), and the `barrier` after
the push keeps every rank's next rollouts behind it. The weights come from `gather(model)`: a gathered copy's
parameters, or (streamed, `push_dtype` given) the sharded model's tensors gathered one at a time on every rank
(its collectives), rank 0 filling and sending the buckets as they come, so no rank holds the whole model. Multi-turn trajectories
(generate_multi_turn) are one request per turn, seeded as the in-process decoder seeds them.
"""
import concurrent.futures
import json
import os
import shutil
import socket
import tempfile
import urllib.error
import urllib.parse
import urllib.request

import torch

from livemoe.engine import routed_experts
from livemoe.engine.core.weight_sync import join_servers, push_weights_to_servers
from livemoe.engine.net import free_port
from livemoe.engine.multimodal.media import MultimodalPrompt
from livemoe.train.rollout import Completion, derive_seed, multi_turn_trajectories

WEIGHT_SYNCS = ("distributed", "disk")
POLL_S = 0.02  # partial rollouts: how often a newer policy version is looked for while requests are in flight


class RemoteRollouts:
    def __init__(self, urls: list[str], tokenizer, model, *, num_generations: int = 8, max_new_tokens: int = 256,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, seed: int = 0,
                 weight_sync: str = "distributed", api_key: str | None = None, timeout_s: float = 600.0,
                 return_routed_experts: bool = False, main: bool = True, barrier=None, gather=None,
                 push_dtype=None):
        import openai

        if weight_sync not in WEIGHT_SYNCS:
            raise ValueError(f"weight_sync must be one of {WEIGHT_SYNCS}, got {weight_sync!r}")
        if not urls:
            raise ValueError("rollout_url: no URL given")
        self.urls = [u.rstrip("/") for u in urls]
        self.tokenizer, self.k, self.max_new_tokens, self.seed = tokenizer, num_generations, max_new_tokens, seed
        self.sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k)
        self.return_routed_experts = return_routed_experts
        self.weight_sync, self.api_key, self.timeout_s = weight_sync, api_key, timeout_s
        self.clients = [openai.OpenAI(base_url=u + "/v1", api_key=api_key or "none", max_retries=2,
                                      timeout=timeout_s) for u in self.urls]
        self.model_names = [c.models.list().data[0].id for c in self.clients]
        self.pool = concurrent.futures.ThreadPoolExecutor(max(8, 4 * len(self.urls)),
                                                          thread_name_prefix="livemoe-rollout")
        self.sender = None
        self.scratch = None
        self.main, self.barrier = main, barrier or (lambda: None)
        self.gather, self.push_dtype = gather, push_dtype  # streamed: both given
        self.host_model = None  # streamed to disk: rank 0's host copy, written as the checkpoint
        # partial rollouts (async GRPO): called every POLL_S while requests are in flight; on rank 0 it may push
        # new weights with in_flight="interrupt". The servers then say which weights drew each token
        # (return_weight_versions, the label each push gives): Completion.versions.
        self.between_steps = None
        self.return_weight_versions = False
        if not main:
            pass
        elif weight_sync == "distributed":
            device = next(model.parameters()).device
            self.sender = join_servers(self.urls, "127.0.0.1" if _local(self.urls) else socket.gethostname(),
                                       free_port(""), backend="nccl" if device.type == "cuda" else "gloo",
                                       timeout_s=timeout_s, api_key=api_key)
        else:
            self.scratch = tempfile.mkdtemp(prefix="livemoe-weights-")
        self.weights_updated(model)

    @property
    def temperature(self) -> float:
        return self.sampling["temperature"]

    def release(self) -> None:
        """Nothing to free here: the KV caches live in the servers."""

    def weights_updated(self, model, version: int | None = None, in_flight: str = "finish",
                        barrier: bool = True) -> None:
        """Pushes the model's weights to every server (after each optimizer step; rank 0 alone under torchrun, while
        every rank runs the gather's collectives), then waits at the barrier. version: their label, which the
        servers stamp on each token the weights draw; in_flight: what the servers do with the requests in flight
        ("interrupt": they resume on the new weights); barrier False: rank 0's push alone, no rank waits for it
        (partial rollouts' pushes while requests are in flight: the labels say which weights drew each token)."""
        if not barrier and self.gather is not None:
            raise ValueError("a streamed push gathers on every rank: it cannot be rank 0's alone (barrier=False)")
        if self.main:
            self._push(model, self.gather(model) if self.gather is not None else model.named_parameters(), version,
                       in_flight)
        elif self.gather is not None:
            for _ in self.gather(model):  # this rank's part of the gather
                pass
        if barrier:
            self.barrier()

    def _metadata(self, model) -> dict | None:
        """The streamed tensors' names, dtypes and full shapes, before any is gathered (None: not streamed)."""
        if self.push_dtype is None:
            return None
        from livemoe.engine.core.weight_sync import dtype_name
        from livemoe.engine.model.memory import param_shapes

        shapes = param_shapes(model.config)
        return dict(names=[n for n, _ in shapes], dtypes=[dtype_name(self.push_dtype)] * len(shapes),
                    shapes=[list(s) for _, s in shapes])

    def _push(self, model, named, version: int | None = None, in_flight: str = "finish") -> None:
        if self.sender is not None:
            push_weights_to_servers(self.urls, self.sender, named, in_flight, api_key=self.api_key,
                                    timeout_s=self.timeout_s, metadata=self._metadata(model), weight_version=version)
            return
        from livemoe.engine.model.saver import save_model

        assert self.scratch is not None
        if self.push_dtype is not None:  # streamed: assembled on this host, tensor by tensor
            if self.host_model is None:
                from livemoe.engine.model.loader import empty_model

                self.host_model = empty_model(model.config, self.push_dtype, "cpu")
            target = dict(self.host_model.named_parameters())
            with torch.no_grad():
                for name, t in named:
                    target[name].copy_(t)
            model = self.host_model
        path = os.path.join(self.scratch, "model")
        save_model(model, path)
        for url in self.urls:
            _post(url + "/update_weights_from_disk", {"model_path": path, "in_flight": in_flight,
                                                       "weight_version": version}, self.api_key, self.timeout_s)

    def close(self) -> None:
        self.pool.shutdown()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)

    # -- rollouts -----------------------------------------------------------------------------------

    def _ids(self, prompt) -> list:
        return self.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else list(prompt)

    def _one(self, i: int, prompt_ids: list, n: int, seed, max_tokens: int, greedy: bool) -> list:
        sampling = dict(temperature=0.0) if greedy else dict(temperature=self.temperature, top_p=self.sampling["top_p"],
                                                               seed=seed)
        extra = {"return_token_ids": True}
        if not greedy and self.return_routed_experts:
            extra["return_routed_experts"] = True
        if self.return_weight_versions:
            extra["return_weight_versions"] = True
        if not greedy and self.sampling["top_k"] > 0:
            extra["top_k"] = self.sampling["top_k"]
        client = self.clients[i % len(self.clients)]
        out = client.completions.create(model=self.model_names[i % len(self.clients)], prompt=prompt_ids, n=n,
                                        max_tokens=max_tokens, logprobs=0, extra_body=extra, **sampling)
        comps = []
        for c in sorted(out.choices, key=lambda c: c.index):
            ids = c.model_extra["token_ids"]
            lps = c.logprobs.token_logprobs
            assert len(lps) == len(ids), (len(lps), len(ids))
            routed = c.model_extra.get("routed_experts")
            versions = list(c.model_extra.get("weight_versions") or []) if self.return_weight_versions else []
            if None in versions or len(versions) != len(ids) * self.return_weight_versions:
                raise RuntimeError(f"{self.urls[i % len(self.urls)]}: the weight versions of a completion are "
                                   f"{versions[:8]}... for {len(ids)} tokens: the server's weights were loaded "
                                   "without a weight_version (push them with one first)")
            comps.append(Completion(list(prompt_ids), list(ids), list(lps), c.text, c.finish_reason,
                                    routed_experts=None if routed is None else routed_experts.decode(routed),
                                    versions=versions))
        return comps

    def _results(self, futures: list) -> list:
        """The futures' results in order; with partial rollouts between_steps() runs every POLL_S meanwhile."""
        pending = set(futures)
        while pending and self.between_steps is not None:
            _, pending = concurrent.futures.wait(pending, timeout=POLL_S)
            if pending:
                self.between_steps()
        return [f.result() for f in futures]

    def generate(self, prompts: list, step, max_new_tokens: int | None = None, n: int | None = None,
                 keys: list | None = None) -> list:
        ids = [self._ids(p) for p in prompts]
        n = n or self.k
        keys = range(len(ids)) if keys is None else keys
        max_tokens = max_new_tokens or self.max_new_tokens
        futures = [self.pool.submit(self._one, i, p, n, derive_seed(self.seed, step, key) * n, max_tokens, False)
                   for i, (p, key) in enumerate(zip(ids, keys))]
        return self._results(futures)

    def greedy(self, prompts: list, max_new_tokens: int | None = None) -> list:
        ids = [self._ids(p) for p in prompts]
        max_tokens = max_new_tokens or self.max_new_tokens
        futures = [self.pool.submit(self._one, i, p, 1, None, max_tokens, True) for i, p in enumerate(ids)]
        return [f.result()[0] for f in futures]

    def generate_multi_turn(self, first_prompts: list, next_turns: list, step: int,
                            max_new_tokens: int | None = None, greedy: bool = False, keys: list | None = None) -> list:
        """K trajectories per conversation (livemoe.train.rollout.multi_turn_trajectories), each turn of each one
        request to a server, with the in-process decoder's seeds."""
        max_tokens = max_new_tokens or self.max_new_tokens
        if any(isinstance(p, MultimodalPrompt) for p in [*first_prompts, *(t for n in next_turns for t in n)]):
            raise ValueError("remote rollouts send text prompts; conversations with audio or video roll out on the "
                             "in-process decoder")

        def sample(prompts: list, seeds: list) -> list:
            futures = [self.pool.submit(self._one, i, p, 1, seed, max_tokens, greedy)
                       for i, (p, seed) in enumerate(zip(prompts, seeds))]
            return [r[0] for r in self._results(futures)]

        return multi_turn_trajectories(first_prompts, next_turns, step, self.seed, 1 if greedy else self.k, keys,
                                       self._ids, sample)


def _local(urls: list[str]) -> bool:
    hosts = {urllib.parse.urlparse(u).hostname for u in urls}
    return hosts <= {"127.0.0.1", "localhost", "::1"}




def _post(url: str, body: dict, api_key: str | None, timeout_s: float) -> dict:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}: HTTP {e.code}: {e.read().decode(errors='replace')[:500]}") from None

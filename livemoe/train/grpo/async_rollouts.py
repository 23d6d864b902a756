"""Asynchronous GRPO rollouts (`--async_rollouts --max_staleness S`): a producer thread rolls out the batches of
steps t+1 .. t+S while the trainer trains step t, so the decoder (in-process on its own copy of the policy, or the
`--rollout_url` servers) and the update overlap instead of waiting for each other.

Versions. Version v is the policy after v optimizer steps. The batch of step j is rolled out by exactly version
v(j) = max(first, j - S) (first: the step the run starts or resumes at): the producer waits until the trainer has
published v(j), loads it into its decoder (a copy of the policy in-process; a push to the servers with
--rollout_url), then rolls out. So a sample is S versions old when it is trained on (fewer in the first S steps),
never older: none needs dropping, and each Completion records its version per token (`versions`). The behaviour
policy's log-probs travel with the samples (their old_logprobs); the trainer's log-probs at the start of step j are
version j's, so the rollout correction (--rollout_is, livemoe/train/mismatch.py) weighs exactly the staleness gap
(and the decoder's numerical mismatch) away.

Partial rollouts (`partial`): a version newer than the decoder's is loaded as soon as it is published, while a
batch is in flight: in-process between two engine steps (Rollouts.between_steps, the engine's in_flight="interrupt"),
remote by a push with in_flight "interrupt" and the version as the servers' weight_version label, which they stamp
on every token (return_weight_versions). Either way each token's version is the one that drew it.

Under torchrun every rank runs a producer on its share of each batch; `sample` gathers the ranks' groups on a
process group of the producers' own (Distributed.side_channel), and with servers rank 0 pushes each version while
the others wait at the barrier (on that group too) before sending their prompts. Partial rollouts with servers:
rank 0 pushes each version as soon as it is published, interrupting every rank's requests in flight, and no rank
waits for such a push (the servers' labels give each token its version); the ranks meet at the barrier once per
batch instead, after rank 0 has pushed at least the batch's version, so no token is older than S.

Reproducibility. Which version rolls out which batch is a function of (first step, S) alone, never of timing; the
sampling is seeded per (seed, step, prompt) as in the synchronous trainer; the trainer consumes the batches in step
order. So a run is reproducible for a seed and S, and S = 0 is the synchronous run exactly (tested, in one process and
under torchrun). What is not: partial rollouts (where the interruptions fall is timing); a run resumed at step r rolls
out steps r .. r+S-1 with version r (the older versions are not in the checkpoint), so it differs from the
uninterrupted run from step r on. docs/training.md has the table per configuration.
"""
import copy
import threading

import torch


class AsyncRollouts:
    """The producer. sample(step, rollouts) -> the step's groups (GRPOTrainer.sample_groups); rollouts: the decoder
    the producer owns (in-process: Rollouts over `model`, a copy of the policy only this thread touches; remote:
    RemoteRollouts, pushed `model` after each load). get(step) blocks for a step's groups; publish(version, model)
    hands the trainer's weights over after each optimizer step."""

    def __init__(self, sample, rollouts, model, *, first_step: int, total_steps: int, max_staleness: int,
                 push_weights: bool, partial: bool = False):
        self.sample, self.rollouts, self.model = sample, rollouts, model
        self.first, self.total, self.staleness = first_step, total_steps, max_staleness
        self.push_weights = push_weights  # remote servers: each loaded version is pushed to them
        self.partial = partial  # partial rollouts: a newer version interrupts the generation in flight
        self.version = first_step  # the version the producer's decoder holds
        if not push_weights:
            rollouts.version = first_step
        if partial:  # remote: the servers label each token with the version of the push that drew it
            rollouts.between_steps = self._between_steps
            if push_weights:
                rollouts.return_weight_versions = True
        self.published: dict = {}  # version -> the trainer's parameters (CPU clones) not yet loaded
        self.ready: dict = {}  # step -> its groups
        self.error: BaseException | None = None
        self.stopping = False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="livemoe-async-rollouts", daemon=True)
        self.thread.start()

    @staticmethod
    def decoder_copy(model):
        """The producer's own copy of the policy (in-process): the trainer updates its weights while this decodes."""
        return copy.deepcopy(model).requires_grad_(False).eval()

    def version_for(self, step: int) -> int:
        return max(self.first, step - self.staleness)

    def _take(self, at_least: int, wait: bool):
        """(version, parameters) to load: exactly `at_least` (strict), or the newest published one at or above it
        (partial); None when there is none (wait=False) or the producer is stopping."""
        with self.cond:
            while wait and not self.stopping and not any(v >= at_least for v in self.published):
                self.cond.wait()
            found = [v for v in self.published if v >= at_least]
            if self.stopping or not found:
                return None
            v = max(found) if self.partial else at_least
            state = self.published.pop(v)
            for old in [old for old in self.published if old < v]:  # versions no batch needs any more
                del self.published[old]
            return v, state

    def _load(self, version: int, state: dict) -> None:
        if self.push_weights:
            # under torchrun rank 0 pushes (the others have no copy). Strict: every rank waits for each push at the
            # barrier. Partial: no push waits (one in flight is rank 0's alone; the servers label the tokens), the
            # ranks meet once per batch instead (_run)
            if self.model is not None:
                with torch.no_grad():
                    for name, p in self.model.named_parameters():
                        p.copy_(state[name])
            self.rollouts.weights_updated(self.model, version, "interrupt" if self.partial else "finish",
                                          barrier=not self.partial)
        else:  # in flight (partial rollouts): interrupted, to resume on these weights
            self.rollouts.update_weights(state.items(), version)
        self.version = version

    def _between_steps(self) -> None:
        """Partial rollouts: a version newer than the decoder's, if the trainer has published one, is loaded now."""
        got = self._take(self.version + 1, wait=False)
        if got is not None:
            self._load(*got)

    def _run(self) -> None:
        try:
            if self.push_weights and self.partial:  # the servers' weights (version first), labelled for the tokens
                self.rollouts.weights_updated(self.model, self.first)
            for step in range(self.first, self.total):
                need = self.version_for(step)
                if need > self.version or (self.partial and self.published):
                    got = self._take(max(need, self.version + 1), wait=need > self.version)
                    if got is None and need > self.version:
                        return  # stopping
                    if got is not None:
                        self._load(*got)
                if self.push_weights and self.partial:
                    # every rank's prompts of this batch wait until rank 0 has pushed version >= need (versions only
                    # grow, so each token is at most S old); once per batch on every rank, whatever rank 0 pushed
                    self.rollouts.barrier()
                out = self.sample(step, self.rollouts)
                self.rollouts.release()
                versions = []
                for g in out["sampled"]:
                    for c in g["comps"] or ():
                        if not c.versions:  # remote and multi-turn rollouts: drawn by one version
                            c.versions = [self.version] * len(c.token_ids)
                        versions += c.versions
                out["version"] = min(versions, default=self.version)  # its oldest token's
                with self.cond:
                    self.ready[step] = out
                    self.cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the trainer's thread, which raises it
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def get(self, step: int) -> dict:
        """The groups of `step` (blocks until they are rolled out); the producer's error, if it failed."""
        with self.cond:
            while step not in self.ready and self.error is None:
                self.cond.wait()
            if step not in self.ready:
                raise RuntimeError(f"the asynchronous rollouts failed: {self.error!r}") from self.error
            return self.ready.pop(step)

    def publish(self, version: int, model) -> None:
        """The trainer's weights after `version` optimizer steps, for the batches that need them (a CPU clone: the
        trainer goes on updating its own); only versions some later batch rolls out with are kept."""
        if version + self.staleness >= self.total:  # batch version + S is the one it rolls out: none left
            return
        # no copy of its own (another rank than 0 pushing to servers): the version number alone
        state = {} if self.model is None else {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
        with self.cond:
            self.published[version] = state
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.thread.join(timeout=600)

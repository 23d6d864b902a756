"""Speculator: the engine core's speculative-decoding state: its proposer, when to draft, and the counters
(stats() and /metrics): drafted and accepted tokens and the histogram of accepted drafts per verification."""

from livemoe.engine.decoder.config import EngineConfig
from livemoe.engine.decoder.sequence import Sequence
from livemoe.engine.decoder.spec.config import SpeculativeConfig
from livemoe.engine.decoder.spec.draft_model import DraftModelProposer, check_compatible
from livemoe.engine.decoder.spec.proposers import NgramProposer, Proposer
from livemoe.engine.model.loader import load_model, load_tokenizer

MAX_BACKOFF = 16  # steps


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer):
        self.config, self.proposer = config, proposer
        self.k = config.num_speculative_tokens
        self.num_verifications = 0
        self.num_drafted_tokens = 0
        self.num_accepted_tokens = 0
        self.num_disabled_steps = 0  # steps over disable_by_batch_size
        self.accepted_histogram = [0] * (self.k + 1)  # verifications by accepted drafts (0..k)

    @classmethod
    def create(cls, engine_config: EngineConfig, model, tokenizer, max_model_len: int, sampler) -> "Speculator":
        """The engine's speculator (its draft model loaded and checked against the target for draft_model)."""
        config = engine_config.speculative
        assert config is not None
        param = next(model.parameters())
        if config.method == "ngram":
            return cls(config, NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max,
                                             config.lookup_recent_outputs))
        path = config.model
        assert path is not None  # SpeculativeConfig requires it for draft_model
        draft = load_model(path, dtype=param.dtype, device=param.device)
        check_compatible(model, tokenizer, draft, load_tokenizer(path), path)
        return cls(config, DraftModelProposer(draft, engine_config, max_model_len, sampler))

    # a draft model's KV cache lives and dies with the target's (ngram has none)

    @property
    def extra_block_bytes(self) -> int:
        """What each KV block costs besides the target's K and V."""
        return self.proposer.block_bytes if isinstance(self.proposer, DraftModelProposer) else 0

    def allocate(self, num_blocks: int, block_manager) -> None:
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.allocate(num_blocks, block_manager)

    def free(self) -> None:
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.free()

    def propose(self, running: list[Sequence], max_model_len: int) -> None:
        """Gives drafts to the running sequences about to decode (their last token the only uncomputed one), at
        most what max_tokens and the context leave after the token the verification adds."""
        decoding = [s for s in running if s.num_computed_tokens == len(s.token_ids) - 1]
        if not decoding:
            return
        if len(decoding) > self.config.disable_by_batch_size:
            self.num_disabled_steps += 1
            return
        ready = []
        for seq in decoding:
            if seq.spec_skip_steps:
                seq.spec_skip_steps -= 1
            else:
                ready.append(seq)
        decoding = ready
        limits = [min(self.k, s.params.max_tokens - s.num_output_tokens - 1, max_model_len - len(s.token_ids) - 1)
                  for s in decoding]
        for seq, (drafts, probs) in zip(decoding, self.proposer.propose(decoding, limits)):
            if drafts:
                seq.add_drafts(drafts, probs)

    def finished(self, seq: Sequence) -> None:
        """A sequence finished: ngram with lookup_recent_outputs keeps its output to draft from."""
        if isinstance(self.proposer, NgramProposer):
            self.proposer.finished(seq)

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        # a verification that keeps nothing cost more than the decode step it replaced: a sequence whose drafts
        # keep failing (text the lookup cannot predict) waits 1, 2, 4 ... MAX_BACKOFF steps before drafting again
        if accepted:
            seq.spec_misses = 0
        else:
            seq.spec_misses += 1
            seq.spec_skip_steps = min(MAX_BACKOFF, 2 ** (seq.spec_misses - 1))
        seq.num_spec_steps += 1
        seq.num_drafted_tokens += drafted
        seq.num_accepted_tokens += accepted
        self.num_verifications += 1
        self.num_drafted_tokens += drafted
        self.num_accepted_tokens += accepted
        self.accepted_histogram[accepted] += 1

    def stats(self) -> dict:
        n = self.num_verifications
        return dict(spec_method=self.config.method, spec_num_verifications=n,
                    spec_drafted_tokens=self.num_drafted_tokens, spec_accepted_tokens=self.num_accepted_tokens,
                    spec_disabled_steps=self.num_disabled_steps,
                    spec_acceptance_rate=self.num_accepted_tokens / self.num_drafted_tokens
                    if self.num_drafted_tokens else 0.0,
                    # tokens a verification emits: its accepted drafts and the target's own token
                    spec_mean_acceptance_length=(self.num_accepted_tokens + n) / n if n else 0.0,
                    spec_accepted_histogram=list(self.accepted_histogram))

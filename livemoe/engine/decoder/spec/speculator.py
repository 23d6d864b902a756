"""Speculator: the engine core's speculative-decoding state: its proposer, when to draft, and the counters
(stats() and /metrics): drafted and accepted tokens and the histogram of accepted drafts per verification."""
from livemoe.engine.decoder.sequence import Sequence
from livemoe.engine.decoder.spec.config import SpeculativeConfig
from livemoe.engine.decoder.spec.proposers import NgramProposer, Proposer


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
    def create(cls, config: SpeculativeConfig) -> "Speculator":
        if config.method == "ngram":
            return cls(config, NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max))
        raise NotImplementedError(config.method)  # SpeculativeConfig refuses other methods

    def propose(self, running: list[Sequence], max_model_len: int) -> None:
        """Gives drafts to the running sequences about to decode (their last token the only uncomputed one), at
        most what max_tokens and the context leave after the token the verification adds."""
        decoding = [s for s in running if s.num_computed_tokens == len(s.token_ids) - 1]
        if not decoding:
            return
        if len(decoding) > self.config.disable_by_batch_size:
            self.num_disabled_steps += 1
            return
        limits = [min(self.k, s.params.max_tokens - s.num_output_tokens - 1, max_model_len - len(s.token_ids) - 1)
                  for s in decoding]
        for seq, (drafts, probs) in zip(decoding, self.proposer.propose(decoding, limits)):
            if drafts:
                seq.add_drafts(drafts, probs)

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
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

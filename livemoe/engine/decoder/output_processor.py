"""OutputProcessor: what a step's new tokens mean to their requests. It checks the stop conditions (EOS, stop ids,
stop strings, max_tokens, the context), detokenizes incrementally, and assembles each request's cumulative
RequestOutput with its metrics.

`final_text` is the one definition of a finished completion's text; the engine-core client, which gets token
ids from the core process and detokenizes itself, uses it too.
"""
from livemoe.engine.decoder.sequence import Request, Sequence
from livemoe.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from livemoe.engine.text.detokenizer import IncrementalDetokenizer


def final_text(tokenizer, token_ids: list[int], finish_reason: str | None, stop_reason,
               skip_special_tokens: bool) -> str:
    """A finished completion's text (not one a stop string cut: that text is the cut one): its tokens decoded,
    less the stop token that ended it."""
    if tokenizer is None:
        return ""
    ended_by_token = finish_reason == "stop" and isinstance(stop_reason, int)
    return tokenizer.decode(token_ids[:-1] if ended_by_token else token_ids, skip_special_tokens=skip_special_tokens)


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int, flops_per_token: int,
                 text_in_flight: bool = True):
        self.tokenizer, self.eos_token_ids, self.max_model_len = tokenizer, eos_token_ids, max_model_len
        self.flops_per_token = flops_per_token
        # False: outputs in flight carry token ids only, no text and no metrics (an engine core whose client
        # detokenizes: the text would cost a detokenizer push per sequence per step on the process that steps)
        self.text_in_flight = text_in_flight

    def check_stop(self, seq: Sequence) -> None:
        """Sets seq.finish_reason (and stop_reason) if its newest token ends it."""
        p = seq.params
        token = seq.token_ids[-1]
        if not p.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif token in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif p.stop:
            text = self.text_so_far(seq)
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

    def text_so_far(self, seq: Sequence) -> str:
        """The complete characters of seq's output so far, decoded incrementally (stop strings and streaming
        callers ask at every step: a step decodes its new tokens, not the whole output again)."""
        det = seq.detokenizer
        if det is None:
            det = seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.params.skip_special_tokens)
        if len(det.ids) < seq.num_output_tokens:
            det.push(seq.token_ids[seq.num_prompt_tokens + len(det.ids):])
        return det.decoded

    def make_output(self, req: Request) -> RequestOutput:
        if not req.finished and not self.text_in_flight:
            logprobs = req.params.logprobs is not None
            return RequestOutput(req.request_id, req.prompt, req.prompt_ids,
                                 [CompletionOutput(s.index, "", s.output_token_ids, s.finish_reason, s.stop_reason,
                                                   s.logprobs if logprobs else None,
                                                   weight_versions=_versions(req, s)) for s in req.seqs], False,
                                 prompt_logprobs=req.prompt_logprobs)
        completions = []
        for seq in req.seqs:
            ids = seq.output_token_ids
            if seq.stop_reason is not None and isinstance(seq.stop_reason, str):
                text = seq.text
            elif seq.finish_reason is None:  # in flight (step()'s cumulative outputs)
                text = self.text_so_far(seq) if self.tokenizer is not None else ""
            else:
                text = final_text(self.tokenizer, ids, seq.finish_reason, seq.stop_reason,
                                  req.params.skip_special_tokens)
            completions.append(CompletionOutput(seq.index, text, list(ids), seq.finish_reason, seq.stop_reason,
                                                list(seq.logprobs) if req.params.logprobs is not None else None,
                                                routed_experts=seq.routed_experts, weight_versions=_versions(req, seq)))
        return RequestOutput(req.request_id, req.prompt, req.prompt_ids, completions, req.finished, self.metrics(req),
                             req.prompt_logprobs)

    def metrics(self, req: Request) -> RequestMetrics:
        # one pass over the samples (this runs for every request at every step that streams its output)
        n_out = cached = preemptions = drafted = accepted = spec_steps = span_n = 0
        span_t = 0.0
        first = None
        for s in req.seqs:
            n = s.num_output_tokens
            n_out += n
            cached = max(cached, s.num_cached_prompt_tokens)
            preemptions += s.num_preemptions
            drafted += s.num_drafted_tokens
            accepted += s.num_accepted_tokens
            spec_steps += s.num_spec_steps
            t0, t1 = s.first_token_time, s.last_token_time
            if t0 is not None:
                first = t0 if first is None else min(first, t0)
                if t1 is not None and n > 1:
                    span_t += t1 - t0
                    span_n += n - 1
        m = RequestMetrics(arrival_time=req.arrival_time, finish_time=req.finish_time,
                           num_prompt_tokens=len(req.prompt_ids), num_output_tokens=n_out, num_cached_tokens=cached,
                           num_preemptions=preemptions, decode_flops=self.flops_per_token * n_out,
                           num_draft_tokens=drafted, num_accepted_tokens=accepted, num_spec_steps=spec_steps)
        if first is not None:
            m.first_token_time = first
            m.ttft = first - req.arrival_time
            if span_n:
                m.tpot = span_t / span_n
        return m


def _versions(req, seq) -> list | None:
    """A completion's per-token weight versions, when its request asks for them."""
    return list(seq.weight_versions) if req.params.return_weight_versions else None

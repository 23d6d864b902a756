"""Sampling: SamplingParams with all of its checks, the sampler, logits processors and structured output."""

"""Speculative decoding: a proposer drafts up to k tokens per decoding sequence, the target model scores them with
the sequence's last token in one forward (a k+1-token chunk), and verify.py keeps the longest run the target
distribution accepts plus one token of its own, so the output is what decoding without speculation would give
(greedy: the same tokens; sampled: the same distribution)."""

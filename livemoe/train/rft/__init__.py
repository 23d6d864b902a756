"""RFT (`python -m train.rft`, `livemoe rft`): rejection-sampling fine-tuning, stage 1 of the LiveThinking seed
(its section 4.1).

  1. teacher: k candidates per input at temperature τ (defaults 4 and 0.7, as in the seed)
  2. judge: correctness and helpfulness of each candidate
  3. select: at most one candidate per input that passes both (selected.jsonl)
  4. SFT: completion-only loss through the fused log-probs + λ_aux × the MoE load-balancing loss,
     AdamW with warm-up and cosine decay, gradient accumulation and clipping
  5. evaluate the student before and after on held-out inputs: a table shaped like the seed's Table 3

With no arguments it runs the embedded default (synthetic rooms, the scripted teacher, the rule-based
judge, the committed tiny student in livemoe/train/assets/student) in a few minutes on a laptop CPU.
Output dir: config.yaml, candidates.jsonl, selected.jsonl, selection.json, metrics.jsonl, curves.png,
curves_more.png, checkpoints/step-*/ (resume with --resume auto), final/ (HF layout), eval_table.md, eval.json;
with --eval_every N also heldout_candidates.jsonl, heldout_selected.jsonl, heldout_selection.json and an
eval_loss in metrics.jsonl every N steps (the seed's Figure 5 curves).

config.py holds its options (RFTConfig), trainer.py the run (teacher, judge, selection, SFT, evaluation), and
__main__.py the command; the SFT pieces it shares with MA-MSFT are livemoe.train.sft.
"""

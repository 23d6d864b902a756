"""GRPO, stage 2 of the LiveThinking seed (its section 4.2, Table 2): `python -m train.grpo [flags]`.

Each step: batch_size prompts -> K rollouts each from the engine's decoder running the very module
being trained (livemoe.train.rollout) -> rewards 0.4 correct + 0.3 helpful + 0.3 length (livemoe.train.rewards) ->
group-normalised advantages (livemoe.train.advantages) -> the decoder's KV cache is released -> μ optimiser
passes of the clipped policy loss (livemoe.train.losses) on the fused log-probs, with k3 KL (β) to the frozen
starting checkpoint and the MoE load-balancing loss (λ_aux). Multi-turn trajectories (--multi_turn)
get turn- and trajectory-level credit (LiveAssistant's streaming GSPO; use it with
--importance_sampling_level sequence).

With no arguments it is the embedded default: it continues from the RFT default's student (running
`livemoe.train.rft`'s default first when that is missing), trains on the synthetic live-commerce rooms, and
prints and saves a before/after table in the shape of the seed's Table 3 (livemoe.train.evaluate: eval_table.md,
eval.json; summary.json adds the TPR reduction and the quality changes in points).
Multi-turn data: a record of the seed's shape with `followups`, a list of later user turns (a string,
or {"question", "meta"?, "reference"?} so the judge can check each turn); each turn is judged as a
record whose history holds the trajectory's own earlier answers, with its own L_ref.
Precision: fp32 on the CPU; on a GPU --bf16 auto computes and decodes in bf16 while the optimizer updates
fp32 master weights with fp32 AdamW states (livemoe.train.precision; checkpoints hold the masters); there
`--old_logprobs trainer` takes old_logprobs from the trainer's own forward instead.
Everything is a --flag or a key of --config run.yaml (livemoe.train.config); checkpoints are atomic and
--resume auto continues exactly; the final model is exported in the HF layout to <output_dir>/final.
Under torchrun (livemoe.train.distributed) the policy and the reference are sharded (FSDP2, --expert_parallel); each rank
decodes its share of the step's prompts with a gathered inference copy of the policy (refreshed after each
update; bench/bench_rollout_weights.py measures it against decoding through the sharded module), the rewards are
joined for the advantages, and the loss is normalised over the global batch; checkpoints are sharded. Each rank
reads only its shards of the checkpoint (livemoe.train.parallel.sharded_load). With --rollout_url every rank sends
its prompts to the rollout servers and rank 0 pushes the new weights once to every replica
(livemoe.train.remote_rollout).

config.py holds its options (GRPOConfig), start.py where a run starts (the checkpoint, the records),
trainer.py the trainer (GRPOTrainer: the rollout phase, the update phase, evaluation, the loop),
async_rollouts.py the producer of --async_rollouts (rollouts of later steps while a step trains, with bounded
staleness and partial rollouts), and __main__.py the command.
"""

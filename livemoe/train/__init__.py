"""livemoe training: the trainers rft/, grpo/ and live/ (`python -m train.rft | train.grpo | train.live`), each a
config, a trainer and an entry point, and what they share (config.py's run options and CLI plumbing, data, judges,
rewards, losses, sft, rollouts, checkpoints, parallel/)."""

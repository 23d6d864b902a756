"""livemoe training: RFT (`python -m train.rft`) and GRPO (`python -m train.grpo`) and what they share."""

"""The decoder's step loop: engine config, scheduler, block manager, sequences, the model runner with its step
plan, and the tensor-parallel worker processes."""

"""livemoe kernels: each op beside its plain-PyTorch reference, with one dispatching entry per op."""

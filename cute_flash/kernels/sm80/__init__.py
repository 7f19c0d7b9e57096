"""Kernels on the SM80 instruction set (cp.async, ldmatrix, mma.sync), which every later GPU runs:
the forward and the backward (flash-attn 2's), the backward's preprocess and dQ convert (both
backwards' first and last steps) and the KV-cache append. Each module holds one kernel: its
frozen Config (the compile key), the kernel class, `entry(config)` and `fake_args(config)`."""

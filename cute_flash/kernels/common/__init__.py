"""Device building blocks every kernel shares: sequence and key-block bounds, score modifiers,
the online softmax, dropout's Philox, GEMM operands, tile copies, split-KV partials and merge,
dQaccum's layout, and the placeholders the kernels' `fake_args` build."""

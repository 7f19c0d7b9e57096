"""Stand-ins for `flash_attn_func` / `flash_attn_varlen_func` on any device, from
`cute_flash.reference`: what the CPU tests of the integrations run in place of the kernels, to
check everything around them. Each call is recorded by name in `calls`."""
from __future__ import annotations

from cute_flash.reference import attention_ref, attention_varlen_ref


class ReferenceKernels:
    def __init__(self):
        self.calls = []

    def func(self, q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
             deterministic=False, learnable_sink=None, **unused):
        assert dropout_p == 0.0 and not unused, (dropout_p, unused)
        self.calls.append("func")
        return attention_ref(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                             softcap=softcap, learnable_sink=learnable_sink)[0]

    def varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, deterministic=False,
                    learnable_sink=None, **unused):
        assert dropout_p == 0.0 and not unused, (dropout_p, unused)
        assert max_seqlen_q == int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        assert max_seqlen_k == int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max())
        self.calls.append("varlen")
        return attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=softmax_scale, causal=causal,
                                    window_size=window_size, softcap=softcap, learnable_sink=learnable_sink)[0]

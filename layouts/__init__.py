"""Compile-time design of the FA2 forward kernel: traits, swizzled smem, tiled copies, tiled MMA.

Everything except `traits` builds DSL objects and therefore runs only inside a
`@cute.jit` / `@cute.kernel` trace.
"""

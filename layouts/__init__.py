"""The compile-time design of the kernels, below every other layer (it imports nothing from
cute_flash): traits and tile heuristics (`traits`, `hopper`), swizzled shared memory (`smem`),
tiled copies (`copy`), tiled MMAs (`mma`), dQaccum's order (`dq`), dropout's Philox map
(`philox`, pure arithmetic), and the host-side checks of them all (`verify*`, reported by
`python -m cute_flash layouts`).

The layout builders make DSL objects and therefore run only inside a `@cute.jit` /
`@cute.kernel` trace; `traits`, `philox` and `dq.chunk_index` are plain Python.
"""

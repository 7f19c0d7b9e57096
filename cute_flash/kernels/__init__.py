"""CuTe DSL device code, no torch: `common/` (shared building blocks), `sm80/` and `sm90/`
(one module per kernel, with its config and fake arguments)."""

"""Hopper kernels (sm_90a: TMA, mbarrier pipelines, wgmma, warp specialisation): the forward and
the backward, each module with its Config, kernel, `entry(config)` and `fake_args(config)`,
and what they share (pipeline helpers, named barriers)."""

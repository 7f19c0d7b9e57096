"""Kernel configs to callable kernels: `registry` compiles any config for an arch, `cache` keeps
each (config, arch) compiled once, in memory and on disk."""

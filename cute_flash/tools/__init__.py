"""Tools around the library, the top layer (docs/architecture.md, "Layers"): the benchmarks
(`bench`, `held`), the tuning runs, the resource and occupancy reports, the sanitizer runs,
the training check and the layouts report, driven by `python -m cute_flash`."""

"""An H200's cluster occupancy: the split-heuristic tests' cases and the launcher tests' GPU."""

# Clusters of 1..8 CTAs an H200 runs at once, at one and two CTAs an SM (the driver's occupancy
# query, 2026-12-03; `launch.clusters`): the GPCs do not divide into clusters of 3 or of 5-8.
H200_CLUSTERS = {1: (132, 66, 39, 30, 22, 17, 15, 15), 2: (264, 132, 79, 62, 47, 39, 32, 30)}

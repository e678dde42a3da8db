"""The collect loop: session-aware stitching of turns into trajectories."""

"""The version registry: every policy version, its state and why, kept on the bus."""

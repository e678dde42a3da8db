"""Flywheel: continuous RL from an LLM agent's production traffic (serve, collect, judge, train).

Importing the package loads nothing: each loop imports what it runs, and the SWE sandbox code is
imported on its own by agents that run without torch.
"""

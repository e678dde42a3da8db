"""The judge loop: process-reward judges turning trajectories into scored samples."""

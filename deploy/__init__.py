"""Hosting the loops: Ray actors, the deployment lifecycle, `python -m deploy.up`, configs."""

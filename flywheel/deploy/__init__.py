"""Hosting the loops: Ray actors, the deployment lifecycle, `flywheel up`, configs."""

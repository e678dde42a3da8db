"""The benchmark scripts (bench/README.md): each runs as `python bench/NAME.py` or `python -m bench.NAME`
from the repository root; what they share is in `bench/lib/`."""

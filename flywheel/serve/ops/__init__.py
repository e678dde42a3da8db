"""Operating the gateway: API and admin keys, admission (body limit, concurrency, timeouts),
Prometheus metrics."""

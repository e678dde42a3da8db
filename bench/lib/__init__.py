"""What the benchmark scripts in `bench/` share; nothing here is a benchmark itself.

- `common`: the machine, CPU other processes used, percentiles, TPOT/TTFT, tables, result files.
- `workload`: seeded chat prompts, output lengths and training rows.
- `served`: a serve loop on a private bus, and the streaming client run as a child process.
- `stream_client`: that streaming client (a program of its own).
- `in_process_streams`: streams straight into an engine, in the server's own event loop.
- `route_load`: streamed requests over a chosen HTTP route, in a child process (engines).
- `hot_swap_analysis`: what a hot-swap run's records say (stalls, gaps, versions).
- `train_runs`: one `flywheel train` run and what it measured.
- `gpu_train`: the trainer's half of the GPU-path benchmark.
- `pii_requests`: seeded chat requests with personal data, for the PII-cost benchmark.
- `scripted_anthropic`, `claude_replay`: a scripted Messages server, and replaying what Claude
  Code sent it.
"""

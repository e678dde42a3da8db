"""Drills: Flywheel's loops run together, a scripted or simulated user talking to them through
the gateway, sometimes something done to them (a kill -9, a lost Ray node, a harmful version),
and a check of what came out. The benchmarks in `bench/` run them at size and keep the reports;
the tests run small ones. They drive several loops at once, so they live outside every loop.

- `cluster`, `agents`, `audit`, `fault`: the fault drill (the loops as killable processes, agents
  holding multi-turn sessions, the audit of streams and ledger); `ray_node`: the same agents and
  audit on a two-node Ray cluster losing the trainer's node.
- `tenant_load`, `tenant_audit`, `tenant_drill`: four tenants with mixed consent, storage and
  personal-data policies under the same kills, and an audit of every stream, file and token for
  what their policies keep out (issue 43).
- `noised_weights`: a harmful version to publish, for the promotion gate and canary.
- `mini_swe_agent`: mini-swe-agent's stock CLI working an SWE task through the endpoint.
- `simulated_people`, `personal_agent`: a person with a hidden preference talking to an agent,
  and the measures of whether it learned it.
"""

"""The rollout driver: environments turned into traffic through the serve endpoint, under staleness
admission. A client of serve like any agent (it speaks HTTP to the endpoint), hosted like a loop,
importing no loop."""

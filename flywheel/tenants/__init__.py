"""Tenants at run time, kept on the bus: the sessions each tenant has opened (`sessions`)."""

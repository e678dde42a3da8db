"""The promote loop: gates, canaries and rollbacks of weight and adapter versions, the version registry's
only writer."""

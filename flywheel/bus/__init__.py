"""The wire between the loops: record schemas, streams, the NATS connection, an embedded server.

This package and `flywheel/models/` are the only code the four loops share.
"""

from flywheel.bus.client import Bus, Consumer, Delivery
from flywheel.bus.embedded import EmbeddedNats, read_bus_url, start_bus
from flywheel.bus.records import (
    SCHEMA_VERSION,
    Record,
    Sample,
    Segment,
    SessionEvent,
    Timings,
    Trajectory,
    Turn,
    Unscored,
    WeightUpdate,
    decode,
    encode,
)
from flywheel.bus.streams import (
    SAMPLE_SUBJECT,
    SESSION_EVENT_SUBJECT,
    TRAFFIC_SUBJECTS,
    TRAJECTORY_SUBJECT,
    TURN_SUBJECT,
    UNSCORED_SUBJECT,
    WEIGHTS_SUBJECT,
)

__all__ = [
    "Bus", "Consumer", "Delivery", "EmbeddedNats", "read_bus_url", "start_bus",
    "SCHEMA_VERSION", "Record", "Sample", "Segment", "SessionEvent", "Timings", "Trajectory",
    "Turn", "Unscored", "WeightUpdate", "decode", "encode",
    "SAMPLE_SUBJECT", "SESSION_EVENT_SUBJECT", "TRAFFIC_SUBJECTS", "TRAJECTORY_SUBJECT", "TURN_SUBJECT",
    "UNSCORED_SUBJECT", "WEIGHTS_SUBJECT",
]

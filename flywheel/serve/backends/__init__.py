"""How the gateway reaches engines: SGLang's native protocol, over HTTP or handed to the embedded
engine in process, and the pool that routes sessions and rolls weight swaps across engines."""

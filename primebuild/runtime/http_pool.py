"""How long primebuild's HTTP clients keep an idle connection to a server (its own, vLLM's, a router).

uvicorn, under every server here (the embedded engine, the P/D router, vLLM's API server), closes a
connection that has been idle for 5 s (`timeout_keep_alive`), and httpx by default reuses one that has
been idle up to 5 s (`keepalive_expiry`). A request sent on a connection in the instant the server closes
it fails with a ReadError, which the orchestrator takes for a server that went away (it was seen doing so
in a run's first steps). Dropping idle connections well before the server does leaves no such race.
"""

from __future__ import annotations

import httpx

KEEPALIVE_EXPIRY_S = 2.0  # < uvicorn's 5 s


def pool_limits(connections: int) -> httpx.Limits:
    """At most `connections` connections, each kept while idle for KEEPALIVE_EXPIRY_S."""
    return httpx.Limits(max_connections=connections, max_keepalive_connections=connections,
                        keepalive_expiry=KEEPALIVE_EXPIRY_S)

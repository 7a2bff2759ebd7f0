"""kopf's HTTP session with a bounded connection pool.

kopf builds its aiohttp session with `TCPConnector(limit=0)`: one TLS connection per concurrent request, with
no bound. When 200 runs start at once, its patches, Events and lists open about a hundred connections to
the apiserver, each with its 256 KiB TLS buffers (26 MB at the peak, memray). The login handler returns the
same session kopf would build from the same credentials, with a limit: one connection for each watch stream
kopf holds open (they never give theirs back until renewed), plus a few for everything else, which queue
for a free connection instead of opening more.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import kopf

# Connections for kopf's requests besides its watches: patches, Events, the first LIST of each watch.
REQUEST_CONNECTIONS = 8
# The resources kopf watches cluster-wide (nodes, for the preflight): handlers.py.
CLUSTER_WATCHES = 1


def connection_limit(namespaces: list[str], namespaced_watches: int) -> int:
    """Watch streams (one per namespaced resource and namespace, one per cluster-wide resource) plus the
    request slots. Too few, and every patch and Event waits behind the watches until it times out."""
    return namespaced_watches * max(len(namespaces), 1) + CLUSTER_WATCHES + REQUEST_CONNECTIONS


def bounded_session(info: kopf.ConnectionInfo, limit: int) -> kopf.AiohttpSession:
    """kopf's own session for these credentials (auth/APIContext), bounded to `limit` connections. Called in
    the event loop (an async login handler): aiohttp binds the session to the running loop."""
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit, ssl=info.as_ssl_context()),
        headers=info.as_http_headers(),
        proxy=info.proxy_url,
        trust_env=info.trust_env,
    )
    return kopf.AiohttpSession(
        aiohttp_session=session,
        server=info.server,
        default_namespace=info.default_namespace,
        priority=info.priority,
        expiration=info.expiration,
    )


async def login(namespaces: list[str], namespaced_watches: int, **kwargs: Any) -> kopf.AiohttpSession | None:
    """The credentials kopf's `login_via_client` finds (the kubernetes client's: in-cluster service account,
    else KUBECONFIG), in a session bounded for `namespaced_watches` resources watched in each of `namespaces`.
    kopf calls it again when the apiserver answers 401."""
    info = kopf.login_via_client(**kwargs)
    limit = connection_limit(namespaces, namespaced_watches)
    return bounded_session(info, limit) if info is not None else None

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
# The resources kopf watches per namespace (runs, RayClusters, pods) and cluster-wide (nodes): handlers.py.
NAMESPACED_WATCHES = 3
CLUSTER_WATCHES = 1


def connection_limit(namespaces: list[str]) -> int:
    """Watch streams (one per resource and namespace, or per resource cluster-wide) plus the request slots."""
    return NAMESPACED_WATCHES * max(len(namespaces), 1) + CLUSTER_WATCHES + REQUEST_CONNECTIONS


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


async def login(namespaces: list[str], **kwargs: Any) -> kopf.AiohttpSession | None:
    """The credentials kopf's `login_via_client` finds (the kubernetes client's: in-cluster service account,
    else KUBECONFIG), in a bounded session. kopf calls it again when the apiserver answers 401."""
    info = kopf.login_via_client(**kwargs)
    return bounded_session(info, connection_limit(namespaces)) if info is not None else None

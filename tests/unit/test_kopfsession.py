"""kopf's session: the credentials kopf would use, with a bounded connection pool."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf
import pytest

from fsdp_operator import kopfsession


def test_the_pool_holds_every_watch_stream_and_a_few_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    found = kopf.ConnectionInfo(server="https://10.0.0.1:443", scheme="Bearer", token="abc", insecure=True)
    monkeypatch.setattr(kopf, "login_via_client", lambda **_: found)

    async def log_in() -> Any:
        credentials = await kopfsession.login(["team-a", "team-b"], logger=None)
        assert isinstance(credentials, kopf.AiohttpSession)
        session = credentials.aiohttp_session
        try:
            return credentials.server, session.connector.limit, dict(session.headers)  # type: ignore[union-attr]
        finally:
            await session.close()

    server, limit, headers = asyncio.run(log_in())
    assert server == "https://10.0.0.1:443"
    # Three watches per namespace (runs, RayClusters, pods), nodes cluster-wide, eight for requests.
    assert limit == 3 * 2 + 1 + 8 == kopfsession.connection_limit(["team-a", "team-b"])
    assert headers["Authorization"] == "Bearer abc"
    assert kopfsession.connection_limit([]) == 3 + 1 + 8

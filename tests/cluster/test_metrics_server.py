"""The operator's metrics served over HTTP (aiohttp on loopback), as Prometheus scrapes them."""

from __future__ import annotations

import asyncio
import re
import urllib.request

from fsdp_operator import metrics
from tests.support.metrics_index import RUNNING, Store, index_fixture  # noqa: F401 (a fixture)
from tests.support.net import free_port


def test_metrics_are_served_over_http(index: dict[tuple[str, str], Store]) -> None:
    index[("ml", "tiny")] = Store([RUNNING])
    port = free_port()

    async def scrape_once() -> tuple[str, str]:
        runner = await metrics.serve("127.0.0.1", port, leading=lambda: False)
        try:
            with await asyncio.to_thread(
                urllib.request.urlopen, f"http://127.0.0.1:{port}/metrics"
            ) as answer:
                return answer.headers["Content-Type"], answer.read().decode()
        finally:
            await runner.cleanup()

    content_type, text = asyncio.run(scrape_once())
    assert content_type.startswith("text/plain; version=0.0.4")
    assert (
        "fsdp_operator_leader 0.0" in text
        and 'fsdp_operator_run_step{name="tiny",namespace="ml"} 25.0' in text
    )
    tasks = re.search(r"^fsdp_operator_asyncio_tasks (\d+)", text, re.M)
    assert tasks and int(tasks.group(1)) >= 2, "the scrape's own task and the test's are on the loop"

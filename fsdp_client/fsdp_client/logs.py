"""A rank's log (or the Ray driver's) as the trainer streams it to S3, followed across the run's restarts."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from fsdp_client.errors import NotRecordedYet
from fsdp_client.storage import RunObjects
from fsdp_operator.api import FINISHED_PHASES
from fsdp_trainer.contract import driver_log_name, rank_log_name

FOLLOW_POLL_SECONDS = 2.0  # S3 reads while following; the trainer stores a rank's log every 15 s
FOLLOW_RUN_POLL_SECONDS = 10.0  # reads of the run while following: is it still active?


def new_output(printed: str, current: str) -> str:
    """What of `current` (the log as stored now) follows what has been printed. A capped log drops lines
    from its middle, so the continuation is found after the last line printed."""
    if current.startswith(printed):
        return current[len(printed) :]
    last_line = printed.rstrip("\n").rsplit("\n", 1)[-1]
    at = current.rfind(last_line) if last_line else -1
    if at < 0:
        return current
    return current[at + len(last_line) :].lstrip("\n")


def log_name(run: Mapping[str, Any], rank: int, attempt: int | None, driver: bool) -> str:
    """The log's name below the run's prefix: the given attempt's, else the run's latest."""
    attempt = attempt or (run.get("status") or {}).get("attempt") or 1
    return driver_log_name(attempt) if driver else rank_log_name(attempt, rank)


def is_active(run: Mapping[str, Any]) -> bool:
    return (run.get("status") or {}).get("phase") not in FINISHED_PHASES


def follow(
    objects: RunObjects,
    run: Mapping[str, Any],
    refresh_run: Callable[[], Mapping[str, Any]],
    *,
    rank: int = 0,
    attempt: int | None = None,
    driver: bool = False,
    keep_following: bool = True,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[str]:
    """The log as stored, then, while following, what is added to it (one piece per read, "" when nothing
    was) until the run has ended and its last lines are read. Without `attempt`, following moves on to the
    next attempt's log when the run restarts, after a line naming it."""
    name = log_name(run, rank, attempt, driver)
    text = objects.text(name)
    if text is None and not keep_following:
        raise NotRecordedYet(f"no log at {objects.bucket}/{objects.prefix}{name} (yet)")
    printed = text or ""
    yield printed
    checked = time.monotonic()
    while keep_following:
        ended = not is_active(run)
        sleep(FOLLOW_POLL_SECONDS)
        if time.monotonic() - checked >= FOLLOW_RUN_POLL_SECONDS or ended:
            run, checked = refresh_run(), time.monotonic()
        current_name = log_name(run, rank, attempt, driver)
        if current_name != name:  # a restart: the old attempt's last lines, then the new one's log
            yield new_output(printed, objects.text(name) or printed)
            yield f"\n[--- {current_name} ---]\n"
            name, printed = current_name, ""
        current = objects.text(name)
        if current is not None:  # not stored yet (a new attempt's first 15 s): nothing to print
            yield new_output(printed, current)
            printed = current
        if ended:
            return

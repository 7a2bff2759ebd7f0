"""Each rank's log in the run's storage, so that it outlives the Ray cluster, with Secret values redacted.

Every worker process sends its log records (its own and every library's, Python warnings included, each with
a UTC timestamp) to `<run>/logs/attempt-<n>/rank-<k>.log`. Object stores cannot append: a background thread
stores the whole (capped) file again when it has new lines, at most every `upload_seconds`, and at once when
the worker ends, fails or is told to flush. A worker that Ray Train restarts within the same attempt
continues the file it finds, so no earlier line is lost.

The values of the environment variables named secret (spec.runtimeEnv.secretEnv, the Ray token and the
usual credential variables) are replaced by `[NAME redacted]` in the rank logs and in what the process
writes to stdout and stderr, which is what Ray's driver log collects. Output written by native code straight
to the file descriptors bypasses Python and cannot be redacted here.
"""

from __future__ import annotations

import collections
import datetime as dt
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TextIO

from fsdp_trainer.background import BackgroundStore
from fsdp_trainer.contract import rank_log_name
from fsdp_trainer.storage import Location

log = logging.getLogger(__name__)

UPLOAD_SECONDS = 15.0  # the longest a line waits before it is in storage
# Per rank and attempt: the first HEAD_BYTES (setup, the first steps) and the newest TAIL_BYTES (the end, the
# failure) are kept; lines in between are counted in a marker line.
HEAD_BYTES = 2 << 20
TAIL_BYTES = 6 << 20
# Credentials that may be in any pod's environment, besides the names the run declares secret.
ALWAYS_SECRET_ENV = ("RAY_AUTH_TOKEN", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "HF_TOKEN")
MIN_SECRET_CHARS = 4  # shorter values ("1", "true") would blank out ordinary text without hiding anything
LINE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class Redactor:
    """Replaces the values of secret environment variables by their names."""

    def __init__(self, names: Iterable[str], environ: Mapping[str, str] = os.environ) -> None:
        found = {environ[name]: name for name in {*ALWAYS_SECRET_ENV, *names} if name in environ}
        # Longest first: a secret that contains another is replaced whole.
        self._values = sorted(
            ((value, name) for value, name in found.items() if len(value) >= MIN_SECRET_CHARS),
            key=lambda pair: -len(pair[0]),
        )

    def __call__(self, text: str) -> str:
        for value, name in self._values:
            if value in text:
                text = text.replace(value, f"[{name} redacted]")
        return text


class RedactingStream:
    """A text stream (stdout, stderr) that redacts what is written through it."""

    def __init__(self, stream: TextIO, redact: Redactor) -> None:
        self._stream = stream
        self._redact = redact

    def write(self, text: str) -> int:
        self._stream.write(self._redact(text))
        return len(text)

    def __getattr__(self, name: str) -> object:  # flush, fileno, isatty, encoding: the wrapped stream's
        return getattr(self._stream, name)


class _RedactingFilter(logging.Filter):
    def __init__(self, redact: Redactor) -> None:
        super().__init__()
        self._redact = redact

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = self._redact(record.getMessage())
        record.args = None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self._redact(record.exc_text)
        return True


def install_redaction(secret_env_names: Iterable[str]) -> Redactor:
    """Redacts this process's stdout, stderr and the log handlers it has now. Call before logging is set up
    (a handler made later writes to the redacting streams) and again when more names are known."""
    redact = Redactor(secret_env_names)
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if isinstance(stream, RedactingStream):
            stream = stream._stream
        setattr(sys, name, RedactingStream(stream, redact))
    for handler in logging.getLogger().handlers:
        handler.filters = [f for f in handler.filters if not isinstance(f, _RedactingFilter)]
        handler.addFilter(_RedactingFilter(redact))
    return redact


class _UtcFormatter(logging.Formatter):
    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(timespec="milliseconds")


class CappedText:
    """A log's text within a byte cap: the first `head_bytes`, then the newest lines up to `tail_bytes`."""

    def __init__(self, head_bytes: int = HEAD_BYTES, tail_bytes: int = TAIL_BYTES) -> None:
        self._head_bytes, self._tail_bytes = head_bytes, tail_bytes
        self._head: list[str] = []
        self._head_size = 0
        self._tail: collections.deque[str] = collections.deque()
        self._tail_size = 0
        self.dropped = 0  # lines left out between head and tail

    def add(self, line: str) -> None:
        size = len(line.encode())
        if not self._tail and self._head_size + size <= self._head_bytes:
            self._head.append(line)
            self._head_size += size
            return
        self._tail.append(line)
        self._tail_size += size
        while self._tail_size > self._tail_bytes and self._tail:
            self._tail_size -= len(self._tail.popleft().encode())
            self.dropped += 1

    def last(self, lines: int) -> str:
        """The newest `lines` lines."""
        kept = [*self._head, *self._tail] if not self.dropped else list(self._tail)
        return "".join(kept[-lines:])

    def text(self) -> str:
        marker = []
        if self.dropped:
            kept = f"its first {self._head_bytes} and last {self._tail_bytes} bytes"
            marker = [f"[... {self.dropped} lines left out: a rank's log keeps {kept} ...]\n"]
        return "".join([*self._head, *marker, *self._tail])


class RankLog(logging.Handler):
    """A logging handler that keeps the process's log lines and stores them at `target` in the background."""

    def __init__(
        self,
        target: Location,
        redact: Redactor,
        upload_seconds: float = UPLOAD_SECONDS,
        clock: Callable[[], float] = time.monotonic,  # the store's, for the upload interval
    ) -> None:
        super().__init__(level=logging.DEBUG)
        self.target = target
        self.setFormatter(_UtcFormatter(LINE_FORMAT))
        self.addFilter(_RedactingFilter(redact))
        self._text = CappedText()
        try:
            earlier = target.read_text() if target.is_file() else ""
        except OSError as error:  # the log must never stop training
            earlier = f"[earlier lines of this file unreadable: {error}]\n"
        for line in earlier.splitlines(keepends=True):
            self._text.add(line)
        self._store = BackgroundStore(
            "rank-log",
            self._text.text,
            target.write_text,
            self._report_upload_failure,
            upload_seconds,
            clock=clock,
        )
        self._store.start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + "\n"
        except Exception:
            self.handleError(record)
            return
        with self._store.lock:
            self._text.add(line)
            self._store.changed()

    def recent(self, lines: int = 40) -> str:
        """The newest lines this process logged."""
        with self._store.lock:
            return self._text.last(lines)

    def flush(self) -> None:
        """Stores what is new now and waits for it."""
        self._store.flush()  # a failure is already on stderr, and retried

    def close(self) -> None:
        """Stores the last lines and stops the thread; the handler is removed from wherever it was added."""
        self._store.close(timeout=120)
        super().close()

    def _report_upload_failure(self, error: Exception) -> None:
        # To stderr, not the log: a line logged here would be one more line to upload. Retried at the next
        # interval; never a reason to stop training.
        sys.stderr.write(f"cannot store the rank log at {self.target.uri}: {error}\n")


def start_rank_log(run: Location, attempt: int, rank: int, secret_env_names: Iterable[str]) -> RankLog:
    """Sends every log record of this process, Python warnings included, to the rank's log in storage."""
    redact = install_redaction(secret_env_names)
    handler = RankLog(run.child(rank_log_name(attempt, rank)), redact)
    logging.captureWarnings(True)
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(min(root.level or logging.INFO, logging.INFO))
    return handler


def stop_rank_log(handler: RankLog) -> None:
    logging.getLogger().removeHandler(handler)
    logging.captureWarnings(False)
    handler.close()

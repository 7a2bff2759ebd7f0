"""moto's request recording, read as its threaded server writes it."""

from __future__ import annotations

import base64
import json

import pytest

from tests.support.moto_recorder import parsed_recording


def _entry(method: str, url: str, body: bytes) -> str:
    return json.dumps(
        {
            "headers": {"Host": "198.18.1.1:27900"},
            "method": method,
            "url": url,
            "body": base64.b64encode(body).decode(),
            "body_encoded": True,
        }
    )


def test_two_requests_answered_at_once_on_one_line_are_both_read() -> None:
    # moto writes each entry, then its newline, with no lock: two uploads at once leave "AB\n\n".
    first, second = _entry("PUT", "/runs/a/shard-0", b"x" * 4096), _entry("PUT", "/runs/a/shard-1", b"y")
    recorded = parsed_recording(first + second + "\n\n" + _entry("POST", "/sts", b"Action=A") + "\n")
    assert [(r.method, r.url) for r in recorded] == [
        ("PUT", "/runs/a/shard-0"),
        ("PUT", "/runs/a/shard-1"),
        ("POST", "/sts"),
    ]
    assert recorded[0].body == b"x" * 4096


def test_a_request_still_being_written_is_left_for_the_next_read() -> None:
    whole, cut = _entry("GET", "/runs/a", b""), _entry("PUT", "/runs/b", b"z" * 100)[:50]
    assert [r.url for r in parsed_recording(whole + "\n" + cut)] == ["/runs/a"]


def test_a_damaged_entry_before_a_newline_is_an_error() -> None:
    with pytest.raises(json.JSONDecodeError):
        parsed_recording(_entry("GET", "/runs/a", b"")[:50] + "\n" + _entry("GET", "/runs/b", b"") + "\n")

"""--deadline and --for read into one unix time (producer/settings.py), refused when in the past, both, or unreadable."""
from __future__ import annotations

import datetime

import pytest

from producer.errors import UsageError
from producer.settings import _deadline, parse_duration

NOW = 1_800_000_000.0


def test_durations_read_days_hours_minutes_seconds() -> None:
    assert parse_duration("20h") == 72_000 and parse_duration("1h30m") == 5_400
    assert parse_duration("2d") == 172_800 and parse_duration("45s") == 45 and parse_duration("90m") == 5_400


def test_for_is_from_now_and_deadline_is_local_time_unless_it_has_an_offset() -> None:
    assert _deadline(None, "2h", NOW) == NOW + 7_200
    utc = datetime.datetime.fromtimestamp(NOW + 3_600, tz=datetime.timezone.utc).isoformat()
    assert _deadline(utc, None, NOW) == NOW + 3_600
    local = datetime.datetime.fromtimestamp(NOW + 60).strftime("%Y-%m-%dT%H:%M:%S")
    assert _deadline(local, None, NOW) == NOW + 60
    assert _deadline(None, None, NOW) is None


@pytest.mark.parametrize("deadline, duration, reason", [
    ("2020-01-01T00:00", None, "it is in the past"),
    ("tomorrow", None, "expected a date and time like"),
    (None, "soon", "expected a duration like 20h"),
    (None, "0h", "must be longer than 0"),
    ("2099-01-01T00:00", "2h", "give --deadline or --for, not both"),
])
def test_bad_deadlines_are_refused(deadline: str | None, duration: str | None, reason: str) -> None:
    with pytest.raises(UsageError) as exc:
        _deadline(deadline, duration, NOW)
    assert reason in str(exc.value)

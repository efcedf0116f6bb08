"""Redis replies as the tests' clients give them. The ``r`` fixture (tests/conftest.py) and ChaosStack.client leave
decode_responses off, so a reply's strings are bytes; redis-py types them ``bytes | str`` because it cannot tell.
These helpers narrow a reply to what the test knows it is, and fail on anything else (a missing key's None
included) rather than pass a wrong value on."""
from __future__ import annotations

from typing import Iterable

from redis.typing import StreamRangeResponse


def raw(value: object) -> bytes:
    """A reply value that must be there, as the bytes it is."""
    assert isinstance(value, bytes), f"expected a bytes reply, got {value!r}"
    return value


def text(value: object) -> str:
    """A reply value that must be there, decoded."""
    return raw(value).decode()


def texts(values: Iterable[object]) -> list[str]:
    """A reply's list of values (LRANGE, HKEYS, ZRANGE without scores), decoded, in reply order."""
    return [text(v) for v in values]


def entries(reply: StreamRangeResponse | None) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """An XRANGE reply as (entry id, fields) pairs: the stream must exist and every entry have its fields."""
    assert reply is not None, "no stream"
    out = []
    for eid, fields in reply:
        assert fields is not None, f"entry {eid!r} has no fields"
        out.append((raw(eid), {raw(k): raw(v) for k, v in fields.items()}))
    return out

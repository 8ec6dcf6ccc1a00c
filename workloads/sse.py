"""Server-sent events off a geventhttpclient response, stamped when
each socket read returns, before anything is parsed: a token's client time is when its bytes arrived, not
when the generator got round to it.

This reads the response's socket and its HTTP parser directly (geventhttpclient's `_sock`, `feed`,
`_body_buffer`): its public readers either wait for a fixed byte count or parse before the caller can stamp.
"""

from __future__ import annotations

import time
from collections.abc import Iterator


def arrivals(raw) -> Iterator[tuple[float, bytes]]:
    """(time.time() when the bytes arrived, the body bytes that read delivered), until the body ends."""
    stamp = time.time()
    while True:
        if raw._body_buffer:  # decoded body (chunked framing removed by the parser)
            data = bytes(raw._body_buffer)
            del raw._body_buffer[:]
            yield stamp, data
        if raw.message_complete:
            return
        sock = raw._sock
        chunk = sock.recv(raw.block_size) if sock is not None else b""
        stamp = time.time()
        if not chunk:
            raise ConnectionError("the server closed the connection mid-stream")
        raw.feed(chunk)


def events(raw) -> Iterator[tuple[float, bytes]]:
    """(arrival time, the data of one `data:` line) for each event, in order."""
    pending = b""
    for stamp, data in arrivals(raw):
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                yield stamp, line[5:].strip()

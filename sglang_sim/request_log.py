"""The request log (``--request-log PATH``): one JSON line per answered /generate, the server's own evidence.

A line: ``{"rid", "port", "input_ids" (or "input_text"), "output_ids", "text", "finish_reason",
"completion_tokens", "e2e_latency", "response_sent_to_client_ts"}``, the request's prompt and the body's fields as
sent (docs/simulator.md). The two timings (wall seconds from arrival to answer, and the unix time the answer left)
place each request in time: a bench reads its latency percentiles and how many ran at each moment from them.

Why the server writes it: a test of multi-turn regeneration must check what each turn's prompt really was (that it
carries the model's previous answer and none of the dataset's), and only the server sees the ids it was sent. A
client-side log would check the client against itself.

Each line is written with one ``write`` on a file opened ``O_APPEND``, so it is on disk (in the page cache: a
reader sees it) as soon as the answer leaves, a test can read the file while the server runs, and several
simulators may append to one file without tearing lines (``port`` says which server answered).
"""
from __future__ import annotations

import json
import os
from typing import Any


class RequestLog:
    """An append-only JSON-lines file of answered /generate requests."""

    def __init__(self, path: str) -> None:
        self.path = path
        # O_APPEND: every write lands at the current end, whoever else appends; 0o644 like any log.
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, *, rid: str, prompt: list[int] | str, body: dict[str, Any], port: int,
              sampling_params: dict[str, Any] | None = None) -> None:
        """One line for one answer: what was sent (``input_ids``, or ``input_text`` for a text prompt) and what
        the server answered (``output_ids``, ``text``, ``finish_reason``, ``completion_tokens``) and when
        (``e2e_latency``, ``response_sent_to_client_ts``)."""
        if self._fd is None:
            return
        meta = body["meta_info"]
        entry: dict[str, Any] = {"rid": rid, "port": port}
        entry["input_ids" if isinstance(prompt, list) else "input_text"] = prompt
        entry.update(output_ids=body["output_ids"], text=body["text"], finish_reason=meta["finish_reason"],
                     completion_tokens=meta["completion_tokens"], e2e_latency=meta["e2e_latency"],
                     response_sent_to_client_ts=meta["response_sent_to_client_ts"])
        if sampling_params is not None:  # what the request asked for (temperature, seed), as sent
            entry["sampling_params"] = sampling_params
        line = (json.dumps(entry, separators=(",", ":")) + "\n").encode()
        written = 0
        while written < len(line):  # a regular file takes it in one write; loop only for a short write
            written += os.write(self._fd, line[written:])

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

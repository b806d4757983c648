"""What a client and a warm engine say on the socket: JSON lines, one request per connection.

client `{"op": "ping"}` → `{"pid", "serves", "compiled", "requests"}` (its requests in flight);
client `{"op": "generate", "request": Request}` → `{"decline": why}` (a request it does not serve: the
client decodes in process) or `{"accepted": true}`, then `{"error": message}` (what `generate` would
have failed with), or one `{"prompt": i, "record", "summary", "warning"}` per prompt (its `generate`
report: JSON record, figures line, warning; in any order) and `{"done": true}`.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

from fastforward.cli.warm.spec import Serves

OPTION_TYPES = (bool, int, float, str)  # a decoder option's value (`fastforward.options.Knob`)


@dataclass(frozen=True)
class Request:
    """One `generate` command for an engine: what it asks of the engine (`serves`, checked against the
    engine's own), its prompts (read from the client's stdin already, where it gave none), and the flags
    of its decoding and its output. Checked when made: by the client, and by the engine from JSON."""

    serves: Serves
    prompts: tuple[str, ...]
    max_new_tokens: int
    batch_size: int
    decoder: str | None  # None: the model's own default (its decoding.json), else generate's
    options: Mapping[str, Any]  # the decoder options given (sampling's too), by knob name
    chat_template: bool
    json: bool
    stop: tuple[str, ...] = ()  # `--stop` strings

    def __post_init__(self) -> None:
        _check(isinstance(self.serves, Serves), "serves must be what an engine serves")
        _check(all(isinstance(p, str) for p in self.prompts), "prompts must be text")
        for name in ("max_new_tokens", "batch_size"):
            _check(type(getattr(self, name)) is int, f"{name} must be an integer")
        _check(self.batch_size >= 1, "batch_size must be at least 1")
        _check(self.decoder is None or isinstance(self.decoder, str), "decoder must be a name or null")
        _check(isinstance(self.options, Mapping), "options must be an object")
        plain = all(isinstance(k, str) and type(v) in OPTION_TYPES for k, v in self.options.items())
        _check(plain, "options must map names to plain values")
        _check(type(self.chat_template) is bool and type(self.json) is bool, "chat_template and json are booleans")
        _check(all(isinstance(s, str) for s in self.stop), "stop must be strings")

    @classmethod
    def from_json(cls, data: Any) -> Request:
        names = {f.name for f in fields(cls)}
        _check(isinstance(data, dict) and set(data) == names, f"a request is an object of {', '.join(sorted(names))}")
        _check(
            isinstance(data["prompts"], list) and isinstance(data["options"], dict) and isinstance(data["stop"], list),
            "prompts and stop: lists, options: an object",
        )
        given = {
            "serves": Serves.from_json(data["serves"]),
            "prompts": tuple(data["prompts"]),
            "stop": tuple(data["stop"]),
        }
        return cls(**{**data, **given})

    def as_json(self) -> dict[str, Any]:
        return {
            **{f.name: getattr(self, f.name) for f in fields(self)},
            "serves": self.serves.as_json(),
            "prompts": list(self.prompts),
            "options": dict(self.options),
            "stop": list(self.stop),
        }


def _check(holds: bool, problem: str) -> None:
    if not holds:
        raise ValueError(f"a bad request: {problem}")


def send(sock: socket.socket, message: Mapping[str, Any]) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def messages(sock: socket.socket) -> Iterator[dict[str, Any]]:
    """The JSON lines a connection receives, until it closes (ValueError: a line cut short)."""
    with sock.makefile("rb") as lines:
        for line in lines:
            yield json.loads(line)

"""Request bodies of ``/v1/completions`` and ``/v1/chat/completions``: checked, never trusted.

``parse_body(raw, chat)`` decodes the JSON once (msgspec, in C) into the few fields routing
reads, and raises ``BadRequest`` (one line, for a 400) when the body is not a JSON object, is
nested too deeply, or when a field routing reads has the wrong type: ``prompt`` must be a string,
a list of token ids, a list of strings or a list of token-id lists (token ids are integers in
[0, 2**32)); ``messages`` a list of objects; ``add_special_tokens`` true or false. Every other
field is left to the engine (the router relays the body's bytes as they came).

A long token-id prompt (over ``BIG_PROMPT_BYTES`` of JSON) is not decoded at once: decoding
millions of ids in one call holds the event loop for about a second per 30 MiB. It comes back
as a ``TokenIds`` whose ``read`` decodes and checks it in slices of ``SLICE_BYTES``, yielding to
the loop between slices, and keeps only the ids routing needs.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Iterator, Union

import msgspec

TOKEN_ID_LIMIT = 1 << 32
_TokenId = Annotated[int, msgspec.Meta(ge=0, lt=TOKEN_ID_LIMIT)]


class BadRequest(Exception):
    """A request body the router refuses (400); the message is one line for the client."""


_Prompt = Union[str, list[Union[_TokenId, str, list[_TokenId]]], None]
BIG_PROMPT_BYTES = 1 << 20
SLICE_BYTES = 256 << 10
_WHITESPACE = b" \t\r\n"


class _Completion(msgspec.Struct):
    prompt: msgspec.Raw = msgspec.Raw(b"null")
    add_special_tokens: bool = True


_PROMPT = msgspec.json.Decoder(_Prompt)
_IDS = msgspec.json.Decoder(list[_TokenId])


class TokenIds:
    """A long JSON list of token ids, checked and decoded by ``read`` (see the module docstring)."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    def slices(self) -> Iterator[bytes]:
        """The list cut at commas into JSON lists of about ``SLICE_BYTES`` each."""
        raw = self.raw
        pos, end = raw.index(b"[") + 1, raw.rindex(b"]")
        while pos < end:
            cut = min(pos + SLICE_BYTES, end)
            if cut < end:
                comma = raw.rfind(b",", pos, cut)
                cut = comma if comma > pos else (raw.find(b",", cut, end) if raw.find(b",", cut, end) > 0 else end)
            yield b"[" + raw[pos:cut] + b"]"
            pos = cut + 1

    async def read(self, keep: int) -> tuple[list[int], int]:
        """(the first ``keep`` ids, how many there are); BadRequest at the first bad one."""
        head: list[int] = []
        total = 0
        for piece in self.slices():
            try:
                ids = _IDS.decode(piece)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                message = _first_line(exc).split(" - at ")[0]
                raise BadRequest(f"request body: {message} - in `$.prompt` (after {total} token ids)") from exc
            if len(head) < keep:
                head.extend(ids[:keep - len(head)])
            total += len(ids)
            await asyncio.sleep(0)  # let the loop serve others between slices
        return head, total


def _decode_prompt(raw: bytes) -> Any:
    """A prompt's JSON: decoded and checked, or a ``TokenIds`` when it is a long list of ids."""
    if len(raw) > BIG_PROMPT_BYTES and raw[:1] == b"[" and raw[1:64].lstrip(_WHITESPACE)[:1] not in (b"[", b'"'):
        return TokenIds(raw)
    try:
        prompt = _PROMPT.decode(raw)
    except msgspec.ValidationError as exc:
        message = _first_line(exc)
        message = message.replace("`$", "`$.prompt") if "`$" in message else message + " - at `$.prompt`"
        raise BadRequest(f"request body: {message}") from exc
    if isinstance(prompt, list) and prompt and len({type(p) for p in prompt}) > 1:
        raise BadRequest(f"request body: prompt must be {_PROMPT_KINDS}, not a mix - at `$.prompt`")
    return prompt


class _Chat(msgspec.Struct):
    messages: Union[list[dict[str, Any]], None] = None


_DECODERS = {False: msgspec.json.Decoder(_Completion), True: msgspec.json.Decoder(_Chat)}
_PROMPT_KINDS = "a string, a list of token ids, a list of strings or a list of token-id lists"


def parse_body(raw: bytes, chat: bool) -> dict[str, Any]:
    """The routing fields of a request body (``prompt``/``add_special_tokens`` or ``messages``,
    None ones left out; a long token-id ``prompt`` is a ``TokenIds``); BadRequest when the body
    is malformed (see the module docstring)."""
    try:
        parsed = _DECODERS[chat].decode(raw)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"request body: {_first_line(exc)}") from exc
    except msgspec.DecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {_first_line(exc)}") from exc
    except RecursionError as exc:
        raise BadRequest("request body is nested too deeply") from exc
    if chat:
        return {} if parsed.messages is None else {"messages": parsed.messages}
    out: dict[str, Any] = {"add_special_tokens": parsed.add_special_tokens}
    if bytes(parsed.prompt) != b"null":
        prompt = _decode_prompt(bytes(parsed.prompt))
        if prompt is not None:
            out["prompt"] = prompt
    return out


def _first_line(exc: Exception) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:300]


__all__ = ["BadRequest", "TokenIds", "parse_body", "TOKEN_ID_LIMIT"]

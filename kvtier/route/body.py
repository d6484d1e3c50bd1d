"""Request bodies of ``/v1/completions`` and ``/v1/chat/completions``: checked, never trusted.

``parse_body(raw, chat)`` decodes the JSON once (msgspec, in C) into the few fields routing
reads, and raises ``BadRequest`` (one line, for a 400) when the body is not a JSON object, is
nested too deeply, or when a field routing reads has the wrong type: ``prompt`` must be a string,
a list of token ids, a list of strings or a list of token-id lists (token ids are integers in
[0, 2**32)); ``messages`` a list of objects; ``add_special_tokens`` true or false. Every other
field is left to the engine (the router relays the body's bytes as they came).
"""

from __future__ import annotations

from typing import Annotated, Any, Union

import msgspec

TOKEN_ID_LIMIT = 1 << 32
_TokenId = Annotated[int, msgspec.Meta(ge=0, lt=TOKEN_ID_LIMIT)]


class BadRequest(Exception):
    """A request body the router refuses (400); the message is one line for the client."""


class _Completion(msgspec.Struct):
    prompt: Union[str, list[Union[_TokenId, str, list[_TokenId]]], None] = None
    add_special_tokens: bool = True


class _Chat(msgspec.Struct):
    messages: Union[list[dict[str, Any]], None] = None


_DECODERS = {False: msgspec.json.Decoder(_Completion), True: msgspec.json.Decoder(_Chat)}
_PROMPT_KINDS = "a string, a list of token ids, a list of strings or a list of token-id lists"


def parse_body(raw: bytes, chat: bool) -> dict[str, Any]:
    """The routing fields of a request body (``prompt``/``add_special_tokens`` or ``messages``,
    None ones left out); BadRequest when the body is malformed (see the module docstring)."""
    try:
        parsed = _DECODERS[chat].decode(raw)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"request body: {_first_line(exc)}") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {_first_line(exc)}") from None
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None
    if chat:
        return {} if parsed.messages is None else {"messages": parsed.messages}
    prompt = parsed.prompt
    if isinstance(prompt, list) and prompt:
        kinds = {type(p) for p in prompt}
        if len(kinds) > 1:
            raise BadRequest(f"request body: prompt must be {_PROMPT_KINDS}, not a mix - at `$.prompt`")
    out: dict[str, Any] = {"add_special_tokens": parsed.add_special_tokens}
    if prompt is not None:
        out["prompt"] = prompt
    return out


def _first_line(exc: Exception) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:300]


__all__ = ["BadRequest", "parse_body", "TOKEN_ID_LIMIT"]

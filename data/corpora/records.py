"""Records to conversations: role and reasoning normalisation, strict and tolerant."""

from __future__ import annotations

from typing import Any

from eyas.data.corpora.config import REASONING_KEYS, ROLE_ALIASES, RecordError, SourceConfig
from eyas.data.types import Conversation


# ---------------------------------------------------------------------------------------------------------------
# records → conversations
# ---------------------------------------------------------------------------------------------------------------
def _text(value: Any, what: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # OpenAI content parts: [{"type": "text", "text": ...}]
        parts = [p.get("text", "") for p in value if isinstance(p, dict) and p.get("type", "text") == "text"]
        if len(parts) == len(value):
            return "".join(parts)
    raise RecordError(f"{what} must be a string (or a list of text parts), not {type(value).__name__}")


def normalize_message(m: Any) -> dict[str, Any]:
    """``{role, content, reasoning?}`` from a docs/DESIGN.md-style or ShareGPT-style message."""
    if not isinstance(m, dict):
        raise RecordError(f"a message must be an object, not {type(m).__name__}")
    raw_role = m.get("role", m.get("from"))
    if raw_role is None:
        raise RecordError(f"message without `role` (or `from`): keys {sorted(m)}")
    role = ROLE_ALIASES.get(str(raw_role).lower())
    if role is None:
        raise RecordError(f"unknown role {raw_role!r}; known roles: {', '.join(sorted(ROLE_ALIASES))}")
    content = _text(m.get("content", m.get("value")), "message content")
    out: dict[str, Any] = {"role": role, "content": content}
    for k in REASONING_KEYS:
        if m.get(k):
            out["reasoning"] = _text(m[k], "reasoning")
            break
    return out


def conversation_from_record(
    rec: Any,
    *,
    source: str,
    fallback_id: str,
    src: SourceConfig | None = None,
) -> Conversation:
    """Turn one record into a :class:`Conversation` (raises :class:`RecordError` if it cannot)."""
    if not isinstance(rec, dict):
        raise RecordError(f"a record must be an object, not {type(rec).__name__}")
    id_field = src.id_field if src else "id"
    rid = rec.get(id_field)
    cid = str(rid) if rid is not None and str(rid) != "" else fallback_id
    mfield = src.messages_field if src else None
    candidates = [mfield] if mfield else ["conversations", "messages"]
    msgs_raw = next((rec[k] for k in candidates if k in rec), None)
    if msgs_raw is not None:
        if not isinstance(msgs_raw, list):
            raise RecordError(f"`{candidates[0]}` must be a list of messages, not {type(msgs_raw).__name__}")
        messages = [normalize_message(m) for m in msgs_raw]
    elif src is not None and src.prompt_field:
        if src.prompt_field not in rec:
            raise RecordError(f"no `{src.prompt_field}` field (keys: {sorted(rec)})")
        messages = []
        if src.system_field and rec.get(src.system_field):
            messages.append({"role": "system", "content": _text(rec[src.system_field], src.system_field)})
        messages.append({"role": "user", "content": _text(rec[src.prompt_field], src.prompt_field)})
        if src.response_field and rec.get(src.response_field) is not None:
            a = {"role": "assistant", "content": _text(rec[src.response_field], src.response_field)}
            if src.reasoning_field and rec.get(src.reasoning_field):
                a["reasoning"] = _text(rec[src.reasoning_field], src.reasoning_field)
            messages.append(a)
    else:
        raise RecordError(
            f"no message list (looked for {candidates}; keys: {sorted(rec)}); map the fields "
            "with messages_field or prompt_field/response_field"
        )
    meta = rec.get("meta") if isinstance(rec.get("meta"), dict) else {}
    return Conversation(id=cid, messages=messages, source=source, meta=dict(meta))


def prompt_only(conv: Conversation) -> Conversation:
    """The conversation's system and user turns (assistant turns removed, kept in ``meta['reference']``)."""
    refs = [m["content"] for m in conv.messages if m["role"] == "assistant"]
    meta = dict(conv.meta)
    if refs:
        meta.setdefault("reference", refs)
    msgs = [dict(m) for m in conv.messages if m["role"] != "assistant"]
    return Conversation(id=conv.id, messages=msgs, source=conv.source, meta=meta)

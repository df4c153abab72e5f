"""A chat prompt's conversation, read back from its rendering, so that a drafting model with another chat
template (ChatML vs Gemma's turns) sees the same conversation in its own template.

A template is not invertible in general; what is done here is exact or nothing: the markers around each
turn are learnt by rendering a probe conversation with placeholder contents, the prompt is split at them,
and the split is kept only if rendering it again gives the prompt back character for character. Anything
else (a plain prompt, a template that does not alternate user and assistant) gives None, and the drafter
reads the prompt's text as it is.
"""

from __future__ import annotations

from collections.abc import Callable

Render = Callable[[list[dict]], str]  # messages -> text, with the generation prompt

_PLACEHOLDERS = ("\x01", "\x02", "\x03")


def conversation_of(text: str, render: Render) -> list[dict] | None:
    """The turns (a system turn or none, then user and assistant turns alternating, user first and last)
    whose rendering is exactly `text`."""
    turns = _alternating(text, render)
    if turns is None and (system := _system_markers(render)) is not None:
        system_head, to_user, head = system
        if text.startswith(system_head) and (at := text.find(to_user, len(system_head))) >= 0:
            rest = _alternating(head + text[at + len(to_user) :], render)
            turns = rest and [{"role": "system", "content": text[len(system_head) : at]}, *rest]
    try:
        return turns if turns and render(turns) == text else None
    except Exception:  # a template may refuse a conversation (raise_exception)
        return None


def _alternating(text: str, render: Render) -> list[dict] | None:
    probe = _probe(render, ("user", "assistant", "user"))
    if probe is None:
        return None
    head, to_assistant, to_user, tail = probe
    if not (to_assistant and to_user and text.startswith(head) and text.endswith(tail)):
        return None
    body = text[len(head) : len(text) - len(tail)]
    contents: list[str] = []
    separators = (to_assistant, to_user)
    while (at := body.find(separators[len(contents) % 2])) >= 0:
        contents.append(body[:at])
        body = body[at + len(separators[len(contents) % 2 - 1]) :]
    contents.append(body)
    if len(contents) % 2 == 0:
        return None  # the prompt ends with an assistant turn, not with the generation prompt
    return [{"role": ("user", "assistant")[i % 2], "content": c} for i, c in enumerate(contents)]


def _system_markers(render: Render) -> tuple[str, str, str] | None:
    """(text before a system turn's content, text between it and the user turn's, text before a first user
    turn's content without a system turn)."""
    with_system, alone = _probe(render, ("system", "user")), _probe(render, ("user",))
    if with_system is None or alone is None or not with_system[1] or with_system[0] == alone[0]:
        return None
    return with_system[0], with_system[1], alone[0]


def _probe(render: Render, roles: tuple[str, ...]) -> list[str] | None:
    """The template's text around placeholder contents for these roles, or None."""
    try:
        rendered = render([{"role": role, "content": p} for role, p in zip(roles, _PLACEHOLDERS)])
    except Exception:
        return None
    if any(rendered.count(p) != 1 for p in _PLACEHOLDERS[: len(roles)]):
        return None
    parts = [rendered]
    for p in _PLACEHOLDERS[: len(roles)]:
        parts[-1:] = parts[-1].split(p)
    return parts

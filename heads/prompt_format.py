"""How a target renders chats: its own template, a recipe's (`target.chat_template`, a Jinja string
or file), or none (plain text, for base models), and the template's arguments
(`target.chat_template_kwargs`).  Kept on the tokenizer, which data, evaluation and bench all render
through (data/chat.py: render)."""
from __future__ import annotations

from pathlib import Path

PLAIN = "none"      # target.chat_template: none renders turns as plain text (base models)
PLAIN_SEPARATOR = "\n\n"


def apply_chat_settings(tokenizer, template: str | None, kwargs: dict | None) -> None:
    """How every verb renders chats for this target (target.chat_template, target.chat_template_kwargs):
    kept on the tokenizer, which data, evaluation and bench all render through."""
    if template == PLAIN:
        tokenizer.draftsmith_plain_text = True
    elif template:
        path = Path(template).expanduser()
        tokenizer.chat_template = path.read_text() if "{" not in template and path.is_file() else template
    tokenizer.draftsmith_template_kwargs = dict(kwargs or {})

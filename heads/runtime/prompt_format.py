"""How a target renders chats: its own template, a recipe's (`target.chat_template`, a Jinja string
or file), or none (plain text, for base models), and the template's arguments
(`target.chat_template_kwargs`).  Kept on the tokenizer, which data, evaluation and bench all render
through (data/chat.py: render)."""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import jinja2.sandbox

log = logging.getLogger(__name__)

PLAIN = "none"      # target.chat_template: none renders turns as plain text (base models)
PLAIN_SEPARATOR = "\n\n"


class TemplateError(ValueError):
    """A target.chat_template that is not a template: a missing file, or Jinja that does not compile."""


TEMPLATE_SYNTAX = ("{{", "{%")
TEMPLATE_LIMIT = 1 << 20       # the largest chat templates shipped with models are tens of KiB


def template_text(template: str, where: str = "target.chat_template") -> str:
    """The Jinja source `template` stands for: the text itself when it holds template syntax ({{ or {%),
    else the file it names, which must exist and hold a template.  Either is compiled here, in the sandbox
    transformers renders with, so a syntax error is named before anything loads."""
    if len(template) > TEMPLATE_LIMIT:
        raise TemplateError(f"{where} is {len(template) >> 10} KiB of text: a chat template is at most "
                            f"{TEMPLATE_LIMIT >> 20} MiB (real ones are tens of KiB); give the template itself")
    if any(mark in template for mark in TEMPLATE_SYNTAX):
        source, origin = template, "the inline template"
    else:
        path = Path(template).expanduser()
        if path.is_dir():
            raise TemplateError(f"{where} '{template}' is a directory: give the template file in it (a .jinja "
                                "file), an inline Jinja template, or none (plain text, for base models)")
        if path.is_file() and path.stat().st_size > TEMPLATE_LIMIT:
            raise TemplateError(f"{where} '{template}' is {path.stat().st_size >> 20} MiB: a chat template is at "
                                f"most {TEMPLATE_LIMIT >> 20} MiB (real ones are tens of KiB); is it the right file?")
        if not path.is_file():
            raise TemplateError(f"{where} '{template}' is neither a file nor a template: no such file, and no "
                                "{{ or {% in it; give an existing .jinja file, an inline Jinja template, or none "
                                "(plain text, for base models)")
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise TemplateError(f"{where} '{path}' cannot be read as UTF-8 text ({err}); give a .jinja file") from None
        origin = f"'{path}'"
        if not any(mark in source for mark in TEMPLATE_SYNTAX):
            raise TemplateError(f"{where} {origin} holds no template syntax ({{{{ or {{%): it would render every "
                                "prompt as its text; give a Jinja chat template")

    try:
        jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).parse(source)
    except jinja2.TemplateSyntaxError as err:
        raise TemplateError(f"{where}: {origin} is not valid Jinja at line {err.lineno}: {err.message}; fix the "
                            "template") from None
    return source


def apply_chat_settings(tokenizer, template: str | None, kwargs: dict | None) -> None:
    """How every verb renders chats for this target (target.chat_template, target.chat_template_kwargs):
    kept on the tokenizer, which data, evaluation and bench all render through."""
    if template == PLAIN:
        tokenizer.draftsmith_plain_text = True
    elif template:
        tokenizer.chat_template = template_text(template)
    tokenizer.draftsmith_template_kwargs = dict(kwargs or {})
    if template != PLAIN:
        warn_if_reasoning_is_ignored(tokenizer, template)


THINKING_KWARGS = ("enable_thinking", "thinking", "reasoning_effort")
REASONING_MARKS = ("<think>", "analysis", "reasoning")
_warned: set[str] = set()


def warn_if_reasoning_is_ignored(tokenizer, template: str | None) -> None:
    """Template arguments that ask for reasoning, given to a template with no reasoning marker in it (it
    cannot act on them): a warning naming the template, once per template."""
    asked = {k: v for k, v in tokenizer.draftsmith_template_kwargs.items() if k in THINKING_KWARGS and v}
    source = getattr(tokenizer, "chat_template", None)
    if not asked or not isinstance(source, str) or any(mark in source for mark in REASONING_MARKS):
        return
    digest = hashlib.sha256(source.encode()).hexdigest()
    if digest in _warned:
        return
    _warned.add(digest)
    name = (f"target.chat_template '{template[:60]}'" if template and not any(m in template for m in TEMPLATE_SYNTAX)
            else "target.chat_template (inline)" if template
            else f"the chat template of '{getattr(tokenizer, 'name_or_path', '?')}'")
    log.warning("target.chat_template_kwargs ask for reasoning (%s), but %s has no reasoning marker (%s): it "
                "renders the same prompts either way, so the data will not hold the reasoning asked for; give a "
                "reasoning template (target.chat_template) or drop the argument",
                ", ".join(f"{k}={v!r}" for k, v in asked.items()), name, ", ".join(REASONING_MARKS))

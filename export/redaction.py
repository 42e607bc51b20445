"""What `draftsmith push` removes from the text it uploads, by structure where there is one.

Every text file push uploads is written by draftsmith for the upload from a parsed structure
(export/hub.py): the recipe from its typed settings, config.json and last_eval.json from their JSON,
the card from those cleaned files.  `clean` walks a parsed value:

- a key that names a secret (`api_key`, `hf_token`, `password`, ...) loses its value whatever its form
  (a string with spaces, commas or `#`, a YAML block or folded scalar, a number, a list, a mapping), at
  any depth of YAML or JSON;
- every string is scanned as free text (`clean_text`): the shapes of known secrets (Hugging Face,
  OpenAI, AWS, W&B, GitHub, Slack, JWT, PEM private keys, credentials in a URL), a secret written as
  `key: value` or `key=value` inside it (the rest of its line goes), and absolute local paths, `file:`
  URLs and `host:/path` forms (their last part is kept).

Each removal is listed by file and key (or shape), never with its value.  The scan is linear in the
text: every pattern's repetition is bounded, and a PEM block is found with `str.find`.
"""
from __future__ import annotations

import re
from pathlib import Path

from .staging import REDACTED, last_part, scrub

SECRET_KEY = re.compile(r"(?i)^(?:.*[_-])?(api[_-]?key|apikey|token|access[_-]?token|auth[_-]?token|hf[_-]?token|"
                        r"password|passwd|passphrase|secret|secret[_-]?key|client[_-]?secret|access[_-]?key(?:[_-]id)?|"
                        r"secret[_-]?access[_-]?key|private[_-]?key|credentials?|cookie|authorization)$")
NOT_SECRET = re.compile(r"(?i)(^|[_-])(pad|bos|eos|unk|mask|sep|cls|ptd|start|end|special|chat|new|draft)[_-]?token$")

SECRET_SHAPES = (
    ("a Hugging Face token", re.compile(r"\bhf_[A-Za-z0-9]{30,200}")),
    ("an OpenAI key", re.compile(r"\bsk-(?:proj-|svcacct-|live_|test_)?[A-Za-z0-9_-]{20,300}")),
    ("a Stripe-style key", re.compile(r"\b(?:sk|rk|pk)_(?:live|test)_[A-Za-z0-9]{8,200}")),
    ("an AWS access key", re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b")),
    ("a W&B key", re.compile(r"\bwandb_v\d_[A-Za-z0-9_]{20,200}")),
    ("a GitHub token", re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{30,255}|github_pat_[A-Za-z0-9_]{22,255})")),
    ("a Slack token", re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,255}")),
    ("a JSON web token", re.compile(r"\beyJ[A-Za-z0-9_-]{5,4000}\.[A-Za-z0-9_-]{5,4000}\.[A-Za-z0-9_-]{5,4000}")),
    ("a password in a URL", re.compile(r"(?<=://)[^\s/:@]{1,256}:[^\s/@]{1,256}(?=@)")),
)
W_AND_B_HEX = re.compile(r"\b(?:local-)?[0-9a-f]{40}\b")       # a W&B key is 40 hex digits, near "wandb"
KEY_IN_TEXT = re.compile(r"(?i)(?<![\w-])(?P<key>[A-Za-z_][\w.-]{0,60})[\"']?[ \t]{0,8}[:=][ \t]{0,8}(?=\S)")
PEM_BEGIN, PEM_END = "-----BEGIN ", "-----END "
# local paths beyond staging.scrub's: file: URLs and host:/path (scp and NFS forms)
FILE_URL = re.compile(r"(?i)\bfile:(?://[^\s\"'<>/]{0,255})?(?P<path>/[^\s\"'<>]{0,4096})")
HOST_PATH = re.compile(r"(?<![\w/:.-])[\w.-]{1,255}:(?P<path>/(?!/)[^\s\"'`<>|,;]{0,4096})")


def is_secret_key(key: str) -> bool:
    return bool(SECRET_KEY.match(key)) and not NOT_SECRET.search(key)


def clean(value, file: str, found: list[str], checkpoint: Path, where: str = ""):
    """`value` (parsed YAML or JSON) with every secret and local path removed; each removal appended to `found`."""
    if isinstance(value, dict):
        out = {}
        for key, inner in value.items():
            name = f"{where}.{key}" if where else str(key)
            if is_secret_key(str(key)) and inner is not None and not isinstance(inner, bool):
                found.append(f"{file}: the value of '{name}'")
                out[key] = REDACTED
            else:
                out[key] = clean(inner, file, found, checkpoint, name)
        return out
    if isinstance(value, list):
        return [clean(inner, file, found, checkpoint, f"{where}[{i}]") for i, inner in enumerate(value)]
    if isinstance(value, str):
        return clean_text(value, f"{file}: '{where}'" if where else file, found, checkpoint)
    return value


def clean_text(text: str, place: str, found: list[str], checkpoint: Path) -> str:
    """Free text with secret shapes, `key: value` secrets and local paths removed (see the module docstring)."""
    text = _pem_blocks(text, place, found)
    for kind, pattern in SECRET_SHAPES:
        text, count = pattern.subn(REDACTED, text)
        found.extend([f"{place}: {kind}"] * count)
    if "wandb" in text.lower():
        text, count = W_AND_B_HEX.subn(REDACTED, text)
        found.extend([f"{place}: a W&B key"] * count)
    text = _key_values(text, place, found)
    text = FILE_URL.sub(lambda m: last_part(m.group("path")), text)
    text = HOST_PATH.sub(lambda m: m.group(0)[: m.start("path") - m.start()] + last_part(m.group("path")), text)
    return scrub(text, checkpoint)


def _pem_blocks(text: str, place: str, found: list[str]) -> str:
    """Every PEM private key block, from its BEGIN line to its END line (or to the end of the text)."""
    parts, start = [], 0
    while (begin := text.find(PEM_BEGIN, start)) >= 0:
        line_end = text.find("-----", begin + len(PEM_BEGIN))
        header = text[begin:line_end] if line_end >= 0 else ""
        if "PRIVATE KEY" not in header:
            parts.append(text[start:begin + len(PEM_BEGIN)])
            start = begin + len(PEM_BEGIN)
            continue
        end = text.find(PEM_END, line_end)
        close = text.find("-----", end + len(PEM_END)) if end >= 0 else -1
        stop = len(text) if close < 0 else close + 5
        parts.append(text[start:begin] + REDACTED)
        found.append(f"{place}: a PEM private key")
        start = stop
    parts.append(text[start:])
    return "".join(parts)


def _key_values(text: str, place: str, found: list[str]) -> str:
    """A secret written as `key: value` (or `key=value`) inside free text: the rest of its line goes, so a
    value with spaces, commas or `#` goes whole."""
    out, start = [], 0
    for m in KEY_IN_TEXT.finditer(text):
        if m.start() < start or not is_secret_key(m.group("key")):
            continue
        end = text.find("\n", m.end())
        end = len(text) if end < 0 else end
        value = text[m.end():end].strip().strip("\"',")
        if value.lower() in ("", "null", "none", "~", "true", "false", REDACTED.lower()):
            continue
        out.append(text[start:m.end()] + REDACTED)
        found.append(f"{place}: the value of '{m.group('key')}'")
        start = end
    out.append(text[start:])
    return "".join(out)

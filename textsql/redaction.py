"""What counts as a secret: names and values never forwarded to another process, printed, or logged to a tracker."""

from __future__ import annotations

import re

# A name that looks like it holds a credential is never forwarded and never printed, whatever an allowlist says:
# TOKEN (not TOKENIZERS_...), SECRET, PASSW(ORD), PASSPHRASE, CREDENTIAL, PRIVATE, AUTH, COOKIE anywhere in it, KEY at the end of a word
# (HF_KEY, APIKEY, AWS_ACCESS_KEY_ID), and PWD, PASS, PAT as a word of it (TEXTSQL_DB_PWD, DB_PASS, GITHUB_PAT).
SECRET = re.compile(
    r"TOKEN(?!IZER)|SECRET|PASSW|PASSPHRASE|CREDENTIAL|PRIVATE|AUTH|COOKIE|KEYS?(?:_|$)|(?:^|_)(?:PWD|PASS|PAT)(?:_|$)",
    re.IGNORECASE,
)
# Nor is a value holding a URL with credentials in it (scheme://user:password@host, scheme://token@host), or a
# connection string's or query's password, token or signature ("host=db password=...", "...?sig=...&token=...").
URL_CREDENTIALS = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s@]+@", re.IGNORECASE)
VALUE_CREDENTIALS = re.compile(r"(?:^|[\s;&?,-])(?:passw(?:or)?d|pwd|secret|token|sig|signature|api_?key)\s*[=:]", re.I)


def is_secret(name: str, value: str = "") -> bool:
    return bool(SECRET.search(name) or URL_CREDENTIALS.search(value) or VALUE_CREDENTIALS.search(value))

"""Secrets kept out of what kvtune prints: the one way a URL is shown in an error or a log line.

A URL a user types can carry a credential (`http://admin:pw@host`, `redis://:pw@host`,
`https://…?X-Amz-Signature=…`, `?token=…`). Every place that quotes a URL back — error lines
for `--upstream`, `bench`/`calibrate` URLs, log inputs by URL, the shared ledger's Redis URL —
passes it through `redact` first, so a password never reaches a terminal, a CI log or a report.
Files kvtune renders for a deployment are not shown text: they carry what the user gave.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

#: Query keys whose values are masked (AWS/Azure signatures, tokens, API keys, passwords).
_SECRET_KEYS = re.compile(r"sig|token|secret|key|credential|password|passwd|auth", re.IGNORECASE)
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://\S+")


def redact(url: str) -> str:
    """The URL as kvtune shows it: a password in it (`user:***@`), a bare userinfo, which is
    usually a token (`***@`), and secret-looking query values (`token=***`) masked."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return _mask_unparsed(url)
    netloc = parts.netloc
    if "@" not in netloc and not parts.query:
        return url  # nothing to mask (and memory:///a stays as written)
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        netloc = (userinfo.split(":", 1)[0] + ":***@" if ":" in userinfo else "***@") + host
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, "***" if _SECRET_KEYS.search(k) else v) for k, v in pairs], safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _mask_unparsed(text: str) -> str:
    """A URL urlsplit refuses (an unclosed `[`): any userinfo and the whole query masked."""
    scheme, sep, rest = text.partition("://")
    _, at, host = rest.rpartition("@")
    host, question, _ = host.partition("?")
    return f"{scheme}{sep}{'***@' if at else ''}{host}{'?***' if question else ''}"


def redact_in(text: str) -> str:
    """`text` with every URL in it redacted (a foreign library's message that quotes one)."""
    return _URL_IN_TEXT.sub(lambda m: redact(m.group(0)), text)


__all__ = ["redact", "redact_in"]

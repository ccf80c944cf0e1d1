"""`nmt serve`'s API keys: read from a file or NMT_API_KEYS, compared in constant time."""

from __future__ import annotations

import hmac

from nmt_cli.errors import NmtError


def read_api_keys(path: str | None, environment: str | None) -> tuple[str, ...]:
    """API keys from a file (one per line; blank lines and # comments skipped) and from NMT_API_KEYS (comma or
    space separated); one-line NmtError for a missing file or one without keys."""
    keys: list[str] = []
    if path is not None:
        from nmt_cli.textio import read_lines

        lines = [line.strip() for line in read_lines(path)]
        found = [line for line in lines if line and not line.startswith("#")]
        if not found:
            raise NmtError(f"{path}: no API keys in it (one key per line)")
        keys += found
    if environment:
        keys += environment.replace(",", " ").split()
    return tuple(keys)


def authorized(header: str | None, keys: tuple[str, ...]) -> bool:
    """Whether an Authorization header carries one of `keys` as a Bearer token; every key is compared, in
    constant time, whatever matches."""
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        return False
    given = token.strip().encode()
    return sum(hmac.compare_digest(given, key.encode()) for key in keys) > 0

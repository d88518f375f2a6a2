"""Sealed records: JSON with an HMAC-SHA256 over the key it is stored under and its text.

What every record a process acts on carries (control/transport.py puts them into the store, control/attempt.py into
the run directory): a value moved to another key, or written without the key, is refused. No torch here, so the
requeue wrapper (launch/requeue.py) reads a record without importing it.
"""

from __future__ import annotations

import hashlib
import hmac
import json


class Forged(ValueError):
    """A store value that is not this run's: unsealed, sealed with another secret, or moved from another key."""


def seal(secret: bytes, key: str, record: dict) -> str:
    """``record`` as the value of ``key``: JSON with an HMAC over the key and the JSON text."""
    body = json.dumps(record, sort_keys=True, separators=(",", ":"))
    return json.dumps({"mac": _mac(secret, key, body.encode()), "body": body})


def unseal(secret: bytes, key: str, raw: bytes | str) -> dict:
    """The record sealed as ``key``'s value; raises Forged for anything else."""
    try:
        sealed = json.loads(raw)
        body, mac = sealed["body"], sealed["mac"]
        genuine = isinstance(body, str) and isinstance(mac, str) and hmac.compare_digest(
            mac, _mac(secret, key, body.encode()))
    except (ValueError, TypeError, KeyError, AttributeError):
        genuine = False
    if not genuine:
        raise Forged(f"{key}: not sealed with this run's secret (written by a process outside the run, or copied "
                     "from another key)")
    return json.loads(body)


def _mac(secret: bytes, key: str, body: bytes) -> str:
    return hmac.new(secret, key.encode() + b"\n" + body, hashlib.sha256).hexdigest()

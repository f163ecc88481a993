"""Whether this process's Dask security settings can reach a scheduler address.

Checked before connecting, so a ``tls://`` address without the TLS settings (or a plain
``tcp://`` one while encryption is required) is one clear error naming the config keys
to set, not "not a scheduler address" or a traceback from deep inside distributed. Used
by the command line, :func:`pipeline.cluster.attach` and ``CaptureClient.connect``.
"""
from __future__ import annotations

from typing import Any

TLS_KEYS = ("distributed.comm.tls.ca-file", "distributed.comm.tls.client.cert", "distributed.comm.tls.client.key")
REQUIRE_ENCRYPTION_KEY = "distributed.comm.require-encryption"
_TLS_FIX = (
    f"set the Dask config keys {TLS_KEYS[0]}, {TLS_KEYS[1]} and {TLS_KEYS[2]} to the cluster's CA and this client's "
    "certificate and key (env DASK_DISTRIBUTED__COMM__TLS__CA_FILE, ..._TLS__CLIENT__CERT, ..._TLS__CLIENT__KEY), "
    f"and {REQUIRE_ENCRYPTION_KEY}: true to refuse plain tcp"
)


def check_scheduler_security(address: str | None) -> None:
    """Refuse, before connecting, a scheduler address this process's Dask security
    settings cannot reach: ``tls://`` without a CA file and client certificate (or with
    one that is not a file), or a plain ``tcp://`` one while
    ``distributed.comm.require-encryption`` is on. Raises
    :class:`~tasks.errors.InvalidSchedulerAddress` naming the config keys to set."""
    if not address:
        return
    from distributed.comm.addressing import parse_address
    from distributed.security import Security

    from tasks.errors import InvalidSchedulerAddress

    try:
        scheme = parse_address(str(address))[0]
    except ValueError:  # malformed: scheduler_address (or the connect itself) says so
        return
    security = Security()
    if scheme == "tls":
        problem = _tls_settings_problem(security)
        if problem:
            raise InvalidSchedulerAddress(f"{address!r} is a TLS address, which needs the TLS security settings, but {problem}; {_TLS_FIX}")
    elif scheme == "tcp" and security.require_encryption:
        raise InvalidSchedulerAddress(
            f"{address!r} is plain tcp but {REQUIRE_ENCRYPTION_KEY} is true; pass the scheduler's tls:// address "
            f"with the TLS security settings ({', '.join(TLS_KEYS)}), or set {REQUIRE_ENCRYPTION_KEY}: false"
        )


def _tls_settings_problem(security: Any) -> str | None:
    """What is wrong with the client's TLS settings (unset keys, paths that are not
    files), or None. A value holding a newline is PEM text, not a path."""
    import os

    values = dict(zip(TLS_KEYS, (security.tls_ca_file, security.tls_client_cert, security.tls_client_key)))
    missing = [key for key in TLS_KEYS[:2] if not values[key]]
    if missing:
        return f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set"
    for key, value in values.items():
        if value and "\n" not in str(value) and not os.path.isfile(value):
            return f"{key} {value!r} is not a file"
    return None

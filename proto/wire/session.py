"""What a session carries on the wire besides its messages: the metadata keys of its token and
of its proof key, and the protocol version that client and daemon exchange when a session opens.

The client states ``PROTOCOL_VERSION`` in ``Hello``; the daemon states its own in
``SessionOpened``. Each side checks the other's with ``version_mismatch`` and refuses a
different one (FAILED_PRECONDITION) instead of misreading its messages. This module holds no
session state and imports neither the daemon nor the client.
"""

from __future__ import annotations

# The call metadata key that carries a session's token (the secret from SessionOpened).
SESSION_METADATA = "x-broker-session"
# The call metadata key that carries the session's proof key: a second secret the broker
# hands only to the session's owner process, on the fd channel (its reply header's "key"),
# once that process has presented the token there. A token alone acts for no session.
KEY_METADATA = "x-broker-key"

# Raised whenever a message's meaning changes in a way the other side would misread (a field
# reused, a unit changed, a layout rule changed); adding an optional field does not need it.
# 0 on the wire means "not stated": a daemon older than the exchange, or a hand-made client.
# 2: the fd channel sends one fd per page on a CUDA arena (per slab on a host arena) and asks
# for units by first and count (version 1: slabs from_slab..end).
# 3: every session-bearing call carries the session's proof key (KEY_METADATA), which the fd
# channel gives the owner process; a version-2 client sends none and would be refused.
PROTOCOL_VERSION = 3


def session_metadata(token: str, key: str) -> tuple[tuple[str, str], ...]:
    """The metadata to send with every call of the session whose token is ``token`` and whose
    proof key (from the fd channel) is ``key``."""
    return ((SESSION_METADATA, token), (KEY_METADATA, key))


def version_mismatch(peer_version: int, *, peer: str, mine: str, ours: int = 0) -> str | None:
    """Why a peer speaking ``peer_version`` cannot be served, or None when it can.

    Args:
        peer_version: the version the other side stated (0: it stated none).
        peer, mine: how to name the other side and this one in the message ("the broker at
            /run/b.sock", "this client").
        ours: this side's version (default: ``PROTOCOL_VERSION``).
    """
    ours = ours or PROTOCOL_VERSION
    if peer_version == ours:
        return None
    stated = f"speaks protocol version {peer_version}" if peer_version else "states no protocol version (it is older)"
    return (
        f"{peer} {stated} and {mine} speaks version {ours}; they would misread each other's messages: "
        "run a client and a broker from the same memory-broker release"
    )

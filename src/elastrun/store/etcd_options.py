"""The etcd store's options: its default client port, and the ``--rdzv-conf``
keys it reads (TLS files, user and password, a key prefix, the protocol),
typed once where the settings are resolved (``launcher/rdzv_conf``,
``elastrun status``) and checked by the store when it opens
(:func:`elastrun.store.etcd_conn.settings_from_options`). Apart from the
etcd store so that reading them needs no httpx."""

from __future__ import annotations

from elastrun.frozen import frozen

__all__ = ["DEFAULT_ETCD_PORT", "EtcdOptions"]

DEFAULT_ETCD_PORT = 2379  # etcd's client port


@frozen
class EtcdOptions:
    """The etcd store's options (``--rdzv-conf`` keys; None: not given)."""

    cacert: str | None = None  # TLS: the CA, the client's certificate and key
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None
    key_prefix: str | None = None
    protocol: str | None = None  # http | https

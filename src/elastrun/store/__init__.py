"""The coordination store: an etcd-shaped interface and its implementations.

``open_store(backend, endpoint, ...)`` (in :mod:`elastrun.store.factory`) picks
an implementation from a ``--rdzv-backend`` name. The interface and its values
are :mod:`elastrun.store.base`'s; each implementation is imported from its own
module, so that an agent loads only the store it uses.
"""

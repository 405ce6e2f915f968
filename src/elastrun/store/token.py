"""The embedded store's token: where it comes from, read safely.

Every command that talks to the store (the launcher, ``elastrun status``,
``elastrun store serve``) takes the token from the first of:

1. ``--rdzv-conf token=T`` (``elastrun store serve``: none): visible in ``ps``;
2. ``--rdzv-conf token_file=PATH`` (``elastrun store serve --token-file``);
3. the environment variable :data:`TOKEN_ENV` (``ELASTRUN_STORE_TOKEN``);
4. the environment variable :data:`TOKEN_FILE_ENV` (``ELASTRUN_STORE_TOKEN_FILE``),
   a file's path.

Neither environment variables nor files appear in ``ps``; a file suits
SLURM (a file only the user can read) and Kubernetes (a Secret mounted as a
file, or given as the variable). A token file is read without following a
link, never blocking on a FIFO, and bounded in size; one that is missing,
empty, not a regular file, too large or readable by every user is refused
with a message naming the file and the fix (:func:`read_token_file`).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping

from elastrun.errors import ConfigError
from elastrun.frozen import frozen
from elastrun.safefs import UnsafePath, read_regular
from elastrun.store.limits import MAX_TOKEN

__all__ = [
    "TOKEN_ENV",
    "TOKEN_FILE_ENV",
    "StoreToken",
    "no_token_warning",
    "read_token_file",
    "store_token",
]

# Names of environment variables, not secrets.
TOKEN_ENV = "ELASTRUN_STORE_TOKEN"  # noqa: S105
TOKEN_FILE_ENV = "ELASTRUN_STORE_TOKEN_FILE"  # noqa: S105
# A token file holds one token (at most MAX_TOKEN bytes) and perhaps a line break.
_FILE_LIMIT = 4096


@frozen
class StoreToken:
    """The token (None: none given) and where it came from, for messages."""

    token: str | None
    source: str = "none"


def read_token_file(path: str, what: str) -> str:
    """The token in the file ``path`` (surrounding white space removed).
    ``what`` names where the path was given (``--rdzv-conf token_file``).
    Raises ConfigError naming the file and what is wrong with it."""
    shown = f"{what} {path!r}"
    full = os.path.expanduser(path)
    try:
        st = os.lstat(full)
    except OSError as exc:
        raise ConfigError(f"{shown} cannot be read: {exc.strerror or exc}") from None
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(
            f"{shown} is a symbolic link; give the file itself ({what}=$(readlink -f "
            f"{path})), or on Kubernetes mount the Secret with subPath or pass it as "
            f"{TOKEN_ENV}"
        )
    if stat.S_ISREG(st.st_mode) and st.st_mode & stat.S_IROTH:
        raise ConfigError(
            f"{shown} is readable by every user (mode {stat.S_IMODE(st.st_mode):o}): anyone "
            f"on this machine could join the job; chmod o-r {path} (on Kubernetes: the "
            "Secret volume's defaultMode: 0400 or 0440)"
        )
    try:
        data = read_regular(full, _FILE_LIMIT)
    except UnsafePath as exc:
        raise ConfigError(f"{shown}: {exc.problem}; a token file is a small regular file") from None
    except OSError as exc:
        raise ConfigError(f"{shown} cannot be read: {exc.strerror or exc}") from None
    try:
        token = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ConfigError(f"{shown} is not UTF-8 text") from None
    if not token:
        raise ConfigError(f"{shown} is empty")
    if len(token.encode("utf-8")) > MAX_TOKEN:
        raise ConfigError(f"{shown} holds a token longer than {MAX_TOKEN} bytes")
    return token


def store_token(
    token: str | None,
    token_file: str | None,
    environ: Mapping[str, str] | None = None,
    *,
    flag: str = "--rdzv-conf",
) -> StoreToken:
    """The token from the first source given (see the module docstring):
    ``token`` and ``token_file`` as given on the command line (``flag``
    names them in messages), then the environment. Raises ConfigError."""
    env = os.environ if environ is None else environ
    if token is not None and token_file is not None:
        raise ConfigError(f"{flag}: give token or token_file, not both")
    if token is not None:
        return StoreToken(_checked(token, f"{flag} token"), f"{flag} token")
    if token_file is not None:
        where = f"{flag} token_file" if flag == "--rdzv-conf" else flag
        return StoreToken(read_token_file(token_file, where), f"{where} {token_file}")
    value, path = env.get(TOKEN_ENV), env.get(TOKEN_FILE_ENV)
    if value is not None and path is not None:
        raise ConfigError(f"both {TOKEN_ENV} and {TOKEN_FILE_ENV} are set: unset one")
    if value is not None:
        return StoreToken(_checked(value.strip(), TOKEN_ENV), TOKEN_ENV)
    if path is not None:
        if not path:
            raise ConfigError(f"{TOKEN_FILE_ENV} is set but empty")
        return StoreToken(read_token_file(path, TOKEN_FILE_ENV), f"{TOKEN_FILE_ENV} {path}")
    return StoreToken(None)


def _checked(token: str, what: str) -> str:
    if not token:
        raise ConfigError(f"{what} is empty")
    if len(token.encode("utf-8", "surrogatepass")) > MAX_TOKEN:
        raise ConfigError(f"{what} is longer than {MAX_TOKEN} bytes")
    return token


def no_token_warning(how: str) -> str:
    """The line printed when a store without a token listens beyond loopback;
    ``how`` says how this command takes a token."""
    return (
        "the rendezvous store has no token and listens beyond loopback: anyone who can "
        "reach its port can join the job and steer it; set a token with "
        f"{how} (the same on every node; an environment variable or a file keeps it out of ps)"
    )

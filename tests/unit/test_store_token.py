"""The store's token: from the command line, the environment or a file, and
token files an unlucky operator or another user could get wrong (missing,
empty, a FIFO, a link, huge, readable by everyone): each refused at once with
a message naming the file and the fix."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from elastrun.errors import ConfigError
from elastrun.launcher.config import LaunchConfig
from elastrun.launcher.plan import resolve
from elastrun.store.token import TOKEN_ENV, TOKEN_FILE_ENV, read_token_file, store_token


def private(path: Path, text: str | bytes) -> Path:
    if isinstance(text, str):
        text = text.encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(text)
    return path


def test_sources_in_order(tmp_path: Path) -> None:
    a = private(tmp_path / "a", "from-conf-file\n")
    b = private(tmp_path / "b", "  from-env-file  \n")
    env = {TOKEN_ENV: "from-env", TOKEN_FILE_ENV: str(b)}
    assert store_token("from-conf", None, env).token == "from-conf"
    assert store_token(None, str(a), env).token == "from-conf-file"
    assert store_token(None, None, {TOKEN_ENV: "from-env"}) == store_token(
        None, None, {TOKEN_ENV: " from-env\n"}
    )
    got = store_token(None, None, {TOKEN_FILE_ENV: str(b)})
    assert (got.token, got.source) == ("from-env-file", f"{TOKEN_FILE_ENV} {b}")
    assert store_token(None, None, {}).token is None
    with pytest.raises(ConfigError, match=f"both {TOKEN_ENV} and {TOKEN_FILE_ENV}"):
        store_token(None, None, env)
    with pytest.raises(ConfigError, match=f"{TOKEN_ENV} is empty"):
        store_token(None, None, {TOKEN_ENV: " "})
    with pytest.raises(ConfigError, match="longer than 1024 bytes"):
        store_token(None, None, {TOKEN_ENV: "x" * 1025})


def _fifo(path: Path) -> Path:
    os.mkfifo(path, 0o600)
    return path


def _link(path: Path) -> Path:
    target = private(path.with_name("target"), "t")
    path.symlink_to(target)
    return path


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (lambda p: p, "cannot be read: No such file or directory"),
        (lambda p: private(p, ""), "is empty"),
        (lambda p: private(p, " \n\n"), "is empty"),
        (_fifo, "is a FIFO, not a regular file"),
        (_link, "is a symbolic link; give the file itself"),
        (lambda p: (p.mkdir(mode=0o700), p)[1], "is a folder, not a regular file"),
        (lambda p: private(p, "x" * 5000), "is larger than 4096 bytes"),
        (lambda p: private(p, "x" * 1025), "longer than 1024 bytes"),
        (lambda p: private(p, b"\xff\xfe"), "is not UTF-8 text"),
    ],
    ids=["missing", "empty", "blank", "fifo", "link", "folder", "huge", "long", "binary"],
)
def test_bad_token_files_are_refused_naming_the_file(tmp_path, make, problem) -> None:
    path = make(tmp_path / "token")
    done: list[BaseException] = []

    def read() -> None:
        try:
            read_token_file(str(path), "--rdzv-conf token_file")
        except BaseException as exc:
            done.append(exc)

    reader = threading.Thread(target=read, daemon=True)  # a FIFO must not block it
    reader.start()
    reader.join(10)
    assert done, "reading the token file blocked"
    assert isinstance(done[0], ConfigError)
    message = str(done[0])
    assert f"--rdzv-conf token_file {str(path)!r}" in message and problem in message


def test_a_token_file_others_can_read_is_refused_a_group_readable_one_is_not(
    tmp_path: Path,
) -> None:
    path = private(tmp_path / "token", "s3cret\n")
    path.chmod(0o644)
    with pytest.raises(ConfigError, match=r"readable by every user \(mode 644\).*chmod o-r"):
        read_token_file(str(path), TOKEN_FILE_ENV)
    path.chmod(0o640)
    assert read_token_file(str(path), TOKEN_FILE_ENV) == "s3cret"


def test_the_launcher_takes_the_environment_for_the_embedded_store_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TOKEN_ENV, "env-token")
    c10d = LaunchConfig(min_nodes=1, max_nodes=2, rdzv_backend="c10d", rdzv_endpoint="h:1")
    plan = resolve(c10d)
    assert (plan.token, plan.token_source, plan.authenticated) == ("env-token", TOKEN_ENV, True)
    # etcd authenticates with its own user/password: the store token is not sent to it.
    etcd = LaunchConfig(min_nodes=1, max_nodes=2, rdzv_backend="etcd", rdzv_endpoint="h:1")
    assert resolve(etcd).token is None and not resolve(etcd).authenticated
    user = LaunchConfig(
        min_nodes=1,
        max_nodes=2,
        rdzv_backend="etcd",
        rdzv_endpoint="h:1",
        rdzv_configs={"user": "u", "password": "p"},
    )
    assert resolve(user).authenticated
    monkeypatch.delenv(TOKEN_ENV)
    assert not resolve(c10d).authenticated
    monkeypatch.setenv(TOKEN_FILE_ENV, str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match=f"{TOKEN_FILE_ENV} '.*nope' cannot be read"):
        resolve(c10d)

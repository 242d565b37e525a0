"""Secrets off the command line: bearer tokens from a file or the environment, the Redis URL
and its password from the environment (docs/api.md, "Tokens and secrets").

`ps` (any user of the machine) reads every process's command line; a process's environment
(`/proc/<pid>/environ`) only its own user and root read. So:

* `--token-file PATH`: one token spec a line, as `--token` takes it
  (`SECRET[,role=R][,workspace=PATH]`); blank lines and `#` comments are skipped. A file that
  its group or others may read or write is refused, as ssh refuses such a private key: a
  warning in a JSON log goes unseen, the token is a bearer credential, and the fix is one
  `chmod 600` (a Kubernetes secret volume: `defaultMode: 0400`).
* `ACP_STATE_TOKENS`: the same lines, in one variable (newline-separated, not
  whitespace-separated: a `workspace=` path may hold a space).
* `ACP_STATE_REDIS_URL`: the whole Redis URL, when `--redis-url` is not given.
* `ACP_STATE_REDIS_PASSWORD`: the password of the URL's user (`redis://worker@host:6379/0`),
  when the URL holds none.

Once read, the variables leave the process's environment (`scrub_environment`), so the
agent children a worker spawns, which inherit its environment, never hold them. They run as
the worker's user, though, and could read the worker's own initial environment
(`/proc/<worker>/environ`, which an unsetenv does not change) or its memory: a worker that
holds a Redis password makes itself non-dumpable (`shield`), which leaves those to root.
"""

from __future__ import annotations

import ctypes
import os
import stat
import sys
from urllib.parse import quote, urlsplit, urlunsplit

TOKENS_VARIABLE = "ACP_STATE_TOKENS"
REDIS_URL_VARIABLE = "ACP_STATE_REDIS_URL"
REDIS_PASSWORD_VARIABLE = "ACP_STATE_REDIS_PASSWORD"
SECRET_VARIABLES = (TOKENS_VARIABLE, REDIS_URL_VARIABLE, REDIS_PASSWORD_VARIABLE)


class SecretError(ValueError):
    """A secret given in a way acp-state refuses (the message says which and why)."""


def spec_lines(text: str) -> list[str]:
    """The token specs of a token file or of ACP_STATE_TOKENS: one a line, blank lines and
    `#` comments skipped."""
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def read_token_file(path: str) -> list[str]:
    """The specs of a token file, refusing one its group or others may read or write."""
    try:
        with open(path, encoding="utf-8") as file:
            mode = os.fstat(file.fileno()).st_mode
            if mode & 0o077:
                raise SecretError(
                    f"--token-file {path} is open to its group or others (mode {stat.S_IMODE(mode):04o}): "
                    f"chmod 600 it"
                )
            return spec_lines(file.read())
    except OSError as error:
        raise SecretError(f"--token-file {path}: {error.strerror}") from None


def token_specs(given: list[str], files: list[str], environ: dict[str, str] | os._Environ[str]) -> list[str]:
    """Every token spec: `--token`s, then each `--token-file`'s, then ACP_STATE_TOKENS's."""
    specs = list(given)
    for path in files:
        specs += read_token_file(path)
    specs += spec_lines(environ.get(TOKENS_VARIABLE, ""))
    return specs


def redis_url(given: str | None, environ: dict[str, str] | os._Environ[str]) -> str | None:
    """The Redis URL: `--redis-url`, else ACP_STATE_REDIS_URL; with ACP_STATE_REDIS_PASSWORD
    put in as the password of its user when set (a URL that holds a password of its own as
    well is refused: which one is meant?)."""
    url = given or environ.get(REDIS_URL_VARIABLE) or None
    password = environ.get(REDIS_PASSWORD_VARIABLE)
    if url is None or not password or url.startswith("memory://"):
        return url
    parts = urlsplit(url)
    if parts.password is not None:
        raise SecretError(f"both the Redis URL and {REDIS_PASSWORD_VARIABLE} give a password: give one")
    user = parts.username or ""
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{parts.netloc.rpartition('@')[2]}"
    return urlunsplit(parts._replace(netloc=netloc))


def url_password(url: str) -> bool:
    """Whether a URL carries a password (a `--redis-url` that does puts it in `ps`)."""
    return urlsplit(url).password is not None


def redacted(url: str) -> str:
    """The URL with its password (if any) masked, for what the process prints and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user, _, host = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{user.partition(':')[0]}:***@{host}"))


def shield() -> None:
    """Make this process non-dumpable (Linux): its `/proc/<pid>/environ`, `mem` and the like
    become root's, and no process of its user (an agent's tool call) may ptrace it. Reset by
    exec, so the agents it spawns stay ordinary (the reaper reads their environment)."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0


def scrub_environment() -> None:
    """Drop the secret variables from this process's environment, so no child inherits them."""
    for name in SECRET_VARIABLES:
        os.environ.pop(name, None)

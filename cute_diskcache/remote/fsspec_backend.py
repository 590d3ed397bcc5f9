"""Object stores and directories through fsspec: ``s3://``, ``gs://``, ``az://`` (with s3fs,
gcsfs, adlfs installed), ``file://`` and ``memory://`` (what the tests can run here).

One object per entry at ``<url path>/<name>``. An object store's PUT is atomic, so a reader
sees a whole object or none. A local or mounted directory (``file://``) is not: there the
bytes go to a temporary name first and are renamed into place. "Only if absent" is a check
before the write: two publishers racing on one name may both write, which is harmless, as any
valid copy of an entry is as good as another (entries are verified on fetch, not trusted).
fsspec gives no portable socket timeout; the caller's deadline bounds every call.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

from . import RemoteError, redact


class FsspecBackend:
    def __init__(self, url: str, *, timeout: float) -> None:
        try:
            import fsspec
        except ImportError as exc:
            raise RemoteError(f"remote URL needs fsspec ({exc}); pip install 'cute-diskcache[remote]'") from None
        try:
            fs, path = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as exc:  # an unknown scheme, or its package missing
            raise RemoteError(f"cannot open remote {redact(url)!r}: {exc}") from None
        self._fs: Any = fs
        self._base = str(path).rstrip("/")
        protocol = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        self._local = "file" in protocol or "local" in protocol
        self._timeout = timeout

    def _path(self, name: str) -> str:
        return f"{self._base}/{name}"

    def get(self, name: str) -> bytes | None:
        try:
            return bytes(self._fs.cat_file(self._path(name)))
        except FileNotFoundError:
            return None
        except Exception as exc:  # each filesystem raises its own kinds
            raise RemoteError(f"{type(exc).__name__}: {exc}") from None

    def put(self, name: str, data: bytes, *, only_if_absent: bool) -> bool:
        path = self._path(name)
        try:
            if only_if_absent and self._fs.exists(path):
                return False
            if self._local:
                parent = path.rsplit("/", 1)[0]
                self._fs.makedirs(parent, exist_ok=True)
                tmp = f"{parent}/.tmp.{name.rsplit('/', 1)[-1]}.{os.getpid()}.{os.urandom(4).hex()}"
                self._fs.pipe_file(tmp, data)
                self._fs.mv(tmp, path)
            else:
                self._fs.pipe_file(path, data)
            return True
        except Exception as exc:
            raise RemoteError(f"{type(exc).__name__}: {exc}") from None

    def delete(self, name: str) -> None:
        try:
            self._fs.rm_file(self._path(name))
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise RemoteError(f"{type(exc).__name__}: {exc}") from None

    def names(self, prefix: str) -> Iterator[str]:
        base = self._path(prefix.rsplit("/", 1)[0]) if "/" in prefix else self._base
        try:
            found = self._fs.find(base)
        except FileNotFoundError:
            return
        except Exception as exc:
            raise RemoteError(f"{type(exc).__name__}: {exc}") from None
        strip = self._base.lstrip("/") + "/"
        for path in found:
            rel = str(path).lstrip("/")
            rel = rel[len(strip):] if rel.startswith(strip) else rel
            if rel.startswith(prefix) and not rel.rsplit("/", 1)[-1].startswith(".tmp."):
                yield rel

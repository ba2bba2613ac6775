"""Files by Hugging Face hub id (`org/name`, `org/name@revision`), through `huggingface_hub`.

The local cache first (`HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`,
read when called); the hub only when allowed (`--online` or `METRALE_ONLINE=1`), then into the
cache with `huggingface_hub`'s progress bars. A safetensors header can be read with two ranged
reads instead of downloading the file. Tokens come from where `huggingface_hub` looks (`HF_TOKEN`,
`hf auth login`). Every failure is a `UsageError` (exit 2) in one line.

`huggingface_hub` is imported inside the functions: a local path never needs it.
"""

from __future__ import annotations

import importlib
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from metrale_cli import env
from metrale_cli.errors import UsageError
from metrale_cli.files.safetensors_header import MAX_HEADER_BYTES, SafetensorsHeader, parse_header

# `org/name` with an optional `@revision` (a branch, tag or commit); repo names as the hub
# allows them.
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[\w./-]+))?$")


@dataclass(frozen=True)
class HubId:
    repo_id: str
    revision: str | None = None

    @property
    def name(self) -> str:
        """The repository's name, with `@revision` when one is given (an adapter's default
        name, as a directory's basename is for a local adapter)."""
        name = self.repo_id.split("/", 1)[1]
        return f"{name}@{self.revision}" if self.revision else name

    def __str__(self) -> str:
        return f"{self.repo_id}@{self.revision}" if self.revision else self.repo_id


def parse_hub_id(spec: str) -> HubId | None:
    """A hub id, or None for anything else (an existing path is never a hub id)."""
    if Path(spec).expanduser().exists():
        return None
    m = _HUB_ID.match(spec.strip())
    if m is None:
        return None
    return HubId(m.group("repo"), m.group("rev"))


def fetch(hub: HubId, filename: str, online: bool) -> Path:
    """`filename` of `hub` in the local cache, downloading it first when `online`."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_download

    if online:
        # One HEAD without retries first: 401/403/404 and no network answer at once, where
        # hf_hub_download would retry a refused connection for half a minute. Without a network
        # a cached copy still serves.
        try:
            get_hf_file_metadata(_url(hub, filename))
        except Exception as exc:
            local = cached(hub, filename) if _is_transport_error(exc) else None
            if local is None:
                raise hub_error(hub, filename, online, exc) from None
            return local
    try:
        return Path(hf_hub_download(hub.repo_id, filename, revision=hub.revision,
                                    cache_dir=env.hf_hub_cache(), local_files_only=not online,
                                    endpoint=env.hf_endpoint()))
    except Exception as exc:
        raise hub_error(hub, filename, online, exc) from None


def cached(hub: HubId, filename: str) -> Path | None:
    """`filename` of `hub` when the local cache has it, else None; never the network."""
    try:
        return fetch(hub, filename, online=False)
    except UsageError:
        return None


def on_hub(hub: HubId, filename: str) -> bool:
    """Whether the hub holds `filename` of `hub` (one HEAD): a 404 is False, any other failure
    the one line of `hub_error`."""
    from huggingface_hub import get_hf_file_metadata

    try:
        get_hf_file_metadata(_url(hub, filename))
    except Exception as exc:
        if _status(exc) == 404:
            return False
        raise hub_error(hub, filename, True, exc) from None
    return True


def remote_header(hub: HubId, filename: str) -> SafetensorsHeader:
    """The safetensors header of `filename` on the hub from two ranged reads (its length, then
    the JSON), never the tensor data."""
    from huggingface_hub import get_hf_file_metadata

    url = _url(hub, filename)
    try:
        size = get_hf_file_metadata(url).size
        if size is None:
            raise UsageError(f"{hub}: the hub gives no size for {filename}")
        (n,) = struct.unpack("<Q", _read_range(url, 0, 8))
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise UsageError(f"{hub}: {filename} is not a safetensors file (header length {n} "
                             f"in a {size}-byte file)")
        raw = _read_range(url, 8, n)
    except UsageError:
        raise
    except Exception as exc:
        raise hub_error(hub, filename, True, exc) from None
    return parse_header(Path(f"{hub}/{filename}"), raw, size)


def _url(hub: HubId, filename: str) -> str:
    from huggingface_hub import hf_hub_url

    return hf_hub_url(hub.repo_id, filename, revision=hub.revision, endpoint=env.hf_endpoint())


def _read_range(url: str, start: int, length: int) -> bytes:
    """Bytes `[start, start + length)` of the file at `url`, with the hub's headers (token)."""
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    headers = {**build_hf_headers(), "Range": f"bytes={start}-{start + length - 1}"}
    response = get_session().get(url, headers=headers, follow_redirects=True)
    hf_raise_for_status(response)
    data = response.content
    if response.status_code != 206:
        data = data[start:]  # a server that ignores Range sends the whole file
    if len(data) < length:
        raise UsageError(f"{url}: the file ended after {start + len(data)} bytes")
    return bytes(data[:length])


def _status(exc: BaseException | None) -> int | None:
    """The HTTP status behind `exc` or the errors it was raised from."""
    from huggingface_hub.errors import HfHubHTTPError

    while exc is not None:
        if isinstance(exc, HfHubHTTPError) and exc.response is not None:
            return int(exc.response.status_code)
        exc = exc.__cause__ or exc.__context__
    return None


def _is_transport_error(exc: BaseException | None) -> bool:
    """A connection failure of the HTTP library `huggingface_hub` uses (httpx or its fork)."""
    from huggingface_hub.utils import get_session

    http: Any = importlib.import_module(type(get_session()).__module__.split(".")[0])
    while exc is not None:
        if isinstance(exc, http.TransportError):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def hub_error(hub: HubId, filename: str, online: bool, exc: Exception) -> UsageError:
    """One line for a failed hub look-up: not cached (offline), 401, 403, 404, no network."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    status = _status(exc)
    where = f"{hub}: {filename}"
    if status == 401:
        return UsageError(f"{where}: 401 unauthorized on {env.hf_endpoint()} (a private or gated "
                          "repository: set HF_TOKEN or run `hf auth login`)")
    if status == 403:
        return UsageError(f"{where}: 403 forbidden on {env.hf_endpoint()} (a gated repository "
                          "whose terms this account has not accepted, or a token without read "
                          "access)")
    if status == 404:
        return UsageError(f"{where}: 404 not found on {env.hf_endpoint()} (no such repository, "
                          "revision or file)")
    if status is not None:
        return UsageError(f"{where}: the hub answered HTTP {status}")
    if not online and isinstance(exc, LocalEntryNotFoundError):
        return UsageError(f"{where}: not in the local Hugging Face cache ({env.hf_hub_cache()}); "
                          "pass --online (or set METRALE_ONLINE=1) to download it")
    if _is_transport_error(exc):
        return UsageError(f"{where}: cannot reach {env.hf_endpoint()} (no network?) and it is "
                          "not in the local cache")
    if isinstance(exc, OSError):
        # The cache or token files under HF_HOME / HF_HUB_CACHE (HF_HOME=/dev/null).
        return UsageError(f"{where}: cannot use {exc.filename or env.hf_hub_cache()} "
                          f"({exc.strerror or exc}); check HF_HOME and HF_HUB_CACHE")
    return UsageError(f"{where}: {type(exc).__name__}: {exc}".splitlines()[0])

"""Every METRALE_* escape hatch, and the other environment variables metrale obeys (the hub's,
torchrun's), read here and nowhere else."""

from __future__ import annotations

import os
from pathlib import Path

from metrale_cli.errors import UsageError

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def flag(name: str) -> bool:
    """A boolean METRALE_* variable: 1/true/yes/on or 0/false/no/off, in any case, blanks around
    ignored; unset or empty is false; anything else is a UsageError naming the variable."""
    value = os.environ.get(name, "").strip().lower()
    if value in TRUE:
        return True
    if value in FALSE or not value:
        return False
    raise UsageError(f"{name}={os.environ[name]!r}: not a boolean; use one of "
                     f"{'/'.join(TRUE)} or {'/'.join(FALSE)}")


def debug() -> bool:
    """METRALE_DEBUG=1: show the traceback behind a one-line error, and check split-K's
    ticket counters after every split launch (ops/kernels.py, check_tickets)."""
    return flag("METRALE_DEBUG")


def experts_enabled() -> bool:
    """METRALE_LORA_EXPERTS=1: serve routed-expert and router LoRA (the expert pool's opt-in)."""
    return flag("METRALE_LORA_EXPERTS")


def kernel_dir() -> Path | None:
    """METRALE_KERNEL_DIR: load the .cu sources from here instead of the package."""
    value = os.environ.get("METRALE_KERNEL_DIR")
    return Path(value) if value else None


def host_seed() -> int | None:
    """METRALE_HOST_SEED: the host harness's CTA schedule and cp.async landing for every launch
    (a launch failure names the seed it ran under; unset, each launch takes the next)."""
    value = os.environ.get("METRALE_HOST_SEED", "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise UsageError(f"METRALE_HOST_SEED={value!r}: not a non-negative integer")
    return int(value)


def cache_dir() -> Path:
    """METRALE_CACHE_DIR: where compiled kernels and host-harness builds are cached."""
    value = os.environ.get("METRALE_CACHE_DIR")
    if value:
        return Path(value)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "metrale"


def online() -> bool:
    """METRALE_ONLINE=1: hub ids may be looked up and downloaded from the hub (as --online)."""
    return flag("METRALE_ONLINE")


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache, as huggingface_hub finds it: HF_HUB_CACHE, else
    HF_HOME/hub, else ~/.cache/huggingface/hub (read when called, not at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def hf_endpoint() -> str:
    """HF_ENDPOINT: the hub's address (a mirror, or a test server), default huggingface.co."""
    return os.environ.get("HF_ENDPOINT", "").rstrip("/") or "https://huggingface.co"


def no_color() -> bool:
    """NO_COLOR (no-color.org): set and not empty, output carries no ANSI styles at all, bold
    and dim included, even on a terminal."""
    return bool(os.environ.get("NO_COLOR"))


def torchrun_rank() -> tuple[int, int] | None:
    """(RANK, WORLD_SIZE) as torchrun sets them for each process it starts, or None outside a
    launch (either unset). Anything but integers with 0 <= RANK < WORLD_SIZE is a UsageError
    naming both: a hand-set pair is not a launch to rendezvous with."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank, world = _integer("RANK"), _integer("WORLD_SIZE")
    if rank is None or world is None or not 0 <= rank < world:
        raise UsageError(f"RANK={os.environ['RANK']!r} WORLD_SIZE={os.environ['WORLD_SIZE']!r}: "
                         "not a torchrun launch (integers with 0 <= RANK < WORLD_SIZE)")
    return rank, world


def rendezvous() -> tuple[str, int]:
    """(MASTER_ADDR, MASTER_PORT), the env:// rendezvous torchrun sets for its processes,
    checked before torch reads them: an address this machine cannot resolve (`256.1.1.1`) or a
    port outside [1, 65535] is a UsageError naming it, where torch would print dozens of lines
    of socket warnings and then time out."""
    import socket

    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise UsageError(f"{' and '.join(missing)} unset: not a torchrun launch (torchrun sets "
                         "MASTER_ADDR and MASTER_PORT with RANK and WORLD_SIZE)")
    port = _integer("MASTER_PORT")
    if port is None or not 0 < port < 65536:
        raise UsageError(f"MASTER_PORT={os.environ['MASTER_PORT']!r}: not a port (an integer "
                         "in [1, 65535])")
    address = os.environ["MASTER_ADDR"].strip()
    try:
        socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise UsageError(f"MASTER_ADDR={os.environ['MASTER_ADDR']!r}: not an address or "
                         f"host name this machine resolves ({reason})") from None
    return address, port


def local_rank(default: int) -> int:
    """LOCAL_RANK, this process's GPU on its node under torchrun; `default` when unset."""
    if "LOCAL_RANK" not in os.environ:
        return default
    value = _integer("LOCAL_RANK")
    if value is None or value < 0:
        raise UsageError(f"LOCAL_RANK={os.environ['LOCAL_RANK']!r}: not a non-negative integer")
    return value


def _integer(name: str) -> int | None:
    try:
        return int(os.environ[name].strip())
    except ValueError:
        return None


def dist_timeout() -> float:
    """METRALE_DIST_TIMEOUT: seconds a process of a distributed run (torchrun) waits for the
    others before it gives up; a positive number, default 300 (unset or empty)."""
    text = os.environ.get("METRALE_DIST_TIMEOUT", "").strip()
    if not text:
        return 300.0
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise UsageError(f"METRALE_DIST_TIMEOUT={os.environ['METRALE_DIST_TIMEOUT']!r}: not a "
                         "positive number of seconds")
    return value

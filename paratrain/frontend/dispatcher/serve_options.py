"""A dispatcher's settings, checked once (every `paratrain serve` option lands here)."""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.frontend.dispatcher.auto_shard import DEFAULT_MIN_BYTES
from paratrain.frontend.dispatcher.connections import JOIN_S
from paratrain.frontend.protocol.addresses import AddressError, check_port, is_loopback


MIN_TOKEN_CHARS = 16  # off loopback: a token anyone could guess is no token


@dataclass(frozen=True)
class DispatcherSettings:
    host: str = "127.0.0.1"  # the interface to listen on (anything but loopback needs a token)
    port: int = 0  # 0: any free port
    workers: int = 1  # workers in the world; clients are admitted once all serve
    token: str | None = None  # shared secret every peer proves it knows (HMAC challenge)
    log_path: str | None = None  # the instruction log: one line per instruction
    client_timeout: float = 30.0  # seconds without a heartbeat before a client is dropped
    worker_timeout: float = 5.0  # seconds without a heartbeat before a worker is lost
    join_timeout: float = JOIN_S  # seconds a connection may stay open without its peer joining
    max_message_mb: int = 1024  # the largest message (one uploaded tensor)
    max_tensor_mb: int | None = None  # the largest tensor a client may make (None: any)
    quiet: bool = False  # print only warnings
    auto_shard: bool = False  # split large new tensors over every worker (GT_AUTO_SHARD; see auto_shard.py)
    auto_shard_min_bytes: int = DEFAULT_MIN_BYTES  # "large": at least this many bytes

    def __post_init__(self):
        if self.workers < 1:
            raise ValueError(f"a dispatcher needs at least one worker, got {self.workers}")
        try:
            check_port(self.port)
        except AddressError as error:
            raise ValueError(str(error)) from None
        if not is_loopback(self.host) and not self.token:
            raise ValueError(f"binding {self.host} exposes the dispatcher beyond this machine: give a token "
                             "(--token or PARATRAIN_TOKEN)")
        if not is_loopback(self.host) and len("".join(self.token.split())) < MIN_TOKEN_CHARS:
            raise ValueError(f"binding {self.host} exposes the dispatcher beyond this machine: its token must hold at "
                             f"least {MIN_TOKEN_CHARS} characters other than spaces (e.g. python -c "
                             f"'import secrets; print(secrets.token_hex(16))')")
        if self.auto_shard_min_bytes < 0:
            raise ValueError(f"auto-shard-min-bytes must be at least 0, got {self.auto_shard_min_bytes}")
        for name in ("client_timeout", "worker_timeout", "join_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name.replace('_', '-')} must be positive, got {getattr(self, name)}")

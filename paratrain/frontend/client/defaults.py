"""The program's default session: GT's programs never name a connection.

`connect(address)` sets it; otherwise the first operation makes it, connecting to
`PARATRAIN_SERVER` if that is set, or else starting a dispatcher and `gpu_workers(n)` workers
on this machine (one by default), which stop when the program exits. The program's settings
(paratrain/environment.py: the server, token, timeout and signal file) are resolved once, at its
first session. Everything else takes its
session from the tensors it is given, so several explicit `Session`s can live side by side.

At exit the default session runs what the program queued after its last sync; if any of it
failed, the error is printed and the program exits with status 1 (an exception in an exit
handler cannot change the status, so this is the one place that calls `os._exit`).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading

from paratrain.frontend.client.autostart import LocalServer
from paratrain.frontend.client.config import Config
from paratrain.frontend.client.session import Session
from paratrain.frontend.errors import FrontendError
from paratrain.frontend.shapes import warm_up
from paratrain.environment import Settings


class Defaults:
    """The default session and the server it may have started (one per program)."""

    def __init__(self):
        self.session: Session | None = None
        self.server: LocalServer | None = None
        self.workers = 1
        self.config = Config(on_change=self._configure)  # GT's gt.get_config(); sent to each session
        self._config_from_environment = False
        self._settings: Settings | None = None

    @property
    def settings(self) -> Settings:
        """The program's settings, resolved at first use."""
        if self._settings is None:
            self._settings = Settings.resolve()
        return self._settings

    def get(self) -> Session:
        """The default session, connecting (or starting a server) on first use. A session the
        dispatcher has dropped stays the default, so that every later call says so."""
        if self.session is None or (self.session.closed and self.session.lost is None):
            address = self.settings.server
            if address:
                self.connect(address)
            else:
                self._read_environment_config()  # it may name more workers than gpu_workers() asked for
                self.start(max(self.workers, self.config.workers_named()))
        return self.session

    def connect(self, address: str | None, token: str | None = None) -> Session:
        address = address or self.settings.server
        if not address:
            raise ValueError("connect() needs an address HOST:PORT (or PARATRAIN_SERVER)")
        self._check_free()
        return self._use(Session(address, token=token or self.settings.token, timeout=self.settings.timeout))

    def start(self, workers: int, token: str | None = None) -> Session:
        self._check_free()
        warming = threading.Thread(target=warm_up, name="frontend-warm-up", daemon=True)
        warming.start()
        self.server = LocalServer.start(workers, token=token)
        warming.join()
        session = Session(self.server.address, token=token, timeout=self.settings.timeout)
        process = self.server.process
        session.server_alive = lambda: process.poll() is None
        return self._use(session)

    def _check_free(self) -> None:
        if self.session is not None and not self.session.closed:
            raise RuntimeError(f"already connected to {self.session.address}; call disconnect() first")

    def _use(self, session: Session) -> Session:
        """A new default session: it takes the program's signal configuration (with the file
        GT_CONFIG / PARATRAIN_CONFIG names, read once)."""
        self.session = session
        if not self._read_environment_config() and self.config.to_dict():
            self._configure(self.config.to_dict())
        return session

    def _read_environment_config(self) -> bool:
        """Load the configuration file the settings name (GT_CONFIG / PARATRAIN_CONFIG), the
        first time; -> whether it did (loading sends it to the session, if there is one)."""
        if self._config_from_environment:
            return False
        self._config_from_environment = True
        before = self.config.to_dict()
        if self.settings.signal_config:
            self.config.load(self.settings.signal_config)
        return self.config.to_dict() != before

    def _configure(self, settings: dict) -> None:
        if self.session is not None and not self.session.closed:
            self.session.configure(settings)

    def close(self) -> None:
        """Close the session (running what is queued: its errors raise here) and stop the server
        this program started."""
        try:
            if self.session is not None:
                self.session.close()
        finally:
            self.session = None
            if self.server is not None:
                self.server.stop()
                self.server = None

    def close_at_exit(self) -> None:
        try:
            self.close()
        except FrontendError as error:
            print(f"paratrain frontend: at exit: {error}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(1)


DEFAULTS = Defaults()
atexit.register(DEFAULTS.close_at_exit)


def session() -> Session:
    """The program's default session (connecting or starting one on first use)."""
    return DEFAULTS.get()

"""Run the emulator: in a background thread (tests), in a subprocess (benchmarks), or in the foreground.

The thread mode is what the pytest fixture uses: no process to leak, and nothing to wait for.
The subprocess mode gives the server its own CPU accounting (benchmarks compare it with the
client's) and its own GIL. Configuration, including tokens, reaches a subprocess on stdin so
secrets never show up in ``ps``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from kvbucket.errors import ConfigError
from kvbucket.testing.children import dies_with_parent
from kvbucket.testing.tls import TestCertificates

from .app import build_app
from .auth import Auth, TokenSpec, parse_org
from .core import Emulator
from .faults import FaultPlan, FaultRule
from .https import admin_open, server_context
from .state import State
from .wire import BODY_TIMEOUT_S, LINGER_S, STOP_GRACE_S
from .xorb_gc import DEFAULT_XORB_GRACE_S, collect_now

log = logging.getLogger("kvbucket.emulator")


@dataclass
class ServerConfig:
    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 0
    tokens: list[TokenSpec] = field(default_factory=list)
    xet_token_ttl_s: int = 3600
    admin_key: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)
    fault_seed: int = 0
    zero_copy: bool = True
    orgs: dict[str, list[str]] = field(default_factory=dict)
    body_timeout_s: float = BODY_TIMEOUT_S
    xorb_grace_s: float = DEFAULT_XORB_GRACE_S
    tls_cert: str | None = None  # serve HTTPS with this certificate (PEM) and key; None: plain HTTP
    tls_key: str | None = None

    def to_json(self) -> str:
        return json.dumps(
            {
                "data_dir": str(self.data_dir), "host": self.host, "port": self.port,
                "tokens": [[t.name, t.secret.get_secret_value(), t.scope] for t in self.tokens],
                "xet_token_ttl_s": self.xet_token_ttl_s, "admin_key": self.admin_key,
                "fault_seed": self.fault_seed, "zero_copy": self.zero_copy, "orgs": self.orgs,
                "body_timeout_s": self.body_timeout_s, "xorb_grace_s": self.xorb_grace_s,
                "tls_cert": self.tls_cert, "tls_key": self.tls_key,
            }
        )  # fmt: skip

    @classmethod
    def from_json(cls, text: str) -> ServerConfig:
        d = json.loads(text)
        return cls(
            data_dir=Path(d["data_dir"]),
            host=d["host"],
            port=int(d["port"]),
            tokens=[TokenSpec.parse(f"{n}={s}:{sc}") for n, s, sc in d["tokens"]],
            xet_token_ttl_s=int(d["xet_token_ttl_s"]),
            admin_key=d["admin_key"],
            fault_seed=int(d["fault_seed"]),
            zero_copy=bool(d["zero_copy"]),
            orgs={str(k): [str(u) for u in v] for k, v in d.get("orgs", {}).items()},
            body_timeout_s=float(d.get("body_timeout_s", BODY_TIMEOUT_S)),
            xorb_grace_s=float(d.get("xorb_grace_s", DEFAULT_XORB_GRACE_S)),
            tls_cert=d.get("tls_cert"),
            tls_key=d.get("tls_key"),
        )


def _end_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what a stop left on ``loop`` (handlers aiohttp cancelled past STOP_GRACE_S without
    waiting for them) and give them STOP_GRACE_S to end, as ``asyncio.run`` does at its end."""
    tasks = asyncio.all_tasks(loop)
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.wait(tasks, timeout=STOP_GRACE_S))


class ThreadServer:
    """The emulator on an asyncio loop in a daemon thread of this process."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._emu: Emulator | None = None
        self._state: State | None = None

    def start(self) -> None:
        ready = threading.Event()
        error: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._start_async())
            except BaseException as e:
                error.append(e)
                ready.set()
                loop.close()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._stop_async())
            _end_tasks(loop)
            loop.close()

        self._thread = threading.Thread(target=run, name="kvbucket-hub-emulator", daemon=True)
        self._thread.start()
        ready.wait()
        if error:
            self._thread.join()
            raise error[0]

    async def _start_async(self) -> None:
        cfg = self.config
        self._state = State(cfg.data_dir)
        auth = Auth(cfg.tokens, cfg.xet_token_ttl_s, Auth.load_key(cfg.data_dir), cfg.orgs)
        self._emu = Emulator(
            self._state, auth, FaultPlan(cfg.fault_seed), cfg.admin_key, cfg.zero_copy, cfg.body_timeout_s,
            cfg.xorb_grace_s,
        )
        await self._emu.sweep_temps()  # what a server killed mid-upload left (preallocated xorbs)
        self._emu.schedule_gc()  # unreferenced xorbs, once past their grace period
        # lingering_time: after a reply to a body it did not read (a 413 or 408), aiohttp reads
        # and drops the rest so the client sees the reply rather than a reset; 1 s, not the
        # default 10 s, so an oversized or stalled body is not consumed for long
        # shutdown_timeout: a stop waits STOP_GRACE_S (not aiohttp's 60 s) for requests in flight,
        # then cancels them (as long again) and their clients see the connection close, as when a
        # server goes away. One request held in a fault's delay or an unfinished body kept every stop (the
        # session fixture's at a worker's end) waiting until stop() gave up on the thread at 30 s.
        self._runner = web.AppRunner(
            build_app(self._emu), access_log=None, handle_signals=False, lingering_time=LINGER_S,
            shutdown_timeout=STOP_GRACE_S,
        )
        await self._runner.setup()
        tls = server_context(cfg.tls_cert, cfg.tls_key) if cfg.tls_cert and cfg.tls_key else None
        site = web.TCPSite(self._runner, cfg.host, cfg.port, reuse_address=True, ssl_context=tls)
        await site.start()
        server = site._server
        assert server is not None and server.sockets  # type: ignore[union-attr]
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def _stop_async(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._emu is not None:
            await self._emu.stop_sweeping()
            self._emu.close()
        if self._state is not None:
            self._state.close()

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
        self._thread = None
        self._loop = None


class SubprocessServer:
    """The emulator in a child Python process (``python -m kvbucket.testing.hub_emulator``)."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.port: int | None = None
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        env = dict(os.environ)
        src = str(Path(__file__).resolve().parents[3])
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen(
            dies_with_parent([sys.executable, "-m", "kvbucket.testing.hub_emulator"]),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(self.config.to_json() + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line.startswith("READY "):
            self.stop()
            raise RuntimeError(f"the emulator subprocess did not start (said {line.strip()!r})")
        self.port = int(line.split()[1])

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        self.proc = None


class FaultControl:
    """Add and reset fault rules on a running emulator (thread or subprocess alike).

    ``ca``: the CA file an ``https://`` emulator's certificate chains to (``HubEmulator.ca``).
    """

    def __init__(self, endpoint: str, admin_key: str, ca: str | os.PathLike[str] | None = None) -> None:
        self._url = f"{endpoint}/_emulator/faults"
        self._key = admin_key
        self._ca = ca

    def _call(self, method: str, body: Any = None) -> list[dict[str, Any]]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self._url, data=data, method=method)
        req.add_header("X-Emulator-Admin", self._key)
        req.add_header("Content-Type", "application/json")
        with admin_open(req, 30, self._ca) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]

    def add(self, route: str, **kwargs: Any) -> None:
        """Add a rule; see ``FaultRule`` for the fields (status, probability, nth, times, ...)."""
        FaultRule(route=route, **kwargs)  # validate here so the caller sees a clear ValueError
        self._call("POST", {"route": route, **kwargs})

    def rules(self) -> list[dict[str, Any]]:
        """The active rules with how often each matched (``seen``) and fired (``fired``)."""
        return self._call("GET")

    def reset(self) -> None:
        self._call("DELETE")


TokensArg = Mapping[str, "tuple[str, str] | list[tuple[str, str]]"] | Iterable["TokenSpec | str"] | None


def token_specs(tokens: TokensArg) -> list[TokenSpec]:
    """The ``tokens`` argument of ``HubEmulator`` as a list of ``TokenSpec``."""
    if tokens is None:
        return []
    if isinstance(tokens, Mapping):
        out = []
        for user, value in tokens.items():
            pairs = [value] if isinstance(value, tuple) else list(value)
            out += [TokenSpec.parse(f"{user}={secret}:{scope}") for secret, scope in pairs]
        return out
    return [t if isinstance(t, TokenSpec) else TokenSpec.parse(t) for t in tokens]


class HubEmulator:
    """A local Hugging Face Storage Buckets server, as a context manager.

    ``with HubEmulator(tokens={"me": ("secret", "write")}) as emu: HfApi(endpoint=emu.endpoint, ...)``.
    ``tokens`` maps a user to one ``(secret, scope)`` or a list of them (scope ``write``, ``read``
    or ``fine-read``), or is a list of ``TokenSpec``/``"USER=SECRET:scope"``; ``orgs`` maps an
    organisation to its members (``{"acme": ["alice", "bob"]}``). No tokens: an open server.
    Without ``data_dir`` a temporary one is made and removed at exit. ``port=0`` picks a free port.
    ``subprocess=True`` runs the server in a child process (own CPU time and GIL).
    ``zero_copy=False`` turns off the Linux ``splice`` path for large xorb uploads.
    ``body_timeout_s``: a request body that goes this long without a byte is answered 408.
    ``xorb_grace_s``: how long an unreferenced xorb is kept before it is collected (default 22
    days, longer than hf_xet's 3-week shard cache; see docs/emulator.md "Xorb collection").
    ``tls``: serve HTTPS with these certificates (``kvbucket.testing.tls.make_test_certificates``),
    as the Hub does; clients must trust ``tls.ca`` (docs/emulator.md, "TLS").
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        tokens: TokensArg = None,
        *,
        orgs: Mapping[str, Iterable[str]] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        subprocess: bool = False,
        xet_token_ttl_s: int = 3600,
        fault_seed: int = 0,
        admin_key: str | None = None,
        zero_copy: bool = True,
        body_timeout_s: float = BODY_TIMEOUT_S,
        xorb_grace_s: float = DEFAULT_XORB_GRACE_S,
        tls: TestCertificates | None = None,
    ) -> None:
        specs = token_specs(tokens)
        org_map = {str(o): [str(u) for u in members] for o, members in (orgs or {}).items()}
        for o in org_map:
            parse_org(f"{o}={','.join(org_map[o])}")  # the Hub's name rules, a clear error
        Auth(specs, orgs=org_map)  # refuses a user that is also an org, duplicate secrets
        if xet_token_ttl_s <= 0:
            raise ConfigError("xet_token_ttl_s must be positive")
        if body_timeout_s <= 0:
            raise ConfigError("body_timeout_s must be positive")
        if xorb_grace_s < 0:
            raise ConfigError("xorb_grace_s must be >= 0 (seconds an unreferenced xorb is kept)")
        if admin_key is not None and len(admin_key) < 8:
            raise ConfigError("the admin key (fault control) must be at least 8 characters")
        self._tmp: str | None = None
        if data_dir is None:
            self._tmp = tempfile.mkdtemp(prefix="kvbucket-hub-")
            data_dir = self._tmp
        self.config = ServerConfig(Path(data_dir), host, port, specs, xet_token_ttl_s, fault_seed=fault_seed)
        if admin_key is not None:
            self.config.admin_key = admin_key
        self.config.zero_copy = zero_copy
        self.config.body_timeout_s = body_timeout_s
        self.config.xorb_grace_s = float(xorb_grace_s)
        self.config.orgs = org_map
        self.tls = tls
        if tls is not None:
            self.config.tls_cert, self.config.tls_key = str(tls.cert), str(tls.key)
        self.use_subprocess = subprocess
        self._server: ThreadServer | SubprocessServer | None = None

    @property
    def data_dir(self) -> Path:
        return self.config.data_dir

    @property
    def port(self) -> int:
        if self._server is None or self._server.port is None:
            raise RuntimeError("the emulator is not running")
        return self._server.port

    @property
    def endpoint(self) -> str:
        """The value for ``HF_ENDPOINT`` / ``HfApi(endpoint=...)``."""
        host = self.config.host if self.config.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"{'https' if self.tls is not None else 'http'}://{host}:{self.port}"

    @property
    def ca(self) -> Path | None:
        """The CA file clients must trust in TLS mode (None over plain HTTP)."""
        return self.tls.ca if self.tls is not None else None

    @property
    def faults(self) -> FaultControl:
        return FaultControl(self.endpoint, self.config.admin_key, self.ca)

    @property
    def pid(self) -> int:
        if isinstance(self._server, SubprocessServer) and self._server.proc is not None:
            return self._server.proc.pid
        return os.getpid()

    def stats(self) -> dict[str, Any]:
        """Request counts and bytes per route, plus the server's CPU time (see docs/emulator.md)."""
        req = urllib.request.Request(f"{self.endpoint}/_emulator/stats")
        req.add_header("X-Emulator-Admin", self.config.admin_key)  # needed when tokens are configured
        with admin_open(req, 30, self.ca) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]

    def collect_xorbs(self, grace_s: float | None = None) -> dict[str, int]:
        """Drop unreferenced xorbs now (``grace_s`` overrides the server's grace; 0: all of them);
        what was collected (see docs/emulator.md, "Xorb collection")."""
        return collect_now(self.endpoint, self.config.admin_key, grace_s, self.ca)

    def requests(self, *, clear: bool = False) -> list[dict[str, Any]]:
        """The request log: ``{route, start, end}`` per request served (server's monotonic clock),
        for ``request_log.sequential_round_trips``; ``clear=True`` empties it after reading."""
        url = f"{self.endpoint}/_emulator/requests"
        req = urllib.request.Request(url, method="DELETE" if clear else "GET")
        req.add_header("X-Emulator-Admin", self.config.admin_key)
        with admin_open(req, 30, self.ca) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]

    def start(self) -> HubEmulator:
        if self._server is not None:
            raise RuntimeError("the emulator is already running")
        server = SubprocessServer(self.config) if self.use_subprocess else ThreadServer(self.config)
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def restart(self, *, same_port: bool = True) -> None:
        """Stop and start again on the same data dir (and, by default, the same port)."""
        port = self.port
        self.stop()
        if same_port:
            self.config.port = port
        try:
            self.start()
        finally:
            self.config.port = port if same_port else self.config.port

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> HubEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = f"endpoint={self.endpoint}" if self._server is not None else "stopped"
        return (
            f"HubEmulator({state}, data_dir={str(self.data_dir)!r}, tokens={len(self.config.tokens)}, "
            f"orgs={sorted(self.config.orgs)})"
        )


def child_main() -> None:
    """Entry point of the subprocess mode: config on stdin, ``READY <port>`` on stdout."""
    config = ServerConfig.from_json(sys.stdin.readline())
    server = ThreadServer(config)
    server.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"READY {server.port}", flush=True)
    while not stop.wait(0.5):
        pass
    server.stop()

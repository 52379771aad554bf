"""kvbucket's ``/metrics`` endpoint: the default Prometheus registry served over HTTP.

:func:`start_metrics_server` starts one endpoint its caller owns (and closes).
:func:`serve_metrics` is for the ``metrics_port`` settings of the engine integrations (LMCache's
L2 adapter and connector): an engine may build several of them in one process, all counting
into the one default registry, so the endpoint is started once per port and process and lives
as long as the process; a port another process holds is a :class:`~kvbucket.errors.ConfigError`
naming the setting. :class:`MetricsEndpointConfig` holds those settings (``metrics_port``,
``metrics_addr``) for every integration's configuration.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import re
import threading
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
from pydantic import BaseModel, field_validator, model_validator

from kvbucket.errors import ConfigError

log = logging.getLogger("kvbucket.metrics")


@dataclass
class MetricsServer:
    """A running ``/metrics`` endpoint; ``close()`` stops it."""

    port: int
    addr: str
    _server: Any = field(repr=False)
    _thread: Any = field(repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.addr}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_metrics_server(
    port: int = 0, addr: str = "127.0.0.1", registry: CollectorRegistry = REGISTRY, *,
    setting: str = "start_metrics_server's port",
) -> MetricsServer:
    """Serve ``registry`` on ``http://addr:port/metrics`` from a daemon thread.

    ``port=0`` picks a free port (read it from ``.port``). The default address is loopback:
    exposing metrics beyond the host is a deliberate choice (pass ``addr="0.0.0.0"``). A port in
    use or an address not of this host is a :class:`ConfigError` naming ``setting``, the same line
    a ``metrics_port`` setting gives.
    """
    try:
        server, thread = start_http_server(port, addr=addr, registry=registry)
    except OSError as e:
        raise ConfigError(_bind_error(port, addr, setting, e)) from None
    return MetricsServer(port=server.server_port, addr=addr, _server=server, _thread=thread)


_served: dict[int, MetricsServer] = {}
_served_lock = threading.Lock()


def serve_metrics(port: int, addr: str = "127.0.0.1", *, setting: str = "metrics_port") -> MetricsServer:
    """Serve the default registry on ``http://addr:port/metrics`` unless this process already
    does; the endpoint stays up until the process exits. ``setting`` names the key in errors."""
    if not 1 <= port <= 65535:
        raise ConfigError(f"{setting} must be a TCP port from 1 to 65535, got {port}")
    with _served_lock:
        running = _served.get(port)
        if running is not None:
            if running.addr != addr:
                raise ConfigError(
                    f"{setting} {port}: this process already serves kvbucket's metrics on "
                    f"{running.addr}:{port}, not {addr}; give every kvbucket part of one process "
                    "the same address for one port"
                )
            return running
        server = start_metrics_server(port, addr, setting=setting)
        _served[port] = server
    log.info("kvbucket metrics on %s", server.url)
    return server


_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*$")  # metrics_addr: a host name (or an IP address)


class MetricsEndpointConfig(BaseModel):
    """``metrics_port`` and ``metrics_addr``, as every integration's settings take them (the L2
    adapter, the non-MP connector, the vLLM tier): :meth:`serve_metrics` serves them."""

    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"

    @field_validator("metrics_port")
    @classmethod
    def _port(cls, v: int | None) -> int | None:
        if v is not None and not 1 <= v <= 65535:
            raise ValueError("must be a TCP port from 1 to 65535 (where kvbucket's Prometheus metrics "
                             "are served), or left out to serve none")
        return v

    @field_validator("metrics_addr")
    @classmethod
    def _addr(cls, v: str) -> str:
        try:
            ipaddress.ip_address(v)
        except ValueError:
            if not _HOSTNAME.match(v):
                raise ValueError("must be an address of this host to listen on, e.g. 127.0.0.1 (this "
                                 "host only, the default) or 0.0.0.0 (every interface); no scheme, no port"
                                 ) from None
        return v

    @model_validator(mode="after")
    def _addr_needs_port(self) -> Any:
        if "metrics_addr" in self.model_fields_set and self.metrics_port is None:
            raise ValueError("metrics_addr is set but metrics_port is not: set metrics_port too "
                             "(e.g. 9464), or drop metrics_addr")
        return self


def _bind_error(port: int, addr: str, setting: str, e: OSError) -> str:
    where = f"cannot serve kvbucket's metrics on {addr}:{port} ({setting})"
    if e.errno == errno.EADDRINUSE:
        return (f"{where}: the port is in use by another process; set {setting} to a free port "
                "(every process serving kvbucket's metrics needs its own)")
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"{where}: not allowed to listen there (ports below 1024 need privileges); pick another port"
    return f"{where}: {e.strerror or e}; give an address of this host (e.g. 127.0.0.1 or 0.0.0.0)"


__all__ = ["MetricsEndpointConfig", "MetricsServer", "serve_metrics", "start_metrics_server"]

"""``kvbucket emulator serve``: run the local Hugging Face Storage Buckets server in the foreground."""

from __future__ import annotations

import errno
import os
import signal
import threading
from pathlib import Path

import typer

from kvbucket.errors import ConfigError
from kvbucket.secrets import redact

TOKENS_ENV = "KVBUCKET_EMULATOR_TOKENS"
ADMIN_ENV = "KVBUCKET_EMULATOR_ADMIN_KEY"


def refuse_a_file(data_dir: Path) -> None:
    """Refuse a ``--data-dir`` that is a file or lies under one (its nearest existing path is a
    file), naming that file; a missing directory is fine (the emulator creates it)."""
    for path in (data_dir, *data_dir.parents):
        if not path.exists():
            continue
        if not path.is_dir():
            under = "" if path == data_dir else f", so {data_dir} cannot be a directory"
            raise typer.BadParameter(f"{path} is a file{under}; give a directory (created if missing)",
                                     param_hint="--data-dir")
        return


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="A local Hugging Face Storage Buckets server (Hub REST + Xet CAS).")
    app.add_typer(group, name="emulator")

    @group.command("serve")
    def serve(
        data_dir: Path = typer.Option(..., "--data-dir", help="Where buckets, files and xorbs are kept."),
        host: str = typer.Option("127.0.0.1", help="Interface to listen on (loopback by default)."),
        port: int = typer.Option(0, min=0, max=65535, help="Port (0-65535); 0 picks a free one."),
        token: list[str] = typer.Option(
            [],
            "--token",
            help="USER=SECRET:SCOPE, SCOPE being read, write or fine-read (repeatable): a token "
            "of USER. Also read from "
            f"${TOKENS_ENV} (space-separated), which keeps secrets out of the process list. "
            "Without any token the server is OPEN: every caller, with or without a token, is the "
            "user 'local' and may create, read, write and delete buckets in any namespace, and "
            "the stats route answers anyone.",
        ),
        org: list[str] = typer.Option(
            [],
            "--org",
            help="ORG=USER,USER (repeatable), e.g. acme=alice,bob: an organisation and its members. "
            "Members read private buckets of ORG and, with a write token, write them; other users "
            "get 404 on them, anonymous callers 401.",
        ),
        xet_token_ttl: int = typer.Option(3600, help="Lifetime of issued Xet tokens, in seconds."),
        xorb_grace: float = typer.Option(
            22 * 24 * 3600.0,
            min=0,
            help="Seconds an unreferenced xorb is kept before it is deleted (default 22 days: "
            "hf_xet's shard cache dedups against xorbs it uploaded up to 3 weeks ago). Lower it "
            "when clients use a throwaway HF_XET_CACHE.",
        ),
    ) -> None:
        """Serve until interrupted; prints the HF_ENDPOINT to use (never tokens).

        With tokens, access follows the Hub: a user reads public buckets and
        the private buckets of its own namespace and organisations, and
        writes those with a write token. Without tokens the server is open:
        anyone may do anything (for quick local use only).

        Fault injection (/_emulator/faults) and xorb collection
        (/_emulator/gc, `kvbucket emulator collect`) always need the admin key, and
        so does /_emulator/stats when tokens are configured: set it in
        $KVBUCKET_EMULATOR_ADMIN_KEY and send it as the X-Emulator-Admin
        header, or use kvbucket.testing.FaultControl(endpoint, key).
        """
        refuse_a_file(data_dir)  # at once: the emulator's import takes a second or more
        from kvbucket.testing.hub_emulator import HubEmulator, TokenSpec
        from kvbucket.testing.hub_emulator.auth import parse_org

        specs_text = list(token) + os.environ.get(TOKENS_ENV, "").split()
        try:
            specs = [TokenSpec.parse(t) for t in specs_text]
        except ConfigError as e:
            raise typer.BadParameter(str(e), param_hint="--token") from None
        try:
            orgs = dict(parse_org(o) for o in org)
        except ConfigError as e:
            raise typer.BadParameter(str(e), param_hint="--org") from None
        if orgs and not specs:
            raise typer.BadParameter(
                "organisations need users: give their tokens with --token", param_hint="--org"
            )
        admin_key = os.environ.get(ADMIN_ENV)  # enables /_emulator/faults for whoever holds it
        try:
            emu = HubEmulator(
                data_dir,
                specs,
                orgs=orgs,
                host=host,
                port=port,
                xet_token_ttl_s=xet_token_ttl,
                admin_key=admin_key,
                xorb_grace_s=xorb_grace,
            )
        except ConfigError as e:
            raise typer.BadParameter(str(e)) from None
        except OSError as e:
            raise typer.BadParameter(f"cannot use {data_dir}: {e.strerror or e}",
                                     param_hint="--data-dir") from None
        try:
            emu.start()
        except OSError as e:
            emu.close()
            if e.filename is not None:  # the data dir (created on start), not the socket
                raise typer.BadParameter(f"cannot use {data_dir}: {e.strerror or e}: {e.filename}",
                                         param_hint="--data-dir") from None
            reason = e.strerror or str(e)
            if e.errno == errno.EADDRINUSE or "address already in use" in reason.lower():
                typer.echo(f"error: cannot listen on {host}:{port}: the port is taken by another process; "
                           "pick another --port (or --port 0 for a free one)", err=True)
                raise typer.Exit(1) from None
            if e.errno == errno.EADDRNOTAVAIL or "assign requested address" in reason.lower():
                reason = f"{host} is not an address of this machine"
            typer.echo(f"error: cannot listen on {host}: {reason}; give --host an address of this machine's "
                       "interfaces (127.0.0.1 by default, 0.0.0.0 for all)", err=True)
            raise typer.Exit(2) from None
        if host not in ("127.0.0.1", "localhost", "::1"):
            typer.secho(f"warning: listening on {host}, not only on loopback", fg="yellow", err=True)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        users = ", ".join(f"{s.name} ({s.scope})" for s in specs) or "none: OPEN server, anyone may write"
        orgs_text = "; ".join(f"{o}: {', '.join(m)}" for o, m in orgs.items()) or "none"
        typer.echo(f"HF_ENDPOINT={emu.endpoint}")
        typer.echo(f"data dir: {emu.data_dir}  tokens: {users}  organisations: {orgs_text}", err=True)
        if specs and not admin_key:
            typer.echo(f"stats and fault routes: set ${ADMIN_ENV} to use them", err=True)
        try:
            while not stop.wait(0.5):
                pass
        finally:
            emu.close()

    @group.command("collect")
    def collect(
        endpoint: str = typer.Option(..., "--endpoint", help="The emulator's HF_ENDPOINT, e.g. http://127.0.0.1:8000."),
        grace: float | None = typer.Option(
            None, min=0, help="Seconds unreferenced before a xorb goes (default: the server's --xorb-grace)."
        ),
    ) -> None:
        """Delete the xorbs no file needs now, instead of at the next background pass.

        Needs the admin key in $KVBUCKET_EMULATOR_ADMIN_KEY (as the server was started with).
        """
        import json
        import urllib.error

        from kvbucket.testing.hub_emulator.xorb_gc import collect_now

        key = os.environ.get(ADMIN_ENV)
        if not key:
            typer.echo(f"error: set ${ADMIN_ENV} to the key the emulator was started with", err=True)
            raise typer.Exit(2)
        try:
            done = collect_now(endpoint.rstrip("/"), key, grace)
        except urllib.error.HTTPError as e:
            said = redact(e.read().decode(errors="replace"), key)
            typer.echo(f"error: the emulator refused: {e.code} {said}", err=True)
            raise typer.Exit(1) from None
        except (urllib.error.URLError, OSError) as e:  # never the URL's userinfo nor the key
            typer.echo(f"error: cannot reach the emulator at {redact(endpoint, key)}: "
                       f"{redact(str(getattr(e, 'reason', e)), key)}", err=True)
            raise typer.Exit(1) from None
        typer.echo(json.dumps(done))

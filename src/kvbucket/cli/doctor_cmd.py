"""``kvbucket doctor``: what a bug report needs, with every secret redacted.

Versions of kvbucket and the clients it runs on, the environment that points them somewhere
(tokens and keys shown only as "set"), and whether each configured endpoint and store answers
within a short timeout. Plain lines, to paste into an issue as they are.
"""

from __future__ import annotations

import base64
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from kvbucket.cli.common import (
    MAX_TIMEOUT_S,
    TIMEOUT_ENV,
    NoAnswerError,
    Watchdog,
    bounded,
    endpoint_hint,
    exit_code_for,
    fail,
    first_answer_deadline,
    is_remote,
    open_for_command,
    probe,
    store_url,
    timeout_given,
)
from kvbucket.cli.output import Format, FormatOpt, JsonOpt, print_json, wants_json
from kvbucket.errors import KVBucketError
from kvbucket.remote_hit import (
    MODEL_SHAPES,
    PROMPT_TOKENS,
    RTT_SAMPLES,
    Budget,
    MeasureFailed,
    Measurement,
    human_bytes,
    measure,
    new_run,
    verdict,
)
from kvbucket.secrets import looks_secret, redact, secrets_in_env
from kvbucket.stores.deadline import left
from kvbucket.stores.urls import resolve_configured_url
from kvbucket.threads import in_daemon_thread

DOCTOR_TIMEOUT_S = 5.0
MAX_SMALL_OBJECTS = 1024  # --model: objects of the fixed-cost load (one per chunk of the prompt)
PACKAGES = ("kvbucket", "huggingface_hub", "hf_xet", "obstore", "lmcache", "torch", "transformers", "typer",
            "pydantic")
#: environment variables shown (by prefix or name); values of secret-looking names never are
ENV_PREFIXES = ("KVBUCKET_", "HF_", "HUGGING_FACE_", "AWS_", "LMCACHE_")
ENV_NAMES = ("NEURON_COMPILE_CACHE_URL", "NEURON_CC_FLAGS", "HTTPS_PROXY", "HTTP_PROXY", "NO_PROXY",
             "https_proxy", "http_proxy", "no_proxy")
#: variables holding whole configs, which may hold secrets under any key: shown as "set (redacted)"
_CONFIG_BLOBS = ("EXTRA_CONFIG",)


@dataclass
class Check:
    what: str
    ok: bool
    detail: str
    stuck: bool = False  # a client thread is still blocked on a silent endpoint


def package_versions() -> list[tuple[str, str]]:
    from importlib import metadata  # here: ~15 ms, and every `kvbucket` start imports this module

    out = [("python", f"{platform.python_version()} ({sys.platform} {platform.machine()})")]
    for name in PACKAGES:
        try:
            out.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            out.append((name, "not installed"))
    return out


def environment(env: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """The variables that steer kvbucket and its clients; secrets as "set (redacted)"."""
    env = dict(os.environ if env is None else env)
    known = secrets_in_env(env)
    rows = []
    for name in sorted(env):
        if not (name.startswith(ENV_PREFIXES) or name in ENV_NAMES):
            continue
        value = env[name]
        if not value:
            shown = "(empty)"
        elif looks_secret(name) or name.endswith(_CONFIG_BLOBS):
            shown = "set (redacted)"
        else:
            shown = redact(value, *known)
        rows.append((name, shown))
    return rows


def saved_hf_login() -> str:
    try:
        from huggingface_hub import constants

        path = Path(str(constants.HF_TOKEN_PATH))
    except ValueError:  # its import parses $HF_ENDPOINT; a malformed one is reported below
        home = os.environ.get("HF_HOME") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
        path = Path(os.environ.get("HF_TOKEN_PATH") or os.path.join(home, "token"))
    return f"present at {path} (not shown)" if path.is_file() else f"none ({path} does not exist)"


def configured_stores(extra: list[str]) -> list[tuple[str, str]]:
    """(url, where it is configured) for each store kvbucket would use here."""
    found: list[tuple[str, str]] = [(u, "command line") for u in extra]
    if url := os.environ.get("KVBUCKET_REMOTE_URL"):
        found.append((url, "$KVBUCKET_REMOTE_URL"))
    try:
        from kvbucket.compile_cache.settings import ENV_TARGET, config_path, resolve_target

        target = resolve_target()
        if target:
            source = (f"${ENV_TARGET}" if os.environ.get(ENV_TARGET)
                      else f"compile-cache target in {config_path()}")
            found.append((target, source))
    except Exception as e:  # a broken saved target is itself worth reporting
        found.append(("(compile-cache target)", f"unreadable: {redact(str(e))}"))
    seen: set[str] = set()
    return [(u, w) for u, w in found if not (u in seen or seen.add(u))]  # type: ignore[func-returns-value]


#: what each endpoint variable is asked: for the Hub, the route `hf auth whoami` asks (401 without a
#: token: a Hub answered); a server whose root is not the Hub's answers it 404
ENDPOINT_PATHS = {"HF_ENDPOINT": "/api/whoami-v2"}


def check_endpoint(name: str, url: str, timeout: float, path: str = "",
                   deadline: float | None = None) -> Check:
    """An HTTP answer from the endpoint (``url`` + ``path``) counts as reachable, refusals
    included (401/403: it may well refuse an anonymous GET); 404 says the URL is not the server's
    root (a path too many, or another server) and 5xx that it is failing. The whole request ends
    by ``deadline`` (a monotonic instant; default ``timeout`` from now): urllib's timeout is per
    socket read, which a server trickling its answer never trips.

    Userinfo in the URL (``http://user:pass@host``) is sent as HTTP basic auth, as the clients
    do: urllib would take it for part of the host name."""
    deadline = deadline if deadline is not None else time.monotonic() + timeout
    try:
        # urllib's own timeout a little later than the deadline: one message for a silent server
        return bounded(lambda: _ask_endpoint(name, url, max(0.1, deadline - time.monotonic()) + 1.0, path),
                       timeout, url, deadline=deadline)
    except NoAnswerError:
        return Check(f"{name} {redact(url)}", False, f"unreachable or too slow: no whole answer to "
                     f"{path or '/'} within {timeout:g} s; check that the server is up and working, or raise "
                     "--timeout", stuck=True)


def _ask_endpoint(name: str, url: str, timeout: float, path: str) -> Check:
    """:func:`check_endpoint`'s request, each socket read within ``timeout``."""
    import urllib.error  # here: urllib.request (http.client, ssl) is ~25 ms of every `kvbucket` start
    import urllib.parse
    import urllib.request

    shown = redact(url)
    try:
        parts = urllib.parse.urlsplit(url.rstrip("/") + path)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("not an http(s) URL")
        parts.port  # noqa: B018 - raises ValueError on a port out of range
    except ValueError as e:
        return Check(f"{name} {shown}", False, f"malformed ({e}); set it like https://host[:port]")
    request = urllib.request.Request(urllib.parse.urlunsplit(parts))
    if parts.username is not None or parts.password is not None:
        netloc = parts.hostname or ""
        if ":" in netloc:
            netloc = f"[{netloc}]"
        if parts.port is not None:
            netloc += f":{parts.port}"
        unquote = urllib.parse.unquote
        userinfo = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}"
        request = urllib.request.Request(urllib.parse.urlunsplit(parts._replace(netloc=netloc)), headers={
            "Authorization": "Basic " + base64.b64encode(userinfo.encode()).decode()})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            status = resp.status
    except urllib.error.HTTPError as e:
        status = e.code
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        return Check(f"{name} {shown}", False, redact(f"unreachable ({reason})", url))
    answered = f"{path or '/'} answered HTTP {status} in {time.monotonic() - t0:.2f} s"
    if status == 404:
        return Check(f"{name} {shown}", False, f"{answered}: not the server's root URL; set {name} to the "
                     "server's root (e.g. https://huggingface.co, http://127.0.0.1:PORT), without a path")
    if status >= 500:
        return Check(f"{name} {shown}", False, f"{answered}: the server is failing")
    if status in (401, 403):  # asked without a token on purpose: the token has its own line
        answered += " (asked without a token: the server is up; the token line says whether yours works)"
    return Check(f"{name} {shown}", True, answered)


def check_token(timeout: float, deadline: float | None = None) -> Check | None:
    """Whom the Hugging Face token belongs to, as ``hf auth whoami`` says it (huggingface_hub's
    ``whoami`` on $HF_ENDPOINT or the default Hub), or that it was refused, or that there is none."""
    from huggingface_hub import get_token

    from kvbucket.errors import DeadlineExceededError
    from kvbucket.stores.hub.whoami import whoami

    token = get_token()
    if not token:
        return Check("token", True, "none ($HF_TOKEN is unset and there is no saved Hugging Face login): "
                     "public buckets only; set HF_TOKEN or run `hf auth login` for private ones")
    source = "$HF_TOKEN" if os.environ.get("HF_TOKEN") else "the saved Hugging Face login"
    endpoint = os.environ.get("HF_ENDPOINT", "").strip().rstrip("/") or "https://huggingface.co"
    what = f"token ({source})"
    try:
        info = whoami(endpoint, token, timeout, token_source=source, deadline=deadline)
    except DeadlineExceededError as e:
        return Check(what, False, _line(e), stuck=True)  # the client's thread still waits
    except Exception as e:
        return Check(what, False, _line(e))
    orgs = ", ".join(o.get("name", "?") for o in info.get("orgs") or [] if isinstance(o, dict))
    return Check(what, True, f"belongs to {info.get('name')!r}{f' (orgs: {orgs})' if orgs else ''} on "
                 f"{redact(endpoint)}")


def check_store(url: str, source: str, timeout: float, deadline: float | None = None) -> Check:
    """Open the store and read one listing entry, all by ``deadline`` (the command's, counted from
    its start: :func:`first_answer_deadline`, when None)."""
    what = f"{url} ({source})"
    if source == "$KVBUCKET_REMOTE_URL":  # read as the engine reads it (stores.urls: one rule)
        try:
            url = resolve_configured_url(url, "the engine")
        except ValueError as e:
            return Check(what, False, str(e))
        what = f"{url} ({source})"
    t0 = time.monotonic()
    deadline = deadline if deadline is not None else first_answer_deadline(timeout)
    try:
        store = bounded(lambda: open_for_command(url), timeout, url, deadline=deadline)
    except NoAnswerError as e:
        return Check(what, False, _line(e), stuck=True)
    except Exception as e:
        return Check(what, False, f"cannot open: {_line(e)}")
    try:
        probe(store, url, timeout) if is_remote(url) else bounded(lambda: next(iter(store.list("")), None),
                                                                    timeout, url, deadline=deadline)
    except NoAnswerError as e:
        return Check(what, False, _line(e), stuck=True)  # the stuck call is left behind, not closed
    except Exception as e:
        store.close()
        hint = "" if exit_code_for(e) == 2 else f" (endpoint {endpoint_hint(url, store)})"
        return Check(what, False, f"{_line(e)}{hint}")
    store.close()
    return Check(what, True, f"answered a listing in {time.monotonic() - t0:.2f} s")


def _line(e: BaseException) -> str:
    return redact(" ".join(str(e).split())) or type(e).__name__


def register(app: typer.Typer) -> None:
    @app.command("doctor")
    def doctor(
        urls: Annotated[list[str] | None, typer.Argument(
            help="More store URLs to check (hf://buckets/ns/name or the bucket id ns/name, "
            "s3://bucket/prefix, a directory).",
            show_default=False, callback=store_url)] = None,
        timeout: Annotated[float, typer.Option(
            "--timeout", envvar=TIMEOUT_ENV, min=0.1, max=MAX_TIMEOUT_S,
            help="Seconds the whole command may take, counted from its start: every check shares them "
            "(one still waiting then is a FAIL line and the report is printed); given (or "
            f"${TIMEOUT_ENV}), they bound --model's measurement too.")] = DOCTOR_TIMEOUT_S,
        model: Annotated[str | None, typer.Option(
            "--model", help="Also measure each URL's round trip and throughput (writes a few random objects "
            "under _kvbucket_doctor/ and removes them) and say whether a remote hit beats recomputing "
            f"the prompt for this model shape: {', '.join(MODEL_SHAPES)}.", show_default=False)] = None,
        prompt_tokens: Annotated[int, typer.Option(
            "--prompt-tokens", min=1, help="With --model: the prompt a hit replaces.")] = PROMPT_TOKENS,
        fmt: FormatOpt = Format.table,
        as_json: JsonOpt = False,
    ) -> None:
        """Print what a bug report needs: versions, endpoints (secrets redacted), reachability.

        Checks $HF_ENDPOINT and $AWS_ENDPOINT_URL when set, whom the Hugging Face token belongs
        to (as `hf auth whoami`), the compile-cache target, and $KVBUCKET_REMOTE_URL and URLS when
        given. Exits 1 when any of them does not answer or the token is refused.
        With --model, also times lookups and loads on each URL and says whether a remote hit
        beats recomputing the prompt.
        """
        if model is not None and model not in MODEL_SHAPES:
            raise typer.BadParameter(f"{model!r} is not one of {', '.join(MODEL_SHAPES)}",
                                     param_hint="--model")
        if model is not None and not urls:
            raise typer.BadParameter("measures the store URLs given on the command line: name one",
                                     param_hint="--model")
        as_json = wants_json(fmt, as_json)
        rows = environment()
        deadline = first_answer_deadline(timeout)  # every check shares it (docs/cli.md, --timeout)
        if model is not None and timeout_given():  # the measurement too: the whole command
            Watchdog(deadline + 0.05, lambda: (
                f"kvbucket doctor did not finish within {timeout:g} s (--timeout bounds the whole command, "
                f"--model's measurement included): raise --timeout{_leftovers()}"))
        jobs: list[tuple[str, Callable[[], Check | None]]] = []
        for var in ("HF_ENDPOINT", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            if url := os.environ.get(var, "").strip():
                jobs.append((f"${var} {redact(url)}", lambda var=var, url=url: check_endpoint(
                    f"${var}", url, timeout, ENDPOINT_PATHS.get(var, ""), deadline)))
        jobs.append(("token", lambda: check_token(timeout, deadline)))
        for url, source in configured_stores(list(urls or [])):
            jobs.append((f"{url} ({source})",
                         lambda url=url, source=source: check_store(url, source, timeout, deadline)))
        checks = run_checks(jobs, deadline, timeout)
        if not all(c.ok for c in checks if c.what.startswith("$HF_ENDPOINT")):  # its FAIL says why
            checks = [c if not c.what.startswith("token") or c.detail.startswith("none") else
                      Check(c.what, False, "not checked: $HF_ENDPOINT did not answer (see its line)")
                      for c in checks]
        if as_json:
            _doctor_json(rows, checks, list(urls or []), model, prompt_tokens)
            return
        typer.echo("kvbucket doctor (paste this into a bug report: tokens and keys are never shown)")
        typer.echo("\nversions:")
        for name, version in package_versions():
            typer.echo(f"  {name:<18}{version}")
        typer.echo("\nenvironment:")
        for name, value in rows:
            typer.echo(f"  {name:<28}{value}")
        if not rows:
            typer.echo("  (no HF_*, AWS_* or KVBUCKET_* variables set)")
        typer.echo(f"  {'saved Hugging Face login':<28}{saved_hf_login()}")
        typer.echo("\nreachability:")
        for c in checks:
            typer.echo(redact(f"  {'ok  ' if c.ok else 'FAIL'}  {c.what}: {c.detail}"))
        if all(c.what == "token" for c in checks):
            typer.echo("  nothing configured: no $HF_ENDPOINT, $AWS_ENDPOINT_URL, compile-cache target or "
                       "URL arguments")
        _exit_for(checks)
        if model is not None:
            _report_remote_hit(list(urls or []), Budget(MODEL_SHAPES[model], prompt_tokens))


def run_checks(jobs: list[tuple[str, Callable[[], Check | None]]], deadline: float,
               timeout: float) -> list[Check]:
    """Every check at once, each bounded by the command's ``deadline``, in the order given: one
    slow endpoint does not spend the others' time. A check with nothing to check returns None."""
    futures = [(what, in_daemon_thread(job, "kvbucket-doctor")) for what, job in jobs]
    out: list[Check] = []
    for what, fut in futures:
        try:
            check = fut.result(timeout=left(deadline) + 1.0)  # each is bounded by deadline itself
        except FutureTimeout:
            check = Check(what, False, f"no answer within {timeout:g} s (doctor's --timeout bounds the whole "
                          "command); raise --timeout", stuck=True)
        except Exception as e:
            check = Check(what, False, _line(e))
        if check is not None:
            out.append(check)
    return out


def _exit_for(checks: list[Check]) -> None:
    if any(c.stuck for c in checks):
        # a store call stuck on a silent endpoint still holds a client thread: leave now
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    if any(not c.ok for c in checks):
        raise typer.Exit(1)


def _doctor_json(rows: list[tuple[str, str]], checks: list[Check], urls: list[str], model: str | None,
                 prompt_tokens: int) -> None:
    """``doctor --format json``: the same facts as the text, one document (secrets redacted)."""
    body: dict[str, Any] = {
        "versions": dict(package_versions()),
        "environment": dict(rows),
        "saved_hf_login": saved_hf_login(),
        "checks": [{"what": redact(c.what), "ok": c.ok, "detail": redact(c.detail)} for c in checks],
        "remote_hit": None,
    }
    if model is not None and all(c.ok for c in checks):
        budget = Budget(MODEL_SHAPES[model], prompt_tokens)
        body["remote_hit"] = []
        for url in urls:
            m = _measure(url, budget)
            beats, why = verdict(budget, m)
            body["remote_hit"].append({"url": url, "model": model, "prompt_tokens": prompt_tokens,
                                       **asdict(m), "round_trips": m.round_trips, "gbps": m.gbps,
                                       "beats_recompute": beats, "why": why})
    print_json(body)
    _exit_for(checks)


#: (url, prefix) of the measurements under way: what the watchdog's line says to remove.
_MEASURING: list[tuple[str, str]] = []


def removal_command(url: str, run: str) -> str:
    """The command that removes one measurement's objects."""
    return f"kvbucket rm {shlex.quote(url)} --prefix {run}/ --yes"


def _leftovers() -> str:
    """For the watchdog's line: how to remove what the measurements under way wrote."""
    if not _MEASURING:
        return ""
    cmds = "; ".join(removal_command(u, r) for u, r in _MEASURING)
    return f"; the objects it wrote may remain: remove them with {cmds}"


def _measure(url: str, budget: Budget) -> Measurement:
    """:func:`measure` on ``url`` as an engine opens it (its read deadlines included); a store that
    fails it (a load past its deadline, a refused write) is one line, exit 1, with the command
    that removes its objects when its cleanup could not confirm them gone."""
    from kvbucket.stores import open_store

    run = new_run()
    _MEASURING.append((url, run))
    try:
        m = measure(lambda: open_store(url), budget.shape.layout.full_chunk_bytes,
                    small_objects=min(budget.chunks, MAX_SMALL_OBJECTS), run=run)
    except MeasureFailed as e:
        left = f"; its objects may remain: remove them with {removal_command(url, e.left)}" if e.left else ""
        raise fail(f"measuring {url} failed: {_line(e)}{left}", 1) from None
    except (RuntimeError, KVBucketError, OSError) as e:  # opening the store
        raise fail(f"measuring {url} failed: {_line(e)}", 1) from None
    _MEASURING.remove((url, run))
    return m


def _report_remote_hit(urls: list[str], budget: Budget) -> None:
    """Measure each store and say whether a hit beats recompute (docs/remote-hit.md)."""
    typer.echo(f"\nremote hit vs recompute: {budget.shape.name} ({budget.shape.describe()})")
    for url in urls:
        typer.echo(f"  {url}:")
        m = _measure(url, budget)
        trips = f" = {m.round_trips:.1f} round trips" if m.round_trips is not None else " (no network)"
        typer.echo(f"    one lookup: {m.rtt_s * 1000:.1f} ms (median of {RTT_SAMPLES}); lookup + load of "
                   f"{m.small_objects} small objects: {m.small_load_s * 1000:.0f} ms{trips}")
        typer.echo(f"    lookup + load of {m.chunk_objects} x {human_bytes(m.chunk_bytes)}: "
                   f"{m.chunk_load_s:.2f} s = {m.gbps:.2f} GB/s after the round trips")
        for line in verdict(budget, m)[1]:
            typer.echo(f"    {line}")

"""What every store-facing command shares: exit statuses, the first-answer probe, ``--timeout``.

Exit statuses: 2 when the user must change the command line or its environment (a malformed
URL, a bucket or directory that does not exist, a refused token), 1 when the store failed or
could not be reached (unreachable, no answer, server errors) and trying again later may work.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Annotated, Any, NoReturn, TypeVar

import typer

from kvbucket.errors import AuthError, ConfigError, InvalidKeyError, KVBucketError, NotFoundError, StoreError
from kvbucket.secrets import redact
from kvbucket.stores import ObjectStore, open_store, store_scheme
from kvbucket.stores.deadline import deadline_in, run_abandonable
from kvbucket.stores.urls import HANDLE_SCHEME, ambiguous, both_spellings, resolve_store_url

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 30.0
#: The largest --timeout taken (a week): past it (inf, 1e300) a deadline is no instant the clocks
#: and sockets can hold, so it is refused at parse time with exit 2 (docs/cli.md).
MAX_TIMEOUT_S = 7 * 24 * 3600.0
TIMEOUT_ENV = "KVBUCKET_TIMEOUT"

TimeoutOpt = Annotated[
    float,
    typer.Option(
        "--timeout", envvar=TIMEOUT_ENV, min=0.1, max=MAX_TIMEOUT_S,
        help="Seconds the whole command may take, every request in it included, counted from its start; "
        f"without it, a remote store's first answer is due within {DEFAULT_TIMEOUT_S:g} s and the command "
        f"then runs as long as the store answers (also ${TIMEOUT_ENV}).",
    ),
]
#: ``--timeout`` of commands whose work is not bounded by it (demo, compile-cache): the first answer
FirstAnswerTimeoutOpt = Annotated[
    float,
    typer.Option(
        "--timeout", envvar=TIMEOUT_ENV, min=0.1, max=MAX_TIMEOUT_S,
        help="Seconds to wait for a remote store's first answer; an endpoint that accepts connections "
        f"but never answers fails after this (default {DEFAULT_TIMEOUT_S:g}; also ${TIMEOUT_ENV}).",
    ),
]


class NoAnswerError(StoreError):
    """A store did not answer within the CLI's ``--timeout``."""


def exit_code_for(e: BaseException) -> int:
    """2: fix the input or the environment (URL, bucket, token, a directory's permissions);
    1: the store failed or was unreachable."""
    if isinstance(e, ConfigError | InvalidKeyError | NotFoundError | AuthError | ValueError):
        return 2
    return 2 if isinstance(e, _FIX_THE_PATH) else 1


#: local-file errors the user fixes (a missing or unreadable directory), never worth a retry
_FIX_THE_PATH = (PermissionError, FileNotFoundError, NotADirectoryError)


def error_text(e: BaseException) -> str:
    """An error as the user reads it: an OS error says what to do with its path, not ``[Errno 13]``."""
    if isinstance(e, PermissionError):
        where = f" {e.filename}" if e.filename else ""
        return (f"permission denied on{where}: the user running kvbucket cannot read or write it; fix "
                "its permissions or owner (chmod/chown), or use another directory")
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}: {e.filename}" if e.filename else e.strerror
    return str(e)


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``error: message`` as one line on stderr (secrets redacted); the Exit to raise."""
    typer.echo(f"error: {redact(' '.join(message.split()))}", err=True)
    return typer.Exit(code)


_exiting = threading.Lock()


def exit_now(message: str, code: int = 1) -> NoReturn:
    """Print the error and leave at once: a call stuck in a client's thread must not hold the exit.
    One caller prints (a watchdog and a stuck probe may both give up at the deadline)."""
    _exiting.acquire()
    typer.echo(f"error: {redact(' '.join(message.split()))}", err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


#: store URLs a command was given as bucket ids -> the id as typed (for the hint of an error)
_TYPED_AS_ID: dict[str, str] = {}


def store_url(value: Any) -> Any:
    """A typer callback for URL arguments and options: a Hub bucket id (``alice/kv[/prefix]``)
    becomes ``hf://buckets/alice/kv[/prefix]`` (the rule: :mod:`kvbucket.stores.urls`); anything
    else is kept as typed. Takes a value or a list of them (``None`` stays ``None``)."""
    if isinstance(value, list | tuple):
        return [store_url(v) for v in value]
    if not isinstance(value, str):
        return value
    resolved = resolve_store_url(value)
    if resolved != value:
        _TYPED_AS_ID[resolved] = value
    return resolved


def as_id_hint(url: str) -> str:
    """For a URL typed as a bucket id: how it was read, and how to name the directory instead."""
    typed = _TYPED_AS_ID.get(url)
    if typed is None:
        return ""
    return f" ({typed!r} was read as the Hub bucket id {url}; write ./{typed} for a local directory)"


def refuse_ambiguous(url: str, what: str) -> None:
    """A command that removes things never guesses: text that is both a local path (its first
    segment exists here) and a bucket id is refused (exit 2), saying how to write each."""
    if ambiguous(url):
        raise fail(both_spellings(url, what))


def describe_target(url: str, store: Any) -> str:
    """What a store URL resolved to, in words: a bucket and the endpoint it is on, or an absolute
    directory (never a secret)."""
    url = resolve_store_url(url)
    if url.startswith(HANDLE_SCHEME):
        return f"the Hub bucket {url[len(HANDLE_SCHEME):]} at {endpoint_hint(url, store)}"
    if url.startswith("s3://"):
        return f"the S3 bucket {url} at {endpoint_hint(url, store)}"
    root = getattr(store, "root", None)
    if root is not None:
        return f"the directory {os.path.abspath(root)}"
    return redact(url)


def is_remote(url: str) -> bool:
    return resolve_store_url(url).startswith(("hf://", "s3://"))


def endpoint_hint(url: str, store: Any = None) -> str:
    """Which endpoint a URL goes to and where that came from (never a secret)."""
    url = resolve_store_url(url)
    if url.startswith("hf://"):
        endpoint = getattr(store, "endpoint", None) or os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
        source = "$HF_ENDPOINT" if os.environ.get("HF_ENDPOINT") else "the default Hub endpoint"
        return f"{redact(endpoint)} ({source})"
    if url.startswith("s3://"):
        for var in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
            if os.environ.get(var):
                return f"{redact(os.environ[var])} (${var})"
        return "AWS S3 (no $AWS_ENDPOINT_URL)"
    return url


_command_started: float | None = None


def process_started() -> float:
    """The monotonic instant this process started (Linux: its start time in /proc), else now."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        ticks = int(fields[19])  # field 22, starttime: clock ticks after boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.monotonic() - max(0.0, age)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.monotonic()


def mark_command_start(at: float | None) -> None:
    """Where ``--timeout`` counts from (:func:`first_answer_deadline`): the console script passes
    the process's start, so that interpreter start-up and imports are inside the budget."""
    global _command_started
    _command_started = at


def first_answer_deadline(timeout: float) -> float:
    """``--timeout`` seconds after the command started (the process, for the console script): when
    the first remote answer is due, and, with ``--timeout`` given, when the whole command ends
    (:func:`command_watchdog`)."""
    start = _command_started if _command_started is not None else time.monotonic()
    return start + timeout


def bounded(fn: Callable[[], T], timeout: float, url: str, store: Any = None,
            deadline: float | None = None) -> T:
    """``fn()``'s result or error, or :class:`NoAnswerError` when it has not returned in ``timeout`` s
    (or by ``deadline``, a monotonic instant, when given).

    ``fn`` runs in a daemon thread: a client blocked on a socket that never answers is left
    behind (the command then exits with :func:`exit_now`).
    """
    return run_abandonable(
        fn,
        deadline if deadline is not None else deadline_in(timeout),
        lambda: NoAnswerError(
            f"no answer from {endpoint_hint(url, store)} within {timeout:g} s for {url}; check that the "
            "endpoint is a working store server, or raise --timeout"
        ),
    )


def probe(store: Any, url: str, timeout: float) -> None:
    """Ask a remote store for one listing entry within ``timeout`` seconds (else NoAnswerError).

    Run first by commands on remote stores, so a missing bucket, a refused token or a dead
    endpoint is one line before any work starts.
    """
    if not is_remote(url):
        return

    def first() -> None:
        for _ in store.list("", page_size=1):
            break

    bounded(first, timeout, url, store, first_answer_deadline(timeout))


def unreachable_hint(e: BaseException, url: str, store: Any = None) -> str:
    """The error's text, with the endpoint to check when the store could not be reached."""
    text = error_text(e)
    if exit_code_for(e) == 1 and not isinstance(e, NoAnswerError) and is_remote(url):
        text += f"; check that {endpoint_hint(url, store)} is up and reachable"
    return text


def probe_or_exit(store: Any, url: str, timeout: float) -> None:
    """:func:`probe` for a command: no answer exits at once; any other failure closes the store.

    A store error's text gets :func:`unreachable_hint`; the error is raised again for the
    command's own handling.
    """
    try:
        probe(store, url, timeout)
    except NoAnswerError as e:
        exit_now(str(e), 1)  # the stuck call would hold close() and the exit
    except BaseException as e:
        store.close()
        if isinstance(e, KVBucketError):
            e.args = (unreachable_hint(e, url, store),)
        raise


#: a remote store's read deadlines, per scheme: the inference path's (1 s lookups, 5 s loads) would
#: fail a command's whole reads on a slow but working endpoint, and the CLI has no option for them
MAX_READ_TIMEOUT_S = 3600.0
_READ_DEADLINES = {
    "s3": ("s3_lookup_timeout_secs", "s3_load_timeout_secs"),
    "hf": ("lookup_timeout_secs", "load_timeout_secs"),
}


def open_for_command(url: str, *, create: bool | None = False,
                     read_timeout: float | None = None) -> ObjectStore:
    """Open a store for one command. ``create=False`` (the default, for inspection) never creates
    a missing directory or bucket; an opener that does not know the option (it never creates
    anything) is opened without it; ``None`` leaves the opener's default. With ``read_timeout``, a
    remote store's reads (lookups, loads) get that many seconds (the command's ``--timeout``; at
    most an hour, the configs' bound), not the inference path's 1 s / 5 s deadlines. A Hub bucket
    store starts no thread at open (``prestart=False``): its 64 load and 64 request threads are for
    a serving engine's first batch, and a one-shot command would pay ~20 ms per open for them."""
    opts: dict[str, Any] = {} if create is None else {"create": create}
    scheme = store_scheme(url)
    if scheme == "hf":
        opts["prestart"] = False
    for key in _READ_DEADLINES.get(scheme, ()) if read_timeout is not None else ():
        opts[key] = min(read_timeout, MAX_READ_TIMEOUT_S)
    try:
        return open_store(url, **opts)
    except TypeError as e:
        if "create" not in opts or "create" not in str(e):
            raise
        del opts["create"]
        return open_store(url, **opts)


def timeout_given() -> bool:
    """True when the running command's ``--timeout`` came from the command line or $KVBUCKET_TIMEOUT
    (then it bounds the whole command), False for the default (it bounds the first answer)."""
    ctx = typer.main.get_current_context(silent=True)
    if ctx is None or "timeout" not in ctx.params:
        return False
    source = ctx.get_parameter_source("timeout")
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")


class Watchdog:
    """Ends the process with one line at ``deadline`` unless :meth:`cancel` came first: the bound
    of a whole command, whichever request inside it (a listing page, a GET trickling its body, a
    fleet status read) is the one still waiting."""

    def __init__(self, deadline: float, message: Callable[[], str]) -> None:
        self._done = threading.Event()
        self._deadline, self._message = deadline, message
        threading.Thread(target=self._run, name="kvbucket-cli-watchdog", daemon=True).start()

    def _run(self) -> None:
        if not self._done.wait(max(0.0, self._deadline - time.monotonic())):
            exit_now(self._message(), 1)

    def cancel(self) -> None:
        self._done.set()


def command_watchdog(url: str, timeout: float, store: Any = None,
                     bounds: str = "the whole command") -> Watchdog:
    """A :class:`Watchdog` at the command's ``--timeout`` deadline (a few ms after the probe's own,
    so that a probe that got no answer says so itself); ``bounds``: what ``--timeout`` bounds in
    this command, for its message."""
    return Watchdog(first_answer_deadline(timeout) + 0.05, lambda: (
        f"{url} did not finish within {timeout:g} s (--timeout bounds {bounds}): no answer, or "
        f"too slow a one, from {endpoint_hint(url, store)}; check that the endpoint is a working store "
        "server, or raise --timeout"))


@contextlib.contextmanager
def opened_store(url: str, timeout: float = DEFAULT_TIMEOUT_S, *,
                 whole: bool = True) -> Iterator[ObjectStore]:
    """Open a store for inspection (:func:`open_for_command`: never create a missing directory or
    bucket). A remote store is probed first, so a missing bucket, a refused token or an endpoint
    that never answers is one line at once. ``whole=False``: the command's ``--timeout`` bounds its
    first answer only (demo, compile-cache), and its messages say so.
    """
    def hint(e: BaseException) -> str:  # a refused id may have meant a directory; a dead endpoint did not
        return as_id_hint(url) if exit_code_for(e) == 2 else ""

    # --timeout given: the whole command; else the first answer (opening may ask who `me` is)
    bounds = "the whole command" if whole else "the first answer"
    watchdog = command_watchdog(url, timeout, bounds=bounds) if is_remote(url) else None
    try:
        with _opened(url, timeout, hint) as store:
            if watchdog is not None and (not whole or not timeout_given()):
                watchdog.cancel()
            yield store
    finally:
        if watchdog is not None:
            watchdog.cancel()


@contextlib.contextmanager
def _opened(url: str, timeout: float, hint: Callable[[BaseException], str]) -> Iterator[ObjectStore]:
    """:func:`opened_store` without the watchdog: open, probe, yield, close; errors as one line."""
    try:
        store = open_for_command(url, read_timeout=timeout)
    except KVBucketError as e:  # opening can ask the Hub too (`me`: whom the token names)
        raise fail(unreachable_hint(e, url) + hint(e), exit_code_for(e)) from None
    except (OSError, ValueError, TypeError) as e:
        raise fail(f"cannot open {url!r}: {error_text(e)}{hint(e)}", exit_code_for(e)) from None
    try:
        probe_or_exit(store, url, timeout)
    except KVBucketError as e:
        raise fail(str(e) + hint(e), exit_code_for(e)) from None
    try:
        yield store
    except BrokenPipeError:
        # `kvbucket ls URL | head`: the reader has gone; stop quietly like other Unix tools.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        raise typer.Exit(0) from None
    except (KVBucketError, OSError) as e:
        raise fail(unreachable_hint(e, url, store), exit_code_for(e)) from None
    finally:
        store.close()

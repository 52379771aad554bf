"""Whether a Hub call failed because nothing listens at the endpoint: one test, shared by the
error translation (:mod:`.errors`) and the token check (:mod:`.whoami`), which :mod:`.errors`
imports, so it lives below both."""

from __future__ import annotations

import httpx2


def connection_refused(exc: BaseException) -> bool:
    """The endpoint refused the TCP connection (nothing listens on that port): ``exc`` or an
    exception it was raised from is a ConnectionRefusedError, or an HTTP client's connect error
    saying so. Not worth a retry: a retry 0.5-8 s later would only delay the error line."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        said = str(e)
        if isinstance(e, ConnectionRefusedError) or (
                isinstance(e, httpx2.ConnectError) and ("Errno 111" in said or "refused" in said.lower())):
            return True
        e = e.__cause__ or e.__context__
    return False

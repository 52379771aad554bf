"""Object names of cache keys: kvbucket's own and those LMCache 0.5.6's built-in adapters write.

A bucket shared with LMCache nodes holds objects under LMCache's names; kvbucket reads them
(default) and, with ``object_format="lmcache"``, writes them too. The names, exactly as
LMCache 0.5.6 builds them (read from its sources):

============================  ==========================================================================
LMCache writer                object name (``s = <model>@<kv_rank:08x>@<group:x>@<hash hex>[@<salt>]``)
============================  ==========================================================================
MP ``hfbucket`` adapter       ``<prefix>/`` + ``quote(s, safe="")`` (``/`` and ``@`` escaped)
MP ``s3`` adapter             ``s`` at the bucket root (no prefix; ``/`` in the model stays)
MP ``fs`` adapter             ``<model, / as -SEP->@<kv_rank:#010x>@<group:x>@<hash hex>[@<salt>].data``
non-MP ``hfbucket`` connector ``<prefix>/`` + ``quote(key.to_string(), safe="")``
non-MP ``s3`` connector       ``key.to_string().replace("/", "_")`` at the bucket root
============================  ==========================================================================

kvbucket's own names are :func:`kvbucket.keys.key_to_name` (``@`` kept, group folded into the
rank as ``kv_rank | group << 32``). The two never collide: LMCache's hfbucket names escape every
``@`` and kvbucket's always hold one; LMCache's s3 names carry the 8-digit rank and the group
field, kvbucket's the unpadded rank.

Every write goes through :meth:`Naming.write_item` (one place where a payload can be wrapped,
e.g. sealed, for kvbucket's names, and left raw for LMCache's); every read tries
:meth:`Naming.read_names` in order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal
from urllib.parse import unquote

from kvbucket.errors import InvalidKeyError
from kvbucket.identity.core import (
    IdentityPending,
    IdentitySetting,
    qualify_key_string,
    split,
    split_key_string,
    warn_name_only,
)
from kvbucket.keys import ObjectKey, as_key_string, key_to_name, name_to_key
from kvbucket.stores.base import Buffer, check_name, check_prefix

ObjectFormat = Literal["kvbucket", "lmcache"]
OBJECT_FORMATS: tuple[str, ...] = ("kvbucket", "lmcache")
GROUP_SHIFT = 32
_RANK_MASK = (1 << GROUP_SHIFT) - 1
_FS_SLASH = "-SEP-"
_FS_EXT = ".data"


# ---- LMCache's MP key string ----------------------------------------------------------------
def lmcache_key_string(key: ObjectKey, *, fs: bool = False) -> str:
    """LMCache 0.5.6's ``_object_key_to_string`` (hfbucket/s3), or its fs file name stem."""
    rank, group = key.kv_rank & _RANK_MASK, key.kv_rank >> GROUP_SHIFT
    if fs:
        s = f"{key.model_name.replace('/', _FS_SLASH)}@{rank:#010x}@{group:x}@{bytes(key.chunk_hash).hex()}"
    else:
        s = f"{key.model_name}@{rank:08x}@{group:x}@{bytes(key.chunk_hash).hex()}"
    return f"{s}@{key.cache_salt}" if key.cache_salt else s


def parse_lmcache_key_string(s: str, *, fs: bool = False) -> ObjectKey | None:
    """The key of an LMCache MP key string, or None when it is not one (then it is foreign)."""
    parts = s.split("@")
    if len(parts) not in (4, 5):
        return None
    model, rank_s, group_s, hash_s = parts[:4]
    try:
        rank, group, chunk_hash = int(rank_s, 16), int(group_s, 16), bytes.fromhex(hash_s)
        if fs:
            model = model.replace(_FS_SLASH, "/")
        key = ObjectKey(model, rank | group << GROUP_SHIFT, chunk_hash, parts[4] if len(parts) == 5 else "")
    except (ValueError, InvalidKeyError):
        return None
    if rank > _RANK_MASK or lmcache_key_string(key, fs=fs) != s:
        return None  # not the canonical spelling LMCache writes: not LMCache's object
    return key


# ---- per-writer styles ----------------------------------------------------------------------
class _Style:
    """How one LMCache writer turns a key string into an object name (relative to a prefix)."""

    def __init__(self, encode: Callable[[str], str], decode: Callable[[str], str | None]) -> None:
        self.encode, self.decode = encode, decode


# ``urllib.parse.quote(s, safe="")`` as a byte table (the same output, several times faster; names
# are built per key on the lookup path).
_QUOTE_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-~")
_QUOTE_TABLE = tuple(chr(b) if b in _QUOTE_SAFE else f"%{b:02X}" for b in range(256))


def quote_all(s: str) -> str:
    """``urllib.parse.quote(s, safe="")``: what LMCache's hfbucket writers name objects with."""
    return "".join(map(_QUOTE_TABLE.__getitem__, s.encode("utf-8")))


def _hf_decode(seg: str) -> str | None:
    s = unquote(seg)
    return s if quote_all(s) == seg else None


def _s3_mp_decode(rel: str) -> str | None:
    return rel


def _s3_conn_decode(rel: str) -> str | None:
    return None if "/" in rel else rel  # "/" became "_": the model's slash is not recoverable


def _fs_decode(rel: str) -> str | None:
    return rel[: -len(_FS_EXT)] if rel.endswith(_FS_EXT) and "/" not in rel else None


#: MP adapters' styles by kvbucket adapter type.
MP_STYLES: dict[str, _Style] = {
    "hfbucket": _Style(quote_all, _hf_decode),
    "s3": _Style(lambda s: s, _s3_mp_decode),
    "fs": _Style(lambda s: s + _FS_EXT, _fs_decode),
}
#: Non-MP connectors' styles (the key string is LMCache's ``CacheEngineKey.to_string()``).
CONNECTOR_STYLES: dict[str, _Style] = {
    "hfbucket": _Style(quote_all, _hf_decode),
    "s3": _Style(lambda s: s.replace("/", "_"), _s3_conn_decode),
}


class Naming:
    """The names one adapter writes and reads.

    ``object_format="kvbucket"`` (default): write kvbucket's names; read kvbucket's, then
    LMCache's. ``"lmcache"``: write LMCache's names, raw bytes (so LMCache nodes read them);
    read LMCache's, then kvbucket's. ``style`` None: kvbucket's names only.

    ``identity`` (a ``model_identity`` setting, :mod:`kvbucket.identity`): kvbucket's names carry
    the model's identity token (``<model>~<token>@...``); names of other identities are not this
    reader's (a miss, never deleted), nor are name-only ones (kvbucket's names without a token,
    LMCache's) unless ``accept_name_only``. Without an identity every name is name-only, as before.
    """

    def __init__(
        self,
        prefix: str = "",
        *,
        style: str | None = None,
        object_format: str = "kvbucket",
        connector: bool = False,
        identity: IdentitySetting | None = None,
        accept_name_only: bool = False,
    ) -> None:
        if object_format not in OBJECT_FORMATS:
            raise ValueError(f"object_format must be one of {', '.join(OBJECT_FORMATS)}: {object_format!r}")
        styles = CONNECTOR_STYLES if connector else MP_STYLES
        if style is not None and style not in styles:
            if object_format == "lmcache":
                raise ValueError(
                    f'object_format "lmcache" is not available for {style!r}'
                    f" (LMCache formats exist for: {', '.join(sorted(styles))})"
                )
            style = None
        self.prefix = check_prefix(prefix)
        self.style = style
        self._lm = styles[style] if style is not None else None
        self._fs = style == "fs" and not connector
        self._connector = connector
        self.object_format = object_format
        self.writes_lmcache = object_format == "lmcache"
        self._is_lm: dict[str, bool] = {}
        self.identity = identity if identity is not None else IdentitySetting(None)
        if self.identity and self.writes_lmcache:
            raise ValueError('object_format "lmcache" writes LMCache\'s names, which cannot carry a model '
                             'identity: drop model_identity, or use object_format "kvbucket"')
        self.accept_name_only = accept_name_only or not self.identity
        #: Called with a model name when a key of it is named (first sight) and written (manifests).
        self.on_model: Callable[[str], None] | None = None
        self.on_write: Callable[[str], None] | None = None

    # -- identity
    def _token(self, key: Any) -> str | None:
        if not self.identity:
            return None
        model = _model_of(key)
        if self.on_model is not None:
            self.on_model(model)
        return self.identity.token(model)

    def readable(self, model: str, token: str | None) -> bool:
        """Whether a name of ``model`` written with ``token`` (None: name-only) is this reader's."""
        try:
            mine = self.identity.token(model) if self.identity else None
        except IdentityPending:  # not known yet: no name is this reader's (listings, fleet journals)
            return False
        return (self.accept_name_only or mine is None) if token is None else token == mine

    def own_key(self, key: ObjectKey) -> ObjectKey | None:
        """``key`` as parsed from a name (its model may carry a token) as this reader's key, or
        None when the name is not this reader's (another identity; name-only unless accepted)."""
        bare, token = split(key.model_name)
        if not self.readable(bare, token):
            return None
        return key if token is None else ObjectKey(bare, key.kv_rank, key.chunk_hash, key.cache_salt)

    # -- names
    def kvbucket_name(self, key: Any) -> str:
        token = self._token(key)
        if token is None:
            return key_to_name(key, self.prefix)
        return key_to_name(qualify_key_string(as_key_string(key), token), self.prefix)

    def lmcache_name(self, key: Any) -> str | None:
        if self._lm is None:
            return None
        s = as_key_string(key) if self._connector else lmcache_key_string(key, fs=self._fs)
        rel = self._lm.encode(s)
        return check_name(f"{self.prefix}/{rel}" if self.prefix else rel)

    def write_name(self, key: Any) -> str:
        if self.writes_lmcache:
            name = self.lmcache_name(key)
            assert name is not None
            return name
        return self.kvbucket_name(key)

    def read_names(self, key: Any) -> tuple[str, ...]:
        """Names to try, in order; the first is the one this adapter writes. Name-only names
        (LMCache's, kvbucket's without a token) only when this reader accepts them."""
        kv = self.kvbucket_name(key)
        if not self.accept_name_only:
            return (kv,)
        legacy = key_to_name(key, self.prefix) if self.identity else None
        try:
            lm = self.lmcache_name(key)
        except InvalidKeyError:  # LMCache's spelling would leave the prefix: never read it
            lm = None
        ordered = (lm, kv) if self.writes_lmcache else (kv, legacy, lm)
        return tuple(dict.fromkeys(n for n in ordered if n is not None))

    def is_lmcache_name(self, name: str) -> bool:
        """Whether ``name`` is in LMCache's format (raw chunk bytes, no kvbucket envelope)."""
        hit = self._is_lm.get(name)
        if hit is None:
            hit = self.parse_lmcache(name) is not None
            if len(self._is_lm) >= 1 << 20:
                self._is_lm.clear()
            self._is_lm[name] = hit
        return hit

    def write_item(self, key: Any, data: Buffer, name: str | None = None) -> tuple[str, Buffer]:
        """The one place a key and its bytes become the stored object (name, payload).

        LMCache-format objects hold the raw chunk bytes, exactly what LMCache writes. ``name``:
        the key's :meth:`write_name`, when the caller already has it (the L2 adapter caches
        names, so a key stored and then looked up is encoded once).
        """
        if self.on_write is not None:
            self.on_write(_model_of(key))
        return (name if name is not None else self.write_name(key)), data

    # -- parsing (listings)
    def _relative(self, name: str) -> str | None:
        if not self.prefix:
            return name
        return name[len(self.prefix) + 1 :] if name.startswith(self.prefix + "/") else None

    def parse_lmcache(self, name: str) -> Any | None:
        """The key of an object in LMCache's format (an ObjectKey, or a key string for the
        non-MP connector), else None."""
        if self._lm is None:
            return None
        rel = self._relative(name)
        if rel is None:
            return None
        s = self._lm.decode(rel)
        if s is None:
            return None
        if self._connector:
            return s if self._lm.encode(s) == rel else None
        return parse_lmcache_key_string(s, fs=self._fs)

    def parse(self, name: str) -> ObjectKey | None:
        """The MP key an object name holds (either format), or None for a foreign object or one
        this reader does not read (another identity; name-only unless accepted)."""
        try:
            bare, token = split_key_string(name_to_key(name, self.prefix))
            key = ObjectKey.from_string(bare)
        except InvalidKeyError:
            pass
        else:
            return key if self.readable(key.model_name, token) else None
        lm = self.parse_lmcache(name)
        return lm if isinstance(lm, ObjectKey) and self.readable(lm.model_name, None) else None

    def parse_key_string(self, name: str) -> str | None:
        """Connector listings: the key string of an object name (either format), or None (as
        :meth:`parse`)."""
        try:
            bare, token = split_key_string(name_to_key(name, self.prefix))
        except InvalidKeyError:
            pass
        else:
            return bare if self.readable(bare.partition("@")[0], token) else None
        s = self.parse_lmcache(name)
        return s if isinstance(s, str) and self.readable(s.partition("@")[0], None) else None


def watch_identities(naming: Naming, store: Any, where: str, key: str = "model_identity",
                     accept: str = "accept_name_only") -> None:
    """Keep the identity manifests of ``naming``'s models on ``store`` (the raw store: readers of
    every identity read them), or warn once that reuse is keyed by the model's name only (``key``
    and ``accept``: the settings to name, spelled where the user sets them)."""
    if not naming.identity:
        warn_name_only(where, key, accept)
        return
    from kvbucket.identity.manifest import ManifestBook

    book = ManifestBook(store, naming.prefix, naming.identity, where)
    naming.on_model, naming.on_write = book.seen, book.wrote


def _model_of(key: Any) -> str:
    model = getattr(key, "model_name", None)
    return model if isinstance(model, str) else as_key_string(key).partition("@")[0]


__all__ = [
    "CONNECTOR_STYLES",
    "GROUP_SHIFT",
    "MP_STYLES",
    "OBJECT_FORMATS",
    "Naming",
    "ObjectFormat",
    "lmcache_key_string",
    "parse_lmcache_key_string",
    "watch_identities",
]

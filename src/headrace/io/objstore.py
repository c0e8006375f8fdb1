"""Object storage URLs (``s3://``, ``gs://``, ``az://``, ``http(s)://``, ``file://``) wherever
a file name goes.

Why this module: a pipeline reads its shards from a bucket more often than from a
local disk, and a URL must behave like a path. It counts against the descriptor cap
(G2). The file pool suspends it and resumes it at a byte offset. Its read buffer is
booked on the memory budget (G1). A dropped connection neither loses nor repeats a
byte.

The client is `obstore <https://developmentseed.org/obstore/>`_ (MIT/Apache-2.0): one
wheel with no Python dependencies, the Rust ``object_store`` crate inside. It gives
one API for S3, GCS, Azure and HTTP, with synchronous calls (no event loop to run
beside the pipeline). It streams range reads, pages listings, and uploads atomically
(a single PUT, or a multipart upload completed only at the end). Against the same
moto server it read at least as fast as ``s3fs`` and ``pyarrow.fs``
(``benchmarks/bench_object_store.py --compare-clients``; see
docs/guide/object-storage.md). Its install is far smaller than s3fs's
aiobotocore/botocore stack, and unlike ``pyarrow.fs`` it has an HTTP store. Install
it with the ``headrace[s3]`` (or ``[gcs]``, ``[azure]``) extra.

How a remote stream maps onto the file pool: an *open* remote stream holds one slot
of the pool. That slot is its "descriptor": the object's metadata, and the right to
have one request in flight, on a connection that lives only as long as the request
(the client keeps no idle connections: see :func:`_client_options`). Suspending the
stream gives the slot back and keeps only the byte offset. Resuming checks the
object again: the same ETag, so an object replaced meanwhile is an error, not a
silent mix of two versions. Every read is one ranged GET, streamed. If the
connection drops, or the server answers 5xx or throttles, the read is retried with
exponential backoff from the first byte not yet received. So no byte is lost or read
twice.

Credentials come from each cloud's standard environment, or from :func:`configure`:

- AWS: ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
  ``AWS_REGION``, ``AWS_ENDPOINT_URL``, the instance/container metadata services;
  where neither gives keys, the AWS shared files (``~/.aws/credentials``,
  ``~/.aws/config``, ``AWS_PROFILE``);
- Google: ``GOOGLE_APPLICATION_CREDENTIALS`` / ``GOOGLE_SERVICE_ACCOUNT``;
- Azure: ``AZURE_STORAGE_ACCOUNT_NAME`` / ``AZURE_STORAGE_ACCOUNT_KEY`` /
  ``AZURE_STORAGE_SAS_KEY`` ...

They are never part of a path, an error message, a pipeline's state or a log line:
only URLs are.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import os
import random
import re
import threading
import time
import urllib.parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from headrace._errors import DataLossError, InvalidArgumentError

if TYPE_CHECKING:
    from headrace.io.filepool import FileLimiter

__all__ = [
    "MIN_REMOTE_BUFFER_SIZE",
    "MIN_UPLOAD_PART",
    "REMOTE_BUFFER_SIZE",
    "RetryPolicy",
    "Successor",
    "configure",
    "copy_object",
    "delete_object",
    "first_range_size",
    "fitting_buffer",
    "glob_objects",
    "is_remote",
    "is_url",
    "list_objects",
    "local_path",
    "object_info",
    "put_atomic",
    "put_if_absent",
    "read_whole",
    "reset_stores",
]

REMOTE_BUFFER_SIZE = 8 * 1024 * 1024
"""Bytes asked for per ranged GET when the user gives no ``buffer_size``: a request costs
a round trip (tens of ms to a cloud), so the 256 KiB a local read uses would spend most of
its time waiting; 8 MiB is the size AWS recommends for ranged reads."""

_SCHEMES = ("s3", "s3a", "gs", "az", "abfs", "abfss", "http", "https")
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def is_url(path: Any) -> bool:
    """Whether ``path`` is a URL headrace reads through an object store (``file://``
    included, which names a local file)."""
    if not isinstance(path, str):
        return False
    match = _URL.match(path)
    return match is not None and match.group(1).lower() in (*_SCHEMES, "file")


def is_remote(path: Any) -> bool:
    """A URL of an object store or web server (not ``file://``)."""
    return is_url(path) and not path.lower().startswith("file://")


def local_path(path: str) -> str:
    """``file:///a/b`` -> ``/a/b``; any other path unchanged."""
    if isinstance(path, str) and path.lower().startswith("file://"):
        parsed = urllib.parse.urlparse(path)
        if parsed.netloc not in ("", "localhost"):
            raise InvalidArgumentError(f"{path}: a file:// URL names a local file (no host)")
        return urllib.parse.unquote(parsed.path)
    return path


@dataclass(frozen=True)
class RetryPolicy:
    """How a transient failure (a connection reset or timeout, a 5xx answer, throttling)
    of one ranged read or one listing page is retried: up to ``attempts`` tries in all,
    waiting ``initial_backoff * 2**n`` seconds (at most ``max_backoff``, with jitter)
    between them. The client's own retries (obstore's) come first, inside each try."""

    attempts: int = 8
    initial_backoff: float = 0.1
    max_backoff: float = 10.0

    def delay(self, failures: int) -> float:
        base = min(self.max_backoff, self.initial_backoff * (2 ** (failures - 1)))
        return float(base * (0.5 + random.random() / 2))


_lock = threading.Lock()
_stores: dict[str, Any] = {}
_options: dict[str, dict[str, Any]] = {}
_retry = RetryPolicy()


def configure(
    prefix: str | None = None,
    *,
    retry: RetryPolicy | None = None,
    client_options: Mapping[str, Any] | None = None,
    retry_config: Mapping[str, Any] | None = None,
    **config: Any,
) -> None:
    """Options for the stores of URLs under ``prefix`` (``"s3://bucket"``, a store's root),
    or headrace's retry policy for every store (``retry=``).

    ``config`` is the store's own configuration (obstore's ``S3Config`` /
    ``GCSConfig`` / ``AzureConfig`` keys: ``endpoint``, ``region``, ``access_key_id``,
    ...), merged over what the environment says. Why a function and not arguments of
    each dataset: credentials must never travel with a dataset's state or its cache
    key, so they live here, in the process, keyed by the store.

    ``client_options`` (obstore's ``ClientConfig``) go over headrace's: timeouts, and
    no idle connections kept, so that each socket counts against ``max_open_files``
    with its request (``{"pool_max_idle_per_host": "8"}`` keeps some alive instead,
    outside the cap).
    """
    global _retry
    with _lock:
        if retry is not None:
            if not isinstance(retry, RetryPolicy) or retry.attempts < 1:
                raise InvalidArgumentError(
                    f"configure: retry must be a RetryPolicy with attempts >= 1, got {retry!r}"
                )
            _retry = retry
        if prefix is None:
            if client_options or retry_config or config:
                raise InvalidArgumentError(
                    "configure: store options need the store's URL prefix ('s3://bucket')"
                )
            return
        root, _ = split_url(prefix)
        options: dict[str, Any] = dict(config)
        if client_options is not None:
            options["client_options"] = dict(client_options)
        if retry_config is not None:
            options["retry_config"] = dict(retry_config)
        # built once now (no request is made): an option the store does not take is an
        # error here, where it was given, not at the first read (the store itself is
        # made again on first use, after any fork)
        _make_store(root, dict(options))
        _options[root] = options
        _stores.pop(root, None)


def reset_stores() -> None:
    """Forget every store made and option given (tests; a changed environment)."""
    global _retry
    with _lock:
        _stores.clear()
        _options.clear()
        _retry = RetryPolicy()


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> (``s3://bucket``, ``a/b``); ``http://host:1/a`` likewise."""
    if not is_remote(url):
        raise InvalidArgumentError(
            f"{url!r} is not an object-store URL (s3://, gs://, az://, http(s)://)"
        )
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    root_name, _, key = rest.partition("/")
    if not root_name:
        raise InvalidArgumentError(f"{url}: the URL names no bucket or host")
    if scheme == "s3a":
        scheme = "s3"
    return f"{scheme}://{root_name}", key


def _store(root: str) -> Any:
    if _forked_after_use:
        raise InvalidArgumentError(
            f"{root}: this process was forked (os.fork, multiprocessing's 'fork' start "
            "method) after it had used the object-store client, whose runtime does not "
            "survive a fork; start worker processes with 'forkserver' or 'spawn' (PyTorch: "
            "DataLoader(..., multiprocessing_context='forkserver')), as headrace's own do"
        )
    with _lock:
        store = _stores.get(root)
        if store is not None:
            return store
        options = dict(_options.get(root, {}))
    global _used
    _used = True
    store = _make_store(root, options)
    with _lock:
        return _stores.setdefault(root, store)


def _make_store(root: str, options: dict[str, Any]) -> Any:
    try:
        from obstore.store import from_url
    except ImportError:  # (the extra is not installed)
        scheme = root.split("://", 1)[0]
        extra = {"gs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure"}.get(scheme, "s3")
        raise ImportError(
            f"reading {root}/... needs the obstore package: pip install 'headrace[{extra}]'"
        ) from None
    scheme = root.split("://", 1)[0]
    retry_config = options.pop("retry_config", None)
    client = _client_options(scheme, options)
    kwargs: dict[str, Any] = {"client_options": client}
    if scheme == "s3":
        provider = _s3_defaults(root, options)
        if provider is not None:
            kwargs["credential_provider"] = provider
    if retry_config is not None:
        kwargs["retry_config"] = retry_config
    if options:
        kwargs["config"] = options
    url = root + "/" if scheme in ("http", "https") else root
    try:
        return from_url(url, **kwargs)
    except BaseException as error:  # a missing account name, a bad option: say which store
        # (obstore panics on a configuration key it does not know: a BaseException that
        # would pass every ``except Exception`` of the caller's)
        if not isinstance(error, Exception) and type(error).__name__ != "PanicException":
            raise
        given = sorted(options)
        raise InvalidArgumentError(
            f"{root}: the object store cannot be set up ({_reason(error)}); the options "
            f"given: {given}; see headrace.io.objstore.configure (obstore's store "
            "configuration keys) and the cloud's environment variables"
        ) from None


def _client_options(scheme: str, options: dict[str, Any]) -> dict[str, str]:
    """The HTTP client's options: headrace's timeouts, no idle connections kept, plain
    HTTP allowed for an ``http`` store or endpoint, then the user's ``client_options``
    (taken out of ``options``) over them. For S3 the endpoint the AWS variables name is
    set first.

    No idle connections (G2): a socket is a descriptor, and the client's pool kept
    each connection open for 90 s after its request, outside any slot of the file
    pool. A burst of ``max_open_files`` requests left that many sockets beside the
    files opened next, and a request that started while the connection of the one
    before was still on its way back to the pool opened one more. Without the idle pool a connection lives for its request,
    inside the request's slot; the client closes it a moment after the body is read
    (on its own threads, so under load a few ms after the slot is given back). The
    cost: a new connection (and TLS handshake) per ranged read, against 8 MiB ranges
    by default. ``client_options={"pool_max_idle_per_host": "..."}`` brings the pool
    back, for a process that wants keep-alive more than an exact cap."""
    client = {"timeout": "60s", "connect_timeout": "10s", "pool_max_idle_per_host": "0"}
    if scheme == "http":
        client["allow_http"] = "true"
    client.update(options.pop("client_options", {}))
    if scheme == "s3" and "endpoint" not in options:
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            options["endpoint"] = endpoint
    endpoint = options.get("endpoint")
    if isinstance(endpoint, str) and endpoint.startswith("http://"):
        client["allow_http"] = "true"
    return client


def _s3_defaults(root: str, options: dict[str, Any]) -> Any:
    """The credential provider of the AWS shared files, or None; and the region
    us-east-1 in ``options`` when neither they, the options nor the environment name
    one."""
    provider = _aws_profile_credentials(root, options)
    if "region" not in options and not (
        os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        or (provider is not None and "region" in provider.config)
    ):
        options["region"] = "us-east-1"
    return provider


#: Options that give S3 credentials (or none) outright: the shared files are not read.
_S3_CREDENTIAL_OPTIONS = frozenset({
    "access_key_id", "aws_access_key_id", "secret_access_key", "aws_secret_access_key",
    "token", "session_token", "aws_session_token", "skip_signature", "aws_skip_signature",
})


def _aws_profile_credentials(root: str, options: dict[str, Any]) -> Any:
    """A credential provider for the AWS shared files, or None.

    The client reads credentials from the environment and the instance's role, but not
    from ``~/.aws/credentials`` and ``~/.aws/config`` (``AWS_PROFILE``,
    ``AWS_SHARED_CREDENTIALS_FILE``, ``AWS_CONFIG_FILE``), where most users keep them.
    boto3 reads those files as the AWS CLI does (SSO, assumed roles and
    ``credential_process`` included), so it is used when they exist and neither the
    environment nor ``configure`` gives keys. Without boto3 a named profile is an error
    that says what to install; without a profile the client's own chain is kept.
    """
    if _S3_CREDENTIAL_OPTIONS & set(options) or os.environ.get("AWS_ACCESS_KEY_ID"):
        return None
    profile = os.environ.get("AWS_PROFILE") or os.environ.get("AWS_DEFAULT_PROFILE")
    files = [os.path.expanduser(os.environ.get(name, default)) for name, default in (
        ("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials"),
        ("AWS_CONFIG_FILE", "~/.aws/config"),
    )]
    if not profile and not any(os.path.isfile(path) for path in files):
        return None
    try:
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        if profile:
            raise ImportError(
                f"{root}: AWS_PROFILE={profile} names a profile of the AWS shared files, "
                "which are read through boto3: pip install 'headrace[s3]'"
            ) from None
        return None
    try:
        session = boto3.Session(profile_name=profile) if profile else boto3.Session()
        if session.get_credentials() is None:
            return None  # (files without keys: the client's chain, the instance role)
        return Boto3CredentialProvider(session)
    except Exception as error:  # a missing profile, a malformed file: named, no secrets
        raise InvalidArgumentError(
            f"{root}: the AWS shared credentials cannot be read ({_reason(error)})"
        ) from None


# ---------------------------------------------------------------------- errors

_SECRET = re.compile(
    r"(?i)(X-Amz-[A-Za-z-]+|Signature|Credential|sig|se|sv|sp|AWSAccessKeyId|"
    r"access_?key(_id)?|secret(_access)?_?key|token)=[^&\s\"']+"
)


def _reason(error: BaseException) -> str:
    """The first line of a client error, with anything that looks like a signature or a
    key removed (a presigned URL's query, say): errors name URLs, never credentials."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return _SECRET.sub(lambda m: m.group(0).split("=", 1)[0] + "=<redacted>", text)[:300]


def _is_client_error(error: BaseException) -> bool:
    """An error of obstore's (some subclass OSError: FileNotFoundError, ...)."""
    if isinstance(error, _ShortBody):
        return True
    try:
        from obstore.exceptions import BaseError
    except ImportError:  # pragma: no cover
        return False
    return isinstance(error, BaseError)


def _kind(error: BaseException) -> str:
    """``"missing"``, ``"denied"``, ``"changed"``, ``"fatal"`` or ``"transient"``."""
    try:
        from obstore import exceptions as ox
    except ImportError:  # pragma: no cover - only reached with obstore present
        return "fatal"
    if isinstance(error, (ox.NotFoundError, FileNotFoundError)):
        return "missing"
    if isinstance(error, (ox.PermissionDeniedError, ox.UnauthenticatedError)):
        return "denied"
    if isinstance(error, ox.PreconditionError):
        return "changed"
    if isinstance(error, (ox.InvalidPathError, ox.NotSupportedError,
                          ox.UnknownConfigurationKeyError)):
        return "fatal"
    text = str(error)
    if re.search(r"\b(NoSuchBucket|NoSuchKey|404 Not Found)\b", text):
        return "missing"
    if re.search(r"\b(AccessDenied|InvalidAccessKeyId|SignatureDoesNotMatch|403 Forbidden|"
                 r"401 Unauthorized)\b", text):
        return "denied"
    return "transient"  # connection errors, timeouts, 5xx, throttling (503 SlowDown, 429)


def _mapped(error: BaseException, url: str, what: str) -> OSError:
    kind = _kind(error)
    reason = _reason(error)
    if kind == "missing":
        return FileNotFoundError(errno.ENOENT, f"no such object or bucket ({reason})", url)
    if kind == "denied":
        return PermissionError(errno.EACCES, f"access denied to {what} ({reason})", url)
    return OSError(errno.EIO, f"{what} failed ({reason})", url)


def _retrying(url: str, what: str, attempt: Any) -> Any:
    """``attempt(failures)`` until it succeeds, a transient failure retried under the
    retry policy; a permanent one (missing, denied) raised at once as an OSError naming
    ``url``. ``attempt`` keeps its own progress, so a retry resumes where it stopped."""
    policy = _retry
    failures = 0
    while True:
        try:
            return attempt(failures)
        except Exception as error:
            if isinstance(error, FileNotFoundError) and error.filename is None:
                kind = "missing"  # (obstore raises the builtin, naming no URL)
            elif isinstance(error, (ConnectionError, TimeoutError)) and error.filename is None:
                kind = "transient"
            elif _is_client_error(error):
                kind = _kind(error)
            else:
                raise  # ours, or the sink's (a ValueError, MemoryError): not retried
            if kind == "changed":
                raise DataLossError(
                    f"{url} changed while it was read (its ETag differs): the bytes read "
                    "so far belong to another version of the object", path=url
                ) from None
            failures += 1
            if kind != "transient" or failures >= policy.attempts:
                mapped = _mapped(error, url, what)
                if kind == "transient":
                    mapped = OSError(
                        errno.EIO, f"{what} failed {failures} times, the last: "
                        f"{_reason(error)}", url)
                raise mapped from None
            time.sleep(policy.delay(failures))


# ---------------------------------------------------------------------- objects


@dataclass(frozen=True)
class ObjectInfo:
    """What a HEAD says of an object: its size and version (ETag; None from a plain
    web server that sends none)."""

    url: str
    size: int
    etag: str | None
    last_modified: float | None


def object_size(url: str) -> int:
    """The size of the object at ``url``, its HEAD made on a slot of the file pool: a
    source sizing its objects before it opens them counts that connection against
    ``max_open_files`` like an open object (G2)."""
    from headrace.io.filepool import borrowed_slot

    with borrowed_slot():
        return object_info(url).size


def object_info(url: str) -> ObjectInfo:
    """The size and ETag of the object at ``url`` (one HEAD, retried if transient).

    Raises FileNotFoundError / PermissionError naming the URL when the bucket or the
    object is missing or not readable.
    """
    import obstore

    root, key = split_url(url)
    if not key or key.endswith("/"):
        raise IsADirectoryError(errno.EISDIR, "a URL ending in '/' names a prefix, not an object", url)
    store = _store(root)

    def attempt(_: int) -> ObjectInfo:
        meta = obstore.head(store, key)
        modified = meta.get("last_modified")
        return ObjectInfo(url, int(meta["size"]), meta.get("e_tag"),
                          modified.timestamp() if modified is not None else None)

    info: ObjectInfo = _retrying(url, "reading the object's metadata", attempt)
    return info


def read_range(info: ObjectInfo, offset: int, size: int, sink: Any) -> int:
    """Pass the ``size`` bytes at ``offset`` (fewer at the end of the object) to
    ``sink(piece)``; how many. Each GET's body is taken whole (one buffer, no copy
    per chunk: streaming it in chunks cost a third of the throughput against moto);
    a GET that fails is asked for again from the first byte not yet passed to the
    sink, so the sink sees each byte exactly once. Every GET is conditional on the
    ETag seen when the object was opened: a replaced object raises DataLossError."""
    import obstore

    end = min(info.size, offset + size)
    if end <= offset:
        return 0
    root, key = split_url(info.url)
    store = _store(root)
    done = [0]

    def attempt(_: int) -> int:
        while offset + done[0] < end:
            options: dict[str, Any] = {"range": (offset + done[0], end)}
            if info.etag:
                options["if_match"] = info.etag
            body = memoryview(obstore.get(store, key, options=options).bytes())  # type: ignore[arg-type]
            if not body:  # the server sent nothing: ask again (a retry)
                raise _ShortBody(f"an empty body at byte {offset + done[0]} of {end}")
            body = body[: end - offset - done[0]]  # (a server that ignores Range sends more)
            sink(body)
            done[0] += len(body)
        return done[0]

    count: int = _retrying(info.url, f"reading bytes {offset}..{end}", attempt)
    return count


class _ShortBody(Exception):
    """A response body shorter than its range: retried as a dropped connection."""


#: The least part of a multipart upload S3 takes (but the last): what one part in
#: flight holds in memory.
MIN_UPLOAD_PART = 5 * 1024 * 1024


def put_atomic(
    url: str, data: Any, *, parts_in_flight: int = 4, limiter: FileLimiter | None = None
) -> None:
    """Upload ``data`` (bytes, a file object, or an iterator of bytes) to ``url``, whole
    or not at all: obstore sends one PUT, or a multipart upload that is only completed
    (and so only visible) once every part is in; a failure aborts it. Readers never see
    a half-written object under ``url``.

    Each part in flight is a request on a connection of its own, a descriptor (G2), and
    holds up to :data:`MIN_UPLOAD_PART` bytes read from a file (G1). The caller holds
    one file-pool slot for the upload (``borrowed_slot()``, or a pipeline's
    ``transient`` slot under ``limiter``); each further part sent at once takes a slot
    of the pool that is free now, up to ``parts_in_flight`` parts in all, and fewer
    (down to one at a time) when the pool has none to spare. So a caller that books
    the upload's memory books ``parts_in_flight`` parts at most."""
    import obstore

    from headrace.io.filepool import get_default_pool

    root, key = split_url(url)
    if root.startswith("http"):
        raise InvalidArgumentError(f"{url}: http(s) URLs are read-only")
    store = _store(root)
    spare = get_default_pool().hold_spare(max(parts_in_flight, 1) - 1, limiter=limiter)

    def attempt(failures: int) -> None:
        if failures and hasattr(data, "seek"):
            data.seek(0)
        elif failures and not isinstance(data, (bytes, bytearray, memoryview)):
            raise OSError(errno.EIO, "an upload from a stream failed and cannot be retried", url)
        obstore.put(store, key, data, chunk_size=MIN_UPLOAD_PART,
                    max_concurrency=1 + spare.count)

    try:
        _retrying(url, "uploading the object", attempt)
    finally:
        spare.release()


def put_if_absent(url: str, data: bytes) -> bool:
    """Upload ``data`` to ``url`` only if no object is there (a conditional PUT,
    ``If-None-Match: *``); whether it was written. Why: two writers that race to publish
    the same key (two processes writing one ``cache(url)``) must not both win, the later
    one replacing what readers of the first already use; the store decides which came
    first. A retry after a transient failure that finds the object is reported as not
    written: the caller reads it back to see whose it is."""
    import obstore
    from obstore.exceptions import AlreadyExistsError

    root, key = split_url(url)
    if root.startswith("http"):
        raise InvalidArgumentError(f"{url}: http(s) URLs are read-only")
    store = _store(root)

    def attempt(_: int) -> bool:
        try:
            obstore.put(store, key, data, mode="create")
        except AlreadyExistsError:
            return False
        except Exception as error:
            if not _UNSUPPORTED.search(f"{type(error).__name__} {error}"):
                raise
            # A server without conditional writes (an older S3-compatible one): look,
            # then write. Two writers within that gap both write, the last one's stays.
            try:
                obstore.head(store, key)
            except Exception as missing:
                if _kind(missing) != "missing":
                    raise
                obstore.put(store, key, data)
                return True
            return False
        return True

    written: bool = _retrying(url, "uploading the object", attempt)
    return written


_UNSUPPORTED = re.compile(r"NotSupportedError|\b501\b|NotImplemented")


def copy_object(source: str, target: str) -> None:
    """Copy one object to another key of the same bucket, server-side (one request:
    the target appears whole, or not at all)."""
    import obstore

    root, key = split_url(source)
    target_root, target_key = split_url(target)
    if root != target_root:
        raise InvalidArgumentError(f"copy_object: {source} and {target} are in different stores")
    store = _store(root)
    _retrying(target, f"copying {source}", lambda _: obstore.copy(store, key, target_key))


def delete_object(url: str) -> None:
    """Delete the object at ``url``; a missing one is not an error."""
    import obstore

    root, key = split_url(url)
    store = _store(root)
    try:
        obstore.delete(store, key)
    except Exception as error:
        if not (_is_client_error(error) or isinstance(error, FileNotFoundError)):
            raise
        if _kind(error) != "missing":
            raise _mapped(error, url, "deleting the object") from None


def list_objects(prefix_url: str) -> Iterator[ObjectInfo]:
    """Every object under ``prefix_url`` (recursive), page after page (obstore asks the
    store for pages of up to 1000 keys): a listing of millions of objects is never held
    whole. A page that fails transiently is asked for again, from the last key seen."""
    import obstore

    root, prefix = split_url(prefix_url)
    store = _store(root)
    last: list[str | None] = [None]
    while True:
        def attempt(_: int) -> list[Any]:
            stream = obstore.list(store, prefix or None, offset=last[0], chunk_size=_LIST_PAGE)
            return next(iter(stream), [])  # type: ignore[call-overload]

        page: list[Any] = _retrying(prefix_url, "listing the objects", attempt)
        if not page:
            return
        for meta in page:
            modified = meta.get("last_modified")
            yield ObjectInfo(f"{root}/{meta['path']}", int(meta["size"]), meta.get("e_tag"),
                             modified.timestamp() if modified is not None else None)
        last[0] = page[-1]["path"]


_MAGIC = re.compile(r"[*?[]")
_LIST_PAGE = 1000
"""Keys asked for per listing page (S3's most per ListObjectsV2 call)."""


def glob_objects(pattern: str) -> list[str]:
    """The URLs of the objects matching ``pattern`` (``*`` and ``?`` stop at ``/``, as in
    :func:`glob.glob`; ``[...]`` classes), sorted. Only the part of the key before the
    first wildcard is listed, so a pattern over one prefix of a large bucket does not
    walk the bucket. A pattern without wildcards names one object (HEAD)."""
    root, key = split_url(pattern)
    match = _MAGIC.search(key)
    if match is None:
        try:
            object_info(pattern)
        except FileNotFoundError:
            return []
        return [pattern]
    if root.startswith("http"):
        raise InvalidArgumentError(
            f"{pattern}: a web server has no listing to match a pattern against; name "
            "the files (http(s) URLs without wildcards)"
        )
    literal = key[: match.start()]
    prefix = literal[: literal.rfind("/") + 1]
    regex = re.compile(_glob_regex(key))
    found = []
    from headrace.io.filepool import borrowed_slot

    with borrowed_slot():  # the listing's connection counts against the file cap (G2)
        for info in list_objects(f"{root}/{prefix}"):
            if regex.fullmatch(info.url[len(root) + 1 :]):
                found.append(info.url)
    return sorted(found)


def _glob_regex(pattern: str) -> str:
    """fnmatch's translation, with ``*`` and ``?`` kept within one path segment."""
    out = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            end = pattern.find("]", i + 1)
            if end < 0:
                out.append(re.escape(c))
            else:
                out.append(fnmatch.translate(pattern[i : end + 1])[4:-3])
                i = end
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


# ---------------------------------------------------------------------- streams

#: What a remote stream's "descriptor" is while it holds its pool slot: no OS
#: descriptor exists, the slot stands for the object's session and its request.
_REMOTE_SLOT = -1


_executor: Any = None


def _fetcher() -> Any:
    """The threads that read the next range of open objects ahead (one range per
    stream at most), shared by every stream; created on first use."""
    global _executor
    with _lock:
        if _executor is None:
            from concurrent.futures import ThreadPoolExecutor

            _executor = ThreadPoolExecutor(
                max_workers=min(32, (os.cpu_count() or 1) + 4),
                thread_name_prefix="headrace-objstore")
        return _executor


_used = False  # a store was made in this process: the client's runtime is running
_forked_after_use = False


def _after_fork_in_child() -> None:
    """A forked process has none of its parent's threads, and the client's runtime
    (tokio's, inside obstore) does not survive a fork once it ran: a request from
    the child would wait forever. Such a child refuses object URLs with an error
    saying why (:func:`_store`) instead of hanging."""
    global _executor, _lock, _forked_after_use
    _executor = None
    _lock = threading.Lock()
    _stores.clear()
    _forked_after_use = _used


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _fetch_ahead(info: ObjectInfo, offset: int, size: int, pool: Any, limiter: Any) -> Any:
    """A read ahead, on a slot of the file pool (G2: its connection is one more open
    file while it runs); None, and nothing read, when every slot is taken."""
    if pool is None:
        return _fetch(info, offset, size)
    with pool.transient(wait=False, limiter=limiter) as got:
        return _fetch(info, offset, size) if got else None


class Successor:
    """The next object of a list, read ahead while the object before it is on its last
    range: its metadata and first range, fetched in the background so opening it
    waits for neither.

    Why: a stream reads ahead within an object, but each object's HEAD and first GET
    were made when it was opened, one round trip after the other, with nothing read
    meanwhile: over thousands of 1 MiB shards that idle time was most of the run. The
    successor makes one request, a GET of the first range, whose answer carries the
    object's size and ETag too (an empty object, which has no range to ask for, takes
    a HEAD).

    The fetch takes a slot of ``pool`` while it runs (G2), and none if every slot is
    taken (the open then reads as before). Its bytes are the caller's to book (G1):
    :meth:`drop` says when they are gone. Its errors are raised by the open, as the
    open's own HEAD's were; every later range is conditional on the ETag it saw (an
    object replaced meanwhile: :class:`DataLossError`).
    """

    def __init__(self, url: str, size: int, pool: Any, limiter: Any, *,
                 ahead: bool = True) -> None:
        """``ahead=False``: nothing is fetched in the background; the open makes the one
        request itself (an object opened at its start, with nothing before it to read
        ahead from: one round trip instead of a HEAD and a GET)."""
        split_url(url)  # (a malformed URL is refused by the open, as before)
        self.url, self.size = url, size
        self.claimed = False
        self._future: Any = (
            _fetcher().submit(_fetch_successor, url, size, pool, limiter) if ahead else None)

    def claim(self) -> tuple[ObjectInfo, Any] | None:
        """(metadata, a done future of the first range) for the open, waiting for the
        fetch if it runs. A fetch whose thread has not started yet (a reader that
        parses a small object in a few ms gets there before the thread got the GIL)
        is made here instead, in the open's own slot: one request all the same, and
        no thread to wait for. None when the fetch had no slot (the open reads as
        before). Raises the fetch's error, where the open's HEAD raised it."""
        self.claimed = True
        future = self._future
        outcome = (_first_range(self.url, self.size) if future is None or future.cancel()
                   else future.result())
        if outcome is None:
            return None
        info, data = outcome
        from concurrent.futures import Future

        first: Future[Any] = Future()
        first.set_result(data)
        return info, first

    def drop(self, freed: Any) -> None:
        """Give up the object (never opened: a ``take``, an error, a close); call
        ``freed()`` once its bytes are gone: at once if the fetch never started or has
        ended, else when it ends (its bytes stay booked until then)."""
        future = self._future
        if future is None or future.cancel() or future.done():
            freed()
        else:
            future.add_done_callback(lambda _: freed())


def _fetch_successor(url: str, size: int, pool: Any, limiter: Any) -> Any:
    """:func:`_first_range`, on a slot of the pool; None when every slot is taken."""
    with (contextlib.nullcontext(True) if pool is None
          else pool.transient(wait=False, limiter=limiter)) as got:
        return _first_range(url, size) if got else None


_UNSATISFIABLE = re.compile(r"\b416\b|InvalidRange")


def _first_range(url: str, size: int) -> tuple[ObjectInfo, Any]:
    """The object's metadata and its first ``size`` bytes, from one ranged GET (retried
    as every read is); an empty object, whose range cannot be satisfied, from a HEAD."""
    import obstore

    root, key = split_url(url)
    if not key or key.endswith("/"):
        raise IsADirectoryError(errno.EISDIR, "a URL ending in '/' names a prefix, not an object", url)
    store = _store(root)

    def attempt(_: int) -> tuple[ObjectInfo, memoryview] | None:
        try:
            result = obstore.get(store, key, options={"range": (0, size)})
            body = memoryview(result.bytes())  # type: ignore[arg-type]
        except Exception as error:
            if _is_client_error(error) and _UNSATISFIABLE.search(str(error)):
                return None  # (no byte 0: an empty object)
            raise
        meta = result.meta
        modified = meta.get("last_modified")
        info = ObjectInfo(url, int(meta["size"]), meta.get("e_tag"),
                          modified.timestamp() if modified is not None else None)
        return info, body

    got = _retrying(url, f"reading bytes 0..{size}", attempt)
    if got is None:
        info = object_info(url)
        return info, _fetch(info, 0, size)  # (nothing, unless it has grown since)
    info, body = got
    wanted = min(size, info.size)
    if len(body) < wanted:  # a short answer: the rest, conditional on its ETag
        body = memoryview(b"".join([body, _fetch(info, len(body), wanted - len(body))]))
    return info, body[:wanted]


def first_range_size(compression_type: str, buffer_size: int) -> int:
    """What a stream of ``buffer_size`` asks for first (what a successor fetches)."""
    if compression_type:
        from headrace.io import streams

        return max(buffer_size, streams.COMPRESSED_READ_SIZE)
    return buffer_size


def read_whole(info: ObjectInfo, offset: int = 0, size: int | None = None) -> bytes:
    """The bytes of the object (or of ``size`` bytes at ``offset``)."""
    data: bytes = _fetch(info, offset, info.size - offset if size is None else size).tobytes()
    return data


def _fetch(info: ObjectInfo, offset: int, size: int) -> Any:
    """The bytes at ``offset``, as a read-only buffer: the client's own when one GET
    answered (no copy), else joined."""
    parts: list[memoryview] = []
    read_range(info, offset, size, parts.append)
    return parts[0] if len(parts) == 1 else memoryview(b"".join(parts))


class _RemoteReads:
    """Mixed into the file streams of :mod:`headrace.io.streams`: the same buffering,
    decompression and suspension, with each positioned read a ranged GET. Suspension
    keeps the offset (the streams already do) and the object's ETag, so a resume that
    finds another version of the object raises instead of splicing two versions.

    Read-ahead: when a read of ``n`` bytes at ``offset`` is served, the ``n`` bytes
    after it are requested in the background, so the next read finds them (or finds
    them on the way) while the reader parses: without it, each round trip to the
    server would leave the reader idle. One range per open stream, dropped when the
    stream is suspended or closed; the file source books it beside the reader's
    buffer (:data:`READ_AHEAD_RANGES`).
    """

    _path: str
    _info: ObjectInfo | None
    _ahead: list[tuple[int, int, Any]]
    _pool: Any
    _limiter: Any
    _next_offset: int
    _successor: Successor | None
    _on_last_range: Any
    #: Set by :meth:`read_ahead`: its reader says which range comes next, and the
    #: stream no longer guesses (the next range of the same size).
    _explicit_ahead = False

    def _open_descriptor(self) -> int:
        successor, self._successor = self._successor, None
        if successor is not None and self._info is None:
            claimed = successor.claim()  # (its error raises here, as the HEAD below would)
            if claimed is not None:
                self._info, first = claimed
                self._ahead.append((0, successor.size, first))
                return _REMOTE_SLOT
        previous = self._info
        with self._deleted_while_read(previous is not None):
            info = object_info(self._path)
        if previous is not None and (previous.etag, previous.size) != (info.etag, info.size):
            raise DataLossError(
                f"{self._path} changed while it was read (size {previous.size} -> "
                f"{info.size}, ETag {previous.etag} -> {info.etag})", path=self._path
            )
        self._info = info
        return _REMOTE_SLOT

    def _release_descriptor(self, descriptor: int) -> None:
        # no connection to close: each request's ended with it (the client keeps
        # none idle); the range read ahead is dropped: a suspended stream keeps only
        # its offset
        self._drop_ahead()

    def attach_successor(self, successor: Successor | None, on_last_range: Any) -> None:
        """``successor``: this object's metadata and first range, read ahead (used by
        the first open). ``on_last_range()``: called once, when a read in order reaches
        the end of the object and nothing is left to read ahead in it (the file source
        then reads the next object ahead, in the slot this one no longer needs)."""
        self._successor, self._on_last_range = successor, on_last_range

    def close(self) -> None:
        successor, self._successor = self._successor, None
        if successor is not None and not successor.claimed:
            successor.drop(lambda: None)  # (its owner dropped its booking with it)
        self._on_last_range = None
        super().close()  # type: ignore[misc]

    def _drop_ahead(self) -> None:
        for _, _, future in self._ahead:
            future.cancel()
        self._ahead.clear()

    @contextlib.contextmanager
    def _deleted_while_read(self, opened: bool) -> Iterator[None]:
        """An object that is gone once its reading began lost the rest of its bytes:
        a DataLossError naming it, as for one that changed (one never opened stays a
        FileNotFoundError: it is skipped after its error like a missing file)."""
        try:
            yield
        except FileNotFoundError:
            if not opened:
                raise
            raise DataLossError(
                f"{self._path} was deleted while it was read (at byte {self._next_offset})",
                path=self._path, offset=self._next_offset,
            ) from None

    def _take(self, offset: int, size: int) -> Any:
        """The ``size`` bytes at ``offset``: the range read ahead if it is that one,
        else read now; then the next ranges are asked for (up to READ_AHEAD_DEPTH)."""
        info = self._info
        assert info is not None
        queue = self._ahead
        found = None
        with self._deleted_while_read(True):
            if queue and queue[0][:2] == (offset, size):
                found = queue.pop(0)[2].result()  # None: no pool slot to read it ahead
            else:
                self._drop_ahead()
            data = _fetch(info, offset, size) if found is None else found
        following = offset + len(data)
        sequential, self._next_offset = offset == self._next_offset, following
        # only a stream read in order is read ahead (positioned reads by an index
        # jump: a range read ahead for them would be thrown away)
        if sequential and len(data) == size and not self._explicit_ahead:
            start = queue[-1][0] + size if queue else following
            while len(queue) < READ_AHEAD_DEPTH and start < info.size:
                queue.append((start, size, _fetcher().submit(
                    _fetch_ahead, info, start, size, self._pool, self._limiter)))
                start += size
        if sequential and following >= info.size and not queue and self._on_last_range:
            hook, self._on_last_range = self._on_last_range, None
            hook()
        return data

    def read_ahead(self, offset: int | None, size: int) -> bool:
        """Ask for the ``size`` bytes at ``offset`` in the background, the range the
        reader will read next (whether it was asked for). Why: a reader of positioned
        runs (a cache file's records) reads ranges of varying sizes, so the stream's
        own guess (the next range of the last one's size) would be fetched for nothing;
        once called, the stream reads ahead only what it is told, and the caller books
        it. ``offset`` None: only switch the guessing off."""
        self._explicit_ahead = True
        info = self._info
        if offset is None or size <= 0 or info is None or offset >= info.size:
            return False
        if self._ahead and self._ahead[0][:2] == (offset, size):
            return True
        self._drop_ahead()
        self._ahead.append((offset, size, _fetcher().submit(
            _fetch_ahead, info, offset, size, self._pool, self._limiter)))
        return True

    def attach_pool(self, pool: Any, limiter: Any) -> None:
        self._pool, self._limiter = pool, limiter

    def _pread(self, descriptor: int, size: int, offset: int) -> bytes:
        data: bytes = self._take(offset, size).tobytes()
        return data

    def _pread_into(self, descriptor: int, buffer: memoryview, offset: int) -> int:
        data = self._take(offset, len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def _pread_scatter(self, descriptor: int, buffers: list[memoryview], offset: int) -> int:
        return self._pread_into(descriptor, buffers[0], offset)  # (one at a time)


#: Blocks an open object has requested ahead of the one being read (see
#: :class:`_RemoteReads`).
READ_AHEAD_DEPTH = 1

#: Buffers of ``buffer_size`` an open object holds at once: the reader's, the stream's
#: block being read, and the blocks read ahead.
READ_AHEAD_RANGES = 2 + READ_AHEAD_DEPTH

#: The least a default ranged read shrinks to on a small share (each request is a round
#: trip: smaller reads would spend their time waiting).
MIN_REMOTE_BUFFER_SIZE = 256 * 1024


def fitting_buffer(share: int, ranges: int = READ_AHEAD_RANGES) -> int:
    """The default ranged-read size for a stage whose share is ``share`` bytes.

    An open object holds ``ranges`` buffers at once (read buffer, block, read
    ahead), booked on the stage. At the 8 MiB default that is 24 MiB per object:
    an interleave of four objects under 64 MiB would be refused for buffers
    alone. So the default halves until they take at most half the share (the
    rest is for records), down to :data:`MIN_REMOTE_BUFFER_SIZE`. A
    ``buffer_size`` the user gives is kept as given.
    """
    size = REMOTE_BUFFER_SIZE
    while size > MIN_REMOTE_BUFFER_SIZE and ranges * size > share // 2:
        size //= 2
    return size


def make_remote_stream(url: str, compression_type: str, *, buffer_size: int) -> Any:
    """A suspendable stream over the object at ``url`` (see :func:`headrace.io.streams.make_stream`)."""
    from headrace.io import streams

    split_url(url)  # a clear error for a malformed URL, before any slot is taken
    stream: Any
    if compression_type:
        stream = _RemoteCompressedStream(url, compression_type, buffer_size=buffer_size)
        # one GET per compressed chunk: as large as the buffer, not 64 KiB
        stream._compressed_read_size = max(buffer_size, streams.COMPRESSED_READ_SIZE)
    else:
        stream = _RemotePlainStream(url, buffer_size=buffer_size)
    stream._info = None
    stream._ahead = []
    stream._next_offset = 0
    stream._pool = stream._limiter = None  # (outside a pool: nothing to count against)
    stream._successor = stream._on_last_range = None
    return stream


def _define_streams() -> tuple[type, type]:
    from headrace.io.streams import CompressedStream, PlainStream

    class RemotePlainStream(_RemoteReads, PlainStream):
        """An uncompressed object: positioned reads are ranged GETs."""

        def _read_chunk(self, descriptor: int, wanted: int) -> bytes:
            # the client's buffer itself (a read-only view): no copy until readinto's
            chunk: bytes = self._take(self._file_offset, max(self._buffer_size, wanted))
            self._file_offset += len(chunk)
            return chunk

        def readinto(self, buffer: memoryview, /) -> int:
            # Through the stream's own block, not straight into the caller's buffer: a
            # reader asks for what its buffer has room for (a block less a partial
            # record), and only whole, aligned blocks let the next one be read ahead.
            # One copy, from the client's buffer into the caller's.
            self._check_not_closed()
            total, size = 0, len(buffer)
            while total < size:
                if self._buffer_start >= len(self._buffer):
                    chunk = self._read_chunk(self._require_descriptor(), size - total)
                    if not chunk:
                        break
                    self._buffer, self._buffer_start = chunk, 0
                start = self._buffer_start
                count = min(len(self._buffer) - start, size - total)
                buffer[total : total + count] = self._buffer[start : start + count]
                self._buffer_start += count
                total += count
            self._position += total
            return total

    class RemoteCompressedStream(_RemoteReads, CompressedStream):
        """A GZIP/ZLIB object, decompressed as it streams in."""

    return RemotePlainStream, RemoteCompressedStream


_RemotePlainStream, _RemoteCompressedStream = _define_streams()

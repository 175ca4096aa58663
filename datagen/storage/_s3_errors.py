"""The one place where botocore/boto3 exceptions become datagen errors (``datagen.storage.s3``):

* network faults, timeouts, 5xx, throttling, an object changed during a read -> ``StorageError``
  (transient: the orchestrator retries);
* a bucket that does not exist -> ``SpecError`` (fix the URI or create the bucket);
* no credentials, wrong credentials, access denied -> ``CannotRunHereError`` (give this machine
  credentials that may read/write the bucket).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from datagen.errors import CannotRunHereError, SpecError, StorageError

NOT_FOUND_CODES = {"404", "NoSuchKey", "NotFound"}
NO_BUCKET_CODES = {"NoSuchBucket"}
NO_BUCKET_HINT = "fix the s3:// URI in the spec, or create the bucket first"
DENIED_CODES = {
    "403",
    "AccessDenied",
    "AllAccessDisabled",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "AccountProblem",
    "InvalidClientTokenId",
}


def error_code(exc: BaseException) -> tuple[str, int | None]:
    """The S3 error code and HTTP status of a botocore error ("" and None when it has none)."""
    response = getattr(exc, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code, status


def _root_cause(exc: BaseException) -> BaseException:
    """The botocore error under boto3's transfer wrappers (S3UploadFailedError,
    RetriesExceededError), which keep it as cause, context or ``last_exception``."""
    from botocore.exceptions import BotoCoreError, ClientError

    found, seen, current = exc, set(), exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (ClientError, BotoCoreError)):
            found = current
        current = current.__cause__ or getattr(current, "last_exception", None) or current.__context__
    return found


@contextlib.contextmanager
def translated(what: str, where: str | None) -> Iterator[None]:
    """Turn botocore/boto3 exceptions raised inside into datagen errors (module docstring)."""
    from boto3.exceptions import Boto3Error
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, PartialCredentialsError

    place = f" {where}" if where else ""
    try:
        yield
    except (ClientError, BotoCoreError, Boto3Error) as e:
        cause = _root_cause(e)
        code, status = error_code(cause)
        if isinstance(cause, (NoCredentialsError, PartialCredentialsError)):
            raise CannotRunHereError(
                f"cannot {what}{place}: no S3 credentials on this machine",
                hint="set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE (or attach an instance role)",
            ) from e
        if code in NO_BUCKET_CODES:
            raise SpecError(
                f"cannot {what}{place}: the bucket does not exist",
                hint=NO_BUCKET_HINT,
            ) from e
        if code in DENIED_CODES or status == 403:
            raise CannotRunHereError(
                f"cannot {what}{place}: access denied ({code or status})",
                hint="give this machine's credentials (AWS_PROFILE / AWS_ACCESS_KEY_ID) read and "
                "write permission on the bucket, or check that they belong to this endpoint",
            ) from e
        # everything else: connection refused/reset, timeouts, 5xx, SlowDown, PreconditionFailed
        # (the object changed while we read it), a key deleted between listing and reading
        raise StorageError(
            f"cannot {what}{place}: {code or type(cause).__name__}: {cause}",
            hint="a network or storage fault; retry (the transfer resumes where it stopped)",
        ) from e

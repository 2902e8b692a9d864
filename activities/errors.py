"""Turn AWS API errors into Temporal errors that say whether a retry can help.

botocore has already retried throttling and 5xx answers (standard mode, `AwsSettings.max_attempts`) before an
error reaches us; what is left is either still transient (Temporal retries it, with the workflow's retry
policy) or permanent (non-retryable, so the workflow fails the step at once with a message an operator can
act on instead of retrying a missing launch template for hours).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from botocore.exceptions import ClientError, ParamValidationError
from temporalio.exceptions import ApplicationError

# Rate limits: back off and try again.
THROTTLING_CODES = frozenset(
    {
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "RequestLimitExceeded",
        "TooManyRequestsException",
        "EC2ThrottledException",
        "PriorRequestNotComplete",
        "SlowDown",
    }
)

# No capacity of the type in the AZ (or the reservation) asked for: another AZ may have some.
CAPACITY_CODES = frozenset(
    {
        "InsufficientInstanceCapacity",
        "InsufficientCapacity",
        "InsufficientHostCapacity",
        "InsufficientReservedInstanceCapacity",
    }
)

# AWS-side shortage or outage: capacity frees up and services recover, so a later attempt can succeed.
TRANSIENT_CODES = frozenset(
    {
        "InsufficientInstanceCapacity",
        "InsufficientCapacity",
        "InsufficientHostCapacity",
        "InsufficientReservedInstanceCapacity",
        "InsufficientAddressCapacity",
        "ServerInternal",
        "InternalError",
        "InternalFailure",
        "InternalServiceError",
        "ServerException",
        "ServiceUnavailable",
        "ServiceUnavailableException",
        "Unavailable",
        "RequestTimeout",
        "RequestTimeoutException",
        "ScalingActivityInProgress",
        "ResourceContention",
        # Expired session credentials are refreshed by botocore on the next attempt.
        "ExpiredToken",
        "ExpiredTokenException",
        "RequestExpired",
    }
)

# Listed so the intent is explicit; any other 4xx is permanent too (see `is_retryable`).
PERMANENT_CODES = frozenset(
    {
        "ValidationError",
        "ValidationException",
        "AccessDenied",
        "AccessDeniedException",
        "UnauthorizedOperation",
        "UnauthorizedException",
        "AuthFailure",
        "InvalidClientTokenId",
        "UnrecognizedClientException",
        "OptInRequired",
        "MissingParameter",
        "ClientException",
        "ClusterNotFoundException",
        "IdempotentParameterMismatch",
        "InvalidLaunchTemplateName.NotFoundException",
        "InvalidLaunchTemplateId.NotFound",
        "InvalidLaunchTemplateId.Malformed",
        "InstanceLimitExceeded",
        "VcpuLimitExceeded",
    }
)


def error_code(err: ClientError) -> str:
    return str(err.response.get("Error", {}).get("Code") or "Unknown")


def error_message(err: ClientError) -> str:
    return str(err.response.get("Error", {}).get("Message") or err)


def is_retryable(code: str, http_status: int | None = None) -> bool:
    if code in THROTTLING_CODES or code in TRANSIENT_CODES:
        return True
    if (
        code in PERMANENT_CODES
        or code.startswith("InvalidParameter")
        or code.endswith(("NotFound", "NotFoundException"))
    ):
        return False
    # Unknown code: trust the HTTP class. 5xx and 429 are the server's problem; other 4xx are ours.
    if http_status is None:
        return True
    return http_status >= 500 or http_status == 429


def application_error(err: ClientError, call: str, resource: str) -> ApplicationError:
    """One-line message naming the call and the resource, typed by the AWS error code."""
    code = error_code(err)
    status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    retryable = is_retryable(code, status)
    message = " ".join(f"{call} on {resource} failed: {code}: {error_message(err)}".split())
    return ApplicationError(message, type=code, non_retryable=not retryable)


@contextmanager
def aws_errors(call: str, resource: str) -> Iterator[None]:
    """Wrap every AWS call of an activity: ClientError -> ApplicationError, retryable or not."""
    try:
        yield
    except ClientError as err:
        raise application_error(err, call, resource) from err
    except ParamValidationError as err:
        # Rejected by botocore before sending: a bug or bad configuration, never fixed by retrying.
        message = " ".join(f"{call} on {resource} failed: invalid parameters: {err}".split())
        raise ApplicationError(message, type="ParamValidation", non_retryable=True) from err

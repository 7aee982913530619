"""What the training API answers with a 4xx: every refusal carries its reason, never a traceback."""

from __future__ import annotations


class ApiError(Exception):
    """A request the server refuses; ``status`` is the HTTP status, the message its reason."""

    status = 400


class BadRequest(ApiError):
    status = 400


class Unauthorized(ApiError):
    status = 401


class NotFound(ApiError):
    status = 404


class TooLarge(ApiError):
    status = 413


class TooMany(ApiError):
    status = 429  # the SDK backs off and retries


class Unavailable(ApiError):
    status = 503  # the server is at capacity for what was asked (a model more); it may be retried later


class NotServed(ApiError):
    status = 400  # not 501: the SDK retries every 5xx for minutes before it shows the reason

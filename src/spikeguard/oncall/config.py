"""OnCallConfig: where a Tier 2 page goes, and what a run under ``tier2="ask"`` does while it waits."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Literal

from .._validate import check_int, check_positive

__all__ = ["PAGERDUTY_URL", "OnCallConfig"]

PAGERDUTY_URL = "https://events.pagerduty.com/v2/enqueue"
"""PagerDuty's Events API v2 endpoint (``page_to`` overrides it, e.g. for a proxy)."""

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(kw_only=True, frozen=True)
class OnCallConfig:
    """Pages a Tier 2 to a person and, under ``tier2="ask"``, how long the run waits for their
    answer (docs/on-call.md)."""

    page_to: str | None = None
    """Webhook URL the page is posted to (http or https); None: no page unless page_url_env."""
    page_url_env: str | None = None
    """Environment variable holding the webhook URL instead (a Slack URL is itself a secret)."""
    page_format: Literal["generic", "slack", "pagerduty"] = "generic"
    """Payload: generic JSON, a Slack-compatible message, or a PagerDuty Events API v2 event."""
    page_secret_env: str | None = None
    """Environment variable holding the secret: PagerDuty's routing key, else a bearer token."""
    page_timeout_s: float = 10.0
    """Seconds one HTTP attempt may take before it counts as failed."""
    page_retries: int = 4
    """Attempts after the first before a page is kept as unsent in RUN_DIR/pages.jsonl."""
    page_backoff_s: float = 2.0
    """Wait before the first retry; it doubles for each later one."""
    answer_within_s: float = 1800.0
    """Seconds to wait for an answer before answer_default applies (and the record says so)."""
    answer_default: Literal["continue", "rollback", "halt"] = "continue"
    """What applies when nobody answers in time (continue: as an alert would)."""
    resolve_after: int = 50
    """Steps without another Tier 2 after a decision before the incident is resolved."""

    def __post_init__(self) -> None:
        if self.page_to is not None and not re.match(r"^https?://[^\s/]+", self.page_to):
            raise ValueError(f"OnCallConfig.page_to={self.page_to!r} must be an http:// or "
                             "https:// URL (for a secret URL use page_url_env)")
        for name in ("page_url_env", "page_secret_env"):
            value = getattr(self, name)
            if value is not None and not _ENV_NAME.match(value):
                raise ValueError(f"OnCallConfig.{name}={value!r} must name an environment "
                                 "variable (letters, digits, _), not hold the secret itself")
        if self.page_to is not None and self.page_url_env is not None:
            raise ValueError("OnCallConfig: give page_to or page_url_env, not both")
        if self.page_format not in ("generic", "slack", "pagerduty"):
            raise ValueError(f"OnCallConfig.page_format={self.page_format!r} must be generic, "
                             "slack or pagerduty")
        if self.answer_default not in ("continue", "rollback", "halt"):
            raise ValueError(f"OnCallConfig.answer_default={self.answer_default!r} must be "
                             "continue, rollback or halt")
        check_positive(self.page_timeout_s, "OnCallConfig.page_timeout_s", default=10.0)
        check_int(self.page_retries, "OnCallConfig.page_retries", minimum=0, default=4)
        if not (isinstance(self.page_backoff_s, (int, float)) and math.isfinite(self.page_backoff_s)
                and self.page_backoff_s >= 0):
            raise ValueError(f"OnCallConfig.page_backoff_s={self.page_backoff_s!r} must be a "
                             "number >= 0 (default 2.0)")
        check_positive(self.answer_within_s, "OnCallConfig.answer_within_s", default=1800.0)
        check_int(self.resolve_after, "OnCallConfig.resolve_after", minimum=1, default=50)

    @property
    def pages(self) -> bool:
        """Whether a page is configured at all."""
        return (self.page_to is not None or self.page_url_env is not None
                or (self.page_format == "pagerduty" and self.page_secret_env is not None))

    def url(self) -> str:
        """The URL to post to, read from the environment where configured (never logged)."""
        if self.page_url_env is not None:
            value = os.environ.get(self.page_url_env, "")
            if not value:
                raise ValueError(f"${self.page_url_env} (OnCallConfig.page_url_env) is empty "
                                 "or unset; export the webhook URL there")
            return value
        if self.page_to is not None:
            return self.page_to
        return PAGERDUTY_URL if self.page_format == "pagerduty" else ""

    def secret(self) -> str | None:
        """The secret from ``page_secret_env`` (None when not configured)."""
        if self.page_secret_env is None:
            return None
        value = os.environ.get(self.page_secret_env, "")
        if not value:
            raise ValueError(f"${self.page_secret_env} (OnCallConfig.page_secret_env) is empty "
                             "or unset; export the secret there")
        return value

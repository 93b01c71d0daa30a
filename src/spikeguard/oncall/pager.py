"""The pager: posts a Tier 2 page (and its resolve) to a webhook from a background thread.

Three payloads (``OnCallConfig.page_format``): ``generic`` (the page as JSON), ``slack`` (an
incoming-webhook message: ``text`` plus ``blocks``) and ``pagerduty`` (an Events API v2 event:
``trigger`` with the incident's ``dedup_key``, and ``resolve`` with the same key when the run
recovers). Sending never runs on the training thread: ``send`` only queues. Each event is tried
``1 + page_retries`` times, ``page_backoff_s`` doubling between tries; every outcome is a line of
RUN_DIR/pages.jsonl (``status`` "sent", or "unsent" with the error and the whole page, so nothing
a person should have seen is lost). The secret (the routing key, a bearer token) and a URL read
from the environment are never written there: the line names the variable instead.

Plain ``urllib``: the three payloads are fixed JSON documents, one POST each, and the Events API
v2 needs the dedup key and the resolve this module controls; no dependency is needed for that.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import OnCallConfig

__all__ = ["PageEvent", "Pager", "payload"]


@dataclass
class PageEvent:
    """One thing to send: a ``trigger`` (the page) or a ``resolve`` of incident ``incident``.
    ``before_send`` runs on the pager's thread first (it draws the plot the page names)."""

    action: str
    incident: str
    dedup_key: str
    page: dict[str, Any]
    before_send: Callable[[], None] | None = None
    done: bool = False
    attempts: int = 0
    errors: list[str] = field(default_factory=list)


def _title(page: dict[str, Any]) -> str:
    s = page.get("summary") or {}
    why = "; ".join(s.get("reasons") or []) or "Tier 2"
    return f"spikeguard Tier 2 at step {s.get('step')} in {page.get('run_dir')}: {why}"[:1000]


def _slack(event: PageEvent) -> dict[str, Any]:
    page = event.page
    if event.action == "resolve":
        text = f"spikeguard: incident {event.incident} in {page.get('run_dir')} resolved"
        return {"text": text, "blocks": [{"type": "section",
                                          "text": {"type": "mrkdwn", "text": text}}]}
    s = page.get("summary") or {}
    lz = s.get("log_z") or {}
    pct = s.get("grad_norm_percentiles") or {}
    lines = [f"*{_title(page)}*",
             f"onset step {s.get('onset_step')}; log Z {lz.get('first')} -> {lz.get('last')} "
             f"({lz.get('slope_per_1k_steps')} per 1k steps); grad norm p50 {pct.get('p50')}, "
             f"p99 {pct.get('p99')}; data {s.get('data_range')}; suggested checkpoint "
             f"{s.get('rollback_checkpoint')}",
             *[f"remedy: {r}" for r in s.get("remedies") or ()],
             f"plot: {page.get('plot')}"]
    cmds = "\n".join(page.get("answers", {}).values())
    return {"text": _title(page), "blocks": [
        {"type": "section", "text": {"type": "mrkdwn", "text": "\n".join(lines)}},
        {"type": "section", "text": {"type": "mrkdwn", "text": f"answer with:\n```{cmds}```"}}]}


def payload(event: PageEvent, config: OnCallConfig, secret: str | None) -> dict[str, Any]:
    """The JSON body for ``event`` in the configured format (``secret``: PagerDuty's key)."""
    if config.page_format == "slack":
        return _slack(event)
    if config.page_format == "pagerduty":
        body: dict[str, Any] = {"routing_key": secret, "event_action": event.action,
                                "dedup_key": event.dedup_key}
        if event.action == "trigger":
            body["payload"] = {"summary": _title(event.page), "source": event.page.get("host"),
                               "severity": "error", "component": "spikeguard",
                               "group": event.page.get("run_dir"), "class": "tier2",
                               "custom_details": event.page}
        return body
    return {"source": "spikeguard", "event": event.action, "incident": event.incident,
            "dedup_key": event.dedup_key, **event.page}


class Pager:
    """Queues page events and sends them from one daemon thread (module docstring).

    ``send(event)`` returns at once. ``close(wait_s)`` gives the thread ``wait_s`` seconds to
    finish, then writes whatever is still unsent to pages.jsonl; it returns (sent, unsent).
    """

    def __init__(self, config: OnCallConfig, run_dir: Path) -> None:
        self.config = config
        self.path = Path(run_dir) / "pages.jsonl"
        self.sent = self.unsent = 0
        self._events: list[PageEvent] = []
        self._new = threading.Condition()
        self._lock = threading.Lock()  # pages.jsonl and each event's done flag
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def send(self, event: PageEvent) -> None:
        """Queue ``event``; never blocks on the network."""
        with self._new:
            self._events.append(event)
            self._new.notify()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="spikeguard-pager",
                                            daemon=True)
            self._thread.start()

    def close(self, wait_s: float = 5.0) -> tuple[int, int]:
        """Stop sending after ``wait_s`` seconds; keep what is left as unsent. (sent, unsent)."""
        if self._thread is not None:
            deadline = time.monotonic() + wait_s
            with self._new:
                self._new.notify()
            while self._thread.is_alive() and time.monotonic() < deadline and self._pending():
                self._thread.join(0.05)
            self._stop.set()
            with self._new:
                self._new.notify()
        for event in list(self._events):
            self._finish(event, ok=False, error="the run ended before it could be sent")
        return self.sent, self.unsent

    def _pending(self) -> bool:
        return any(not e.done for e in self._events)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._new:
                todo = [e for e in self._events if not e.done]
                if not todo:
                    self._new.wait(0.5)
                    continue
            self._deliver(todo[0])

    def _deliver(self, event: PageEvent) -> None:
        cfg = self.config
        if event.before_send is not None:
            try:
                event.before_send()
            except Exception as exc:  # a plot that fails must not stop the page
                event.page["plot_error"] = f"{type(exc).__name__}: {exc}"
            event.before_send = None
        try:
            url, secret = cfg.url(), cfg.secret()
        except ValueError as exc:
            self._finish(event, ok=False, error=str(exc))
            return
        headers = {"Content-Type": "application/json", "User-Agent": "spikeguard-pager"}
        if secret is not None and cfg.page_format != "pagerduty":
            headers["Authorization"] = f"Bearer {secret}"
        data = json.dumps(payload(event, cfg, secret), default=str).encode()
        wait = cfg.page_backoff_s
        for attempt in range(cfg.page_retries + 1):
            if event.done or (self._stop.is_set() and attempt):
                return
            event.attempts = attempt + 1
            try:
                req = urllib.request.Request(url, data=data, headers=headers, method="POST")
                with urllib.request.urlopen(req, timeout=cfg.page_timeout_s) as resp:
                    resp.read(65536)
                self._finish(event, ok=True)
                return
            except (urllib.error.URLError, OSError, ValueError) as exc:
                event.errors.append(_describe(exc, secret))
            if attempt < cfg.page_retries and self._stop.wait(wait):
                break
            wait *= 2
        self._finish(event, ok=False, error=event.errors[-1] if event.errors else "not sent")

    def _finish(self, event: PageEvent, *, ok: bool, error: str | None = None) -> None:
        with self._lock:
            if event.done:
                return
            event.done = True
            cfg = self.config
            line: dict[str, Any] = {
                "time": time.time(), "status": "sent" if ok else "unsent",
                "action": event.action, "incident": event.incident,
                "dedup_key": event.dedup_key, "format": cfg.page_format,
                "to": f"${cfg.page_url_env}" if cfg.page_url_env else (cfg.page_to or "default"),
                "attempts": event.attempts}
            if not ok:
                line.update(error=error, errors=event.errors[-3:], page=event.page)
            if ok:
                self.sent += 1
            else:
                self.unsent += 1
            try:
                with open(self.path, "a") as f:
                    f.write(json.dumps(line, default=str) + "\n")
            except OSError:  # a full disk: the count above still says it in the summary
                pass


def _describe(exc: BaseException, secret: str | None) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        text = f"HTTP {exc.code} {exc.reason}"
    elif isinstance(exc, urllib.error.URLError):
        text = f"{type(exc.reason).__name__}: {exc.reason}"
    else:
        text = f"{type(exc).__name__}: {exc}"
    return text.replace(secret, "<secret>") if secret else text

"""Alert someone when a run fails: ``diloco-async alerts --webhook URL``.

:func:`install_alerts` saves a Prefect **Custom Webhook** notification block that POSTs JSON to
the given URL, and one Prefect **automation** whose trigger is a flow run of ``train`` or
``resume`` (by flow name) entering Failed or Crashed, and whose action sends a notification through
that block. The Prefect server's own services (triggers, actions) evaluate the event and call the
webhook; nothing of diloco-async needs to run for it. Calling it again with the same names updates
the block and the automation in place (idempotent).

The default payload, ``{"text": "<subject>\\n<body>"}``, is what Slack, Mattermost and Microsoft
Teams incoming webhooks take; ``payload`` gives any other JSON shape (PagerDuty Events v2, an
internal receiver) with the placeholders ``{{subject}}`` and ``{{body}}``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from uuid import UUID

__all__ = ["DEFAULT_BLOCK_NAME", "DEFAULT_AUTOMATION_NAME", "DEFAULT_FLOWS", "DEFAULT_PAYLOAD", "Installed",
           "install_alerts", "alert_body", "api_url", "add_alerts_parser"]

DEFAULT_BLOCK_NAME = "diloco-async-alerts"
DEFAULT_AUTOMATION_NAME = "diloco-async: train or resume failed"
DEFAULT_FLOWS = ("train", "resume")
DEFAULT_PAYLOAD: dict[str, Any] = {"text": "{{subject}}\n{{body}}"}
_STATES = ("Failed", "Crashed")

#: The notification's subject and body: Jinja templates the Prefect server renders with the
#: triggering flow run (``flow_run``) and its flow (``flow``).
SUBJECT = "diloco-async: {{ flow.name }} run {{ flow_run.name }} {{ flow_run.state.name }}"


def alert_body() -> str:
    """The notification body template: which flow run, its id, its state and message, its UI link."""
    return ("Flow run {{ flow_run.name }} ({{ flow_run.id }}) of flow {{ flow.name }} entered "
            "{{ flow_run.state.name }}: {{ flow_run.state.message }}\n"
            "Parameters: {{ flow_run.parameters }}\n{{ flow_run|ui_url }}")


@dataclass(frozen=True)
class Installed:
    """What :func:`install_alerts` left on the server: the block document's id, the automation's
    id, and whether the automation was created (False: an existing one was updated)."""

    block_document_id: UUID
    automation_id: UUID
    created: bool


def api_url() -> str | None:
    """The Prefect API this process talks to (``PREFECT_API_URL`` or the active profile); None when
    unset, where Prefect would start a temporary server that an automation would not outlive."""
    from prefect.settings import get_current_settings

    return get_current_settings().api.url


def _trigger(flows: tuple[str, ...]):
    from prefect.events.schemas.automations import EventTrigger, Posture

    return EventTrigger(
        expect={f"prefect.flow-run.{state}" for state in _STATES},
        match={"prefect.resource.id": "prefect.flow-run.*"},
        match_related={"prefect.resource.role": "flow", "prefect.resource.name": list(flows)},
        posture=Posture.Reactive, threshold=1,
    )


def install_alerts(webhook_url: str, *, flows: tuple[str, ...] = DEFAULT_FLOWS,
                   block_name: str = DEFAULT_BLOCK_NAME, automation_name: str = DEFAULT_AUTOMATION_NAME,
                   payload: dict[str, Any] | None = None, timeout_s: float = 10.0) -> Installed:
    """Create or update the webhook block and the automation on the current Prefect server.

    Args:
        webhook_url: where the notification is POSTed (http or https).
        flows: flow names whose Failed or Crashed runs notify.
        block_name: name of the Custom Webhook block document.
        automation_name: name of the automation; every automation of that name is replaced by one.
        payload: JSON body with ``{{subject}}`` and ``{{body}}`` placeholders (default: Slack-style
            ``{"text": ...}``).
        timeout_s: the webhook request's timeout, seconds.

    Raises:
        ValueError: a URL that is not http(s), no flow names, or a payload without ``{{body}}``.
        prefect.exceptions.PrefectHTTPStatusError: the server refused a call.
    """
    from prefect.automations import AutomationCore, SendNotification
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.client.orchestration import get_client

    if not webhook_url.startswith(("http://", "https://")):
        raise ValueError(f"webhook URL must be http:// or https://, got {webhook_url!r}")
    if not flows or not all(flows):
        raise ValueError("name at least one flow (e.g. train)")
    payload = DEFAULT_PAYLOAD if payload is None else payload
    if "{{body}}" not in json.dumps(payload):
        raise ValueError("the payload must contain the {{body}} placeholder (it names the flow run)")
    block = CustomWebhookNotificationBlock(name=block_name, url=webhook_url, json_data=payload,
                                           timeout=timeout_s)
    block_id = block.save(block_name, overwrite=True)
    automation = AutomationCore(
        name=automation_name,
        description=f"Notify {block_name} when a run of flow {', '.join(flows)} fails or crashes (diloco-async alerts)",
        trigger=_trigger(tuple(flows)),
        actions=[SendNotification(block_document_id=block_id, subject=SUBJECT, body=alert_body())],
    )
    with get_client(sync_client=True) as client:
        existing = client.read_automations_by_name(automation_name)
        if not existing:
            return Installed(block_id, client.create_automation(automation), True)
        keep, *extra = existing
        client.update_automation(keep.id, automation)
        for other in extra:
            client.delete_automation(other.id)
        return Installed(block_id, keep.id, False)


def add_alerts_parser(sub, handler: Callable[[argparse.Namespace], int]) -> None:
    """The ``alerts`` subcommand of ``diloco-async`` (its arguments; ``handler`` runs it)."""
    p_alerts = sub.add_parser("alerts", help="notify a webhook (Slack, Teams, ...) when a `train` or `resume` "
                                             "run fails or crashes (a Prefect automation; idempotent)")
    p_alerts.add_argument("--webhook", required=True, metavar="URL", help="http(s) URL the notification is POSTed to")
    p_alerts.add_argument("--flows", default=",".join(DEFAULT_FLOWS),
                          help="comma-separated flow names (default: %(default)s)")
    p_alerts.add_argument("--name", default=DEFAULT_AUTOMATION_NAME,
                          help="the automation's name; one of that name is updated (default: %(default)s)")
    p_alerts.add_argument("--block-name", default=DEFAULT_BLOCK_NAME,
                          help="the Custom Webhook notification block's name (default: %(default)s)")
    p_alerts.add_argument("--payload", default=None, metavar="JSON",
                          help='JSON body with {{subject}} and {{body}} placeholders (default: {"text": '
                               '"{{subject}}\\n{{body}}"}, what Slack, Mattermost and Teams webhooks take)')
    p_alerts.set_defaults(func=handler)

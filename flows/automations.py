"""The project's automations on the Prefect server, deployed with the deployments.

``datagen-lost-host``: a flow run whose heartbeats stopped has lost its host (a worker host that
dies cannot report its runs, which would stay Running); the automation marks it Crashed. A
fanned-out run's parent sees its range's run Crashed and submits the range again; a single-node
run is retried from the UI or the API (completed ranges are Cached, an interrupted range keeps
its complete shards).

Flow runs send a heartbeat every ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` seconds (Prefect's
default 180, at least 30). The window must be well above it, or a run that is merely slow to send
one is marked Crashed: the default, 600 s, suits the default frequency; with workers started with
``PREFECT_FLOWS_HEARTBEAT_FREQUENCY=30`` a window of 90-120 s finds a lost host within two minutes.

Deployed by ``prefect deploy`` (a build step of prefect.yaml calls ``deploy_automations``, which
replaces the automation of the same name), or by hand::

    python -m flows.automations --window-s 120
"""

from __future__ import annotations

from datetime import timedelta

from datagen import settings

LOST_HOST = "datagen-lost-host"
DEFAULT_WINDOW_S = 600
# Events that end a run's silence: a heartbeat, or a state in which a run sends none.
_ALIVE_OR_DONE = (
    "prefect.flow-run.heartbeat",
    "prefect.flow-run.Completed",
    "prefect.flow-run.Failed",
    "prefect.flow-run.Cancelled",
    "prefect.flow-run.Crashed",
    "prefect.flow-run.Paused",
)


def lost_host_automation(window_s: int):
    """The automation: after a flow run's heartbeat, expect another (or its end) within the window;
    otherwise mark that flow run Crashed."""
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    return AutomationCore(
        name=LOST_HOST,
        description="A flow run whose heartbeats stopped has lost its host: mark it Crashed "
        "(a fanned-out run's parent then submits its range again).",
        enabled=True,
        trigger=EventTrigger(
            posture=Posture.Proactive,
            match={"prefect.resource.id": "prefect.flow-run.*"},
            after={"prefect.flow-run.heartbeat"},
            expect=set(_ALIVE_OR_DONE),
            for_each={"prefect.resource.id"},
            threshold=1,
            within=timedelta(seconds=window_s),
        ),
        actions=[ChangeFlowRunState(
            state=StateType.CRASHED,
            message=f"No heartbeat for {window_s} s: the flow run's host is gone (automation {LOST_HOST}).",
        )],
    )


def deploy_automations(window_s: int | str = DEFAULT_WINDOW_S) -> dict:
    """Create the project's automations on the current server, replacing those of the same name.

    A prefect.yaml deploy step. ``DATAGEN_LOST_HOST_WINDOW_S`` overrides ``window_s``.
    """
    from prefect import get_client

    window = settings.lost_host_window_s(int(window_s))
    if window < 60:
        raise ValueError(f"lost-host window {window} s is shorter than two heartbeats (30 s at least each)")
    with get_client(sync_client=True) as client:
        for old in client.read_automations_by_name(LOST_HOST):
            client.delete_automation(old.id)
        automation_id = client.create_automation(lost_host_automation(window))
    print(f"automation {LOST_HOST}: a flow run silent for {window} s is marked Crashed ({automation_id})")
    return {"lost_host_automation": str(automation_id), "lost_host_window_s": window}


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m flows.automations", description=deploy_automations.__doc__)
    parser.add_argument("--window-s", type=int, default=DEFAULT_WINDOW_S,
                        help="seconds without a heartbeat before a flow run is marked Crashed (default %(default)s)")
    args = parser.parse_args(argv)
    deploy_automations(args.window_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

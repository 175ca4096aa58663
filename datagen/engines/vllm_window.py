"""vLLM's scheduler with a window: a group's requests stream in while it computes, and its batches
(and so its bytes) are the same however fast they arrive.

The extraction adds a group's requests in order as they are rendered. Let into vLLM's own scheduler
as they come, a step would take whatever had arrived, and the batches would follow the arrival; held
until the whole group is in (vLLM's ``pause_scheduler``, as the extraction did), the GPU waits
through the first group's render (docs/performance.md, "The image rows' first group"). Here the
scheduler keeps the group's requests as they arrive and shows its waiting queue only the shortest
run of them, in order, whose unscheduled tokens reach a step's budget, or the run to the group's
last request (marked in its ``SamplingParams.extra_args``); until that run has arrived it holds, as
vLLM's own ``PAUSED_ALL`` holds (no step, no unfinished requests, so that the engine core sleeps
until the next request). What the waiting loop sees is then a function of the scheduler's state and
the rows alone, never of the arrival:

- text rows: the loop's budget ends inside the run shown, so every step is the one of the held
  group;
- image rows: where the encoder's budget runs out, vLLM's loop schedules a request up to its image
  and goes on to the next, so a step may end where the run shown ends, where the held group's loop
  would have reached further: new batches, but fixed ones.

``python -m bench.scheduler_window`` drives vLLM's scheduler both ways under random arrivals.
Requests that carry no group mark pass straight through.
"""

from __future__ import annotations

from collections import deque

from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.scheduler import Scheduler

GROUP_KEY = "datagen_group_end"  # extra_args of a group's requests: True on its last one


def group_params(params, last: bool):
    """A copy of ``params`` that marks its request as one of a group (its last one where ``last``)."""
    marked = params.clone()
    marked.extra_args = {**(params.extra_args or {}), GROUP_KEY: last}
    return marked


class WindowScheduler(Scheduler):
    """vLLM's ``Scheduler``, shown a group's requests through the window (this module's docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._kept: deque = deque()  # the group's requests arrived, not shown yet
        self._open = False  # a group whose last request has not arrived
        self._held = False

    @staticmethod
    def _member(request) -> bool:
        params = getattr(request, "sampling_params", None)
        return params is not None and GROUP_KEY in (params.extra_args or {})

    def add_request(self, request) -> None:
        if not self._member(request) or request.request_id in self.requests:
            super().add_request(request)
            return
        self._kept.append(request)
        self._open = not request.sampling_params.extra_args[GROUP_KEY]
        self._window()

    def _window(self) -> None:
        """Show the kept requests, in order, until the waiting ones' unscheduled tokens reach a step's
        budget; hold while they do not and the group's last request has not arrived."""
        if not self._kept and not self._open:  # the whole group is shown: nothing to count each step
            self._held = False
            return
        budget = self.max_num_scheduled_tokens
        waiting = sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)
        while self._kept and waiting < budget:
            request = self._kept.popleft()
            super().add_request(request)
            waiting += request.num_tokens - request.num_computed_tokens
        self._held = waiting < budget and self._open

    def schedule(self, *args, **kwargs):
        self._window()
        if not self._held or self._pause_state != PauseState.UNPAUSED:
            out = super().schedule(*args, **kwargs)
        else:  # vLLM's own hold: no tokens scheduled, finished requests still reported
            self._pause_state = PauseState.PAUSED_ALL
            try:
                out = super().schedule(*args, **kwargs)
            finally:
                self._pause_state = PauseState.UNPAUSED
        self._window()
        return out

    def finish_requests(self, request_ids, finished_status):
        """vLLM's, and where a request of the group is aborted (the extraction aborts the requests it
        added when adding the rest failed), the group is cut short: the rest of it will not come, so
        what is there runs."""
        if request_ids is None:
            self._kept.clear()
            self._open = False
        else:
            ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
            kept = deque(r for r in self._kept if r.request_id not in ids)
            if len(kept) < len(self._kept) or any(self._member(self.requests.get(i)) for i in ids):
                self._kept, self._open = kept, False
        out = super().finish_requests(request_ids, finished_status)
        self._window()
        return out

    def get_num_unfinished_requests(self) -> int:
        if self._held:
            return 0
        return super().get_num_unfinished_requests()

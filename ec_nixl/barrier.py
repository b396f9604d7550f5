"""The load barrier: the one place where transferred items are handed to compute.

The vLLM gather reads ``encoder_cache[mm_hash]`` right after ``start_load_caches`` returns, with
no hook in between, so a connector must never hand over an item before its bytes have landed.
``LoadBarrier.wait`` is that guarantee:

1. items already landed return at once (no waiting, no device work);
2. items in flight are waited for, bounded by a deadline (the endpoint's owner thread keeps
   driving NIXL meanwhile, or the waiter, when it is the owner, polls its own transfers in a
   tight loop: ``Loader.drive``);
3. the compute stream is then ordered after the data: where the bytes became visible through
   stream work (``LoadTicket``s carrying a CUDA event), the *current stream waits on that event*;
   no ``torch.cuda.synchronize()``. Bytes that NIXL reports DONE were written by UCX's own
   completed copy or DMA before DONE was observed on the host, so kernels launched after the
   barrier see them without further device work;
4. if anything failed or the deadline passed, ``LoadFailed`` names exactly which items and why,
   and nothing is returned: partial data never reaches the caller.

On CPU it is host-side only. This module owns the ordering decision; it never posts transfers.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import torch

from ec_nixl.endpoint import Endpoint
from ec_nixl.errors import LoadFailed
from ec_nixl.states import TicketState
from ec_nixl.tickets import LoadTicket, hand_over


_LANDED = TicketState.LANDED


class LoadBarrier:
    """Waits for a step's ``LoadTicket``s; see the module docstring."""

    def __init__(self, endpoint: Endpoint, settle: bool = True):
        """``settle=False``: a caller that drives its own endpoint (vLLM's PD worker) leaves the
        after-completion work (read-done messages to producers, telemetry) to its next
        ``Endpoint.progress()``, e.g. at the end of the step, instead of paying it before the
        hand-over (the next load and the next wait also settle what is left, while their own
        DMAs run). A threaded endpoint's I/O thread settles on its own either way."""
        self.endpoint = endpoint
        self.settle = settle

    def wait(self, tickets: Sequence[LoadTicket], timeout: Optional[float] = None) -> dict[str, torch.Tensor]:
        """Block until every ticket landed (-> ``{mm_hash: tensor view}``) or raise ``LoadFailed``.

        ``timeout`` bounds this call; each ticket's own deadline (from ``Endpoint.load``) applies
        too, so a wait never outlives the load timeout.
        """
        t0 = time.perf_counter()
        for t in tickets:  # (plain loops: this is the hand-over, every step pays it)
            if t.state is not _LANDED:
                self._wait_landed(tickets, timeout)
                break
        out, events = hand_over(tickets)
        if events:
            stream = torch.cuda.current_stream()
            for e in events:
                stream.wait_event(e)
        self.endpoint.metrics.wait(time.perf_counter() - t0)
        return out

    def _wait_landed(self, tickets: Sequence[LoadTicket], timeout: Optional[float]) -> None:
        """Wait until every ticket is final, within budget; raise ``LoadFailed`` unless all landed."""
        budget = timeout
        if budget is None:
            budget = max([t.deadline for t in tickets], default=0.0) - time.monotonic() + 0.05
        loader = self.endpoint.loader
        if loader is not None and self.endpoint.loop.is_owner:
            loader.drive(list(tickets), time.monotonic() + max(0.0, budget), settle=self.settle)
        else:
            self.endpoint.wait_for(lambda: all(t.done for t in tickets), max(0.0, budget))
        for t in tickets:  # (a loop, not all() over a generator: every step's hand-over passes here)
            if t.state is not _LANDED:
                break
        else:
            return
        late = [t for t in tickets if not t.done]
        if late:  # out of time: make them final (quarantining any DMA target) before reporting
            self.endpoint.cancel(late, "not landed before the barrier's deadline")
        failures = {t.mm_hash: (t.error or t.reason or t.state) for t in tickets if t.state is not _LANDED}
        if failures:
            raise LoadFailed(failures)

    @staticmethod
    def failed(tickets: Sequence[LoadTicket]) -> dict[str, str]:
        """The failures among ``tickets`` so far (non-blocking)."""
        return {t.mm_hash: t.error for t in tickets if t.state is TicketState.FAILED}

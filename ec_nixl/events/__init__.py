"""Encoder-cache events: which instance holds which multimodal item (vLLM-free core).

``schema`` (the wire: vLLM's KV-events framing, our event types), ``publisher`` (one instance's
state, deltas, replay and snapshot), ``subscriber`` (many publishers into one ``index`` that
converges after late starts, gaps, restarts and deaths). The vLLM hooks that feed a publisher
live in ``ec_nixl.vllm.cache_events``; docs/events.md is the reference.
"""

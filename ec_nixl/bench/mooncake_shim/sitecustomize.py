"""On the PYTHONPATH of ``ec-nixl bench serve``'s ECMooncakeConnector instances only.

vLLM 0.32's V1 model runner (the only one on CPU: Model Runner V2 needs Triton) returns early on
a step with no scheduled tokens without entering the EC connector's context, so a consumer whose
requests all wait for pushed encoder outputs never runs ``start_load_caches`` for the loads its
scheduler dispatched: every such request waits out ``push_wait_timeout_s`` (60 s) and fails, though
the push landed. Model Runner V2 handles it (``_merge_ec_connector_no_forward``); this does the
same for V1 so that the in-tree peer is measured at its best, not at a vLLM gap. (NixlECConnector
needs no such help: its holds run in the scheduler process.) Then the next ``sitecustomize`` on
the path runs (the e2e shim, when present).
"""

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
for _p in sys.path:
    _f = os.path.join(_p or ".", "sitecustomize.py")
    if os.path.abspath(_p or ".") != _here and os.path.isfile(_f):
        exec(compile(open(_f).read(), _f, "exec"))
        break

if os.environ.get("EC_NIXL_BENCH_MOONCAKE_NOFORWARD_FIX") == "1":
    from vllm.distributed.ec_transfer import get_ec_transfer, has_ec_transfer
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.worker import gpu_model_runner as _runner

    _execute_model = _runner.GPUModelRunner.execute_model

    def _execute_model_with_ec_loads(self, scheduler_output, *args, **kwargs):
        out = _execute_model(self, scheduler_output, *args, **kwargs)
        if (scheduler_output.total_num_scheduled_tokens == 0 and has_ec_transfer()
                and get_ec_transfer().is_consumer and scheduler_output.ec_connector_metadata is not None):
            with self.maybe_get_ec_connector_output(scheduler_output, encoder_cache=self.encoder_cache) as ec_out:
                pass
            out = ModelRunnerOutput.with_ec_conn_output(out, ec_out)
        return out

    _runner.GPUModelRunner.execute_model = _execute_model_with_ec_loads

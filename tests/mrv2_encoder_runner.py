"""vLLM's encode-only runner (``MMEncoderModelRunner``, Model Runner V2) with NixlECConnector on a CPU
host, as a producer process: ``python mrv2_encoder_runner.py MODEL PORT``.

Run as its own process: it imports vLLM's CPU-worker shim (``vllm.v1.worker.cpu.shm``, which
vLLM's CPU worker imports; it replaces CUDA streams/events, pinned memory and UVA buffers for the
whole process) and initialises torch.distributed.

With the shim the runner is constructed and loads the real (tiny, random) Qwen2-VL. Its
``execute_model`` cannot run here: MRv2's request bookkeeping is Triton kernels
(``RequestState.apply_staged_writes`` -> ``_apply_write_kernel[grid]``), and no Triton CPU backend
exists on this host. So this script runs ``execute_model``'s EC part as written, in order:
the runner's own ``ec_connector.maybe_get_output(scheduler_output)`` around the runner's own
``model_state.execute_mm_encoder`` (the real vision tower), then
``make_empty_encoder_model_runner_output``; the one piece of bookkeeping the encoder needs
(``encoder_cache.add_request``) is done by hand. vLLM's Scheduler drives it and finishes the
request, which yields the ``ec_transfer_params``.

Prints one line "MRV2_ENCODER_RUNNER {json}": {"params", "digest", "shape", "dtype", "encoder_only", "runner_ec"}; then
serves until stdin closes.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from vllm_cpu_host import create_engine_config  # noqa: E402  (first: selects vLLM's CPU platform)


def main(model: str, port: int) -> None:
    import torch
    import vllm.v1.worker.cpu.shm  # noqa: F401  (vLLM's CPU worker shim)
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.distributed.ec_transfer import ensure_ec_transfer_initialized, get_ec_transfer
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import ModelRunnerOutput, make_empty_encoder_model_runner_output
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.worker.gpu.ec_connector import ActiveECConnector
    from vllm.v1.worker.mm_encoder_model_runner import MMEncoderModelRunner
    from vllm.v1.worker.worker_base import WorkerBase

    import ec_nixl.vllm
    from mrv2_engine import free_port, make_request
    from peers import digest

    ec_nixl.vllm.register()
    ec = {"ec_connector": "NixlECConnector", "ec_role": "ec_producer", "ec_buffer_device": "cpu",
          "ec_buffer_size": 16 << 20, "ec_port": port, "engine_id": "mrv2-encoder-runner",
          # The lease outlives a slow consumer start on a loaded box: this test is about bytes.
          "ec_connector_extra_config": {"nixl_progress_thread": False, "announce_lease_s": 600.0}}
    vc = create_engine_config(EngineArgs(model=model, max_model_len=1024, enforce_eager=True, dtype="bfloat16",
                                         ec_transfer_config=ec))
    with set_current_vllm_config(vc):
        # Worker process: distributed state, the WORKER connector, the runner and its model.
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        ensure_model_parallel_initialized(1, 1)
        ensure_ec_transfer_initialized(vc)
        runner = MMEncoderModelRunner(vc, torch.device("cpu"))
        runner.load_model()
        get_ec_transfer().start_worker_services()
        assert isinstance(runner.ec_connector, ActiveECConnector)
        assert runner.ec_connector.ec_connector is get_ec_transfer()
        assert runner.ec_connector.encoder_cache is runner.encoder_cache.encoder_outputs
        # EngineCore: KV layout and (empty) KV cache as the engine resolves them, then the scheduler.
        layouts = WorkerBase.get_supported_kv_cache_layouts(type("W", (), {"vllm_config": vc})())
        resolve_kv_cache_layout(vc, [layouts], [])
        kv = KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=[])
        kv.kv_cache_layout = vc.cache_config.kv_cache_layout
        runner.initialize_kv_cache(kv)
        vc.cache_config.num_gpu_blocks = 1
        sched = Scheduler(vllm_config=vc, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(vc),
                          block_size=vc.cache_config.block_size, log_stats=True)
        if hasattr(sched, "use_v2_model_runner"):
            sched.use_v2_model_runner = True  # the runner is MRv2 (vLLM <= 0.33 would pick V1 without Triton)
        req = make_request("enc", [("real-vit", 5, 6)])
        sched.add_request(req)
        params = None
        for _ in range(10):
            so = sched.schedule()
            for nr in so.scheduled_new_reqs:
                runner.encoder_cache.add_request(nr.req_id, nr.mm_features)
            with runner.ec_connector.maybe_get_output(so) as ec_out:
                runner.model_state.execute_mm_encoder(so.scheduled_encoder_inputs)
            out = ModelRunnerOutput.with_ec_conn_output(make_empty_encoder_model_runner_output(so), ec_out)
            for outs in sched.update_from_output(so, out).values():
                for o in outs.outputs:
                    if o.request_id == "enc" and o.finish_reason is not None:
                        params = o.ec_transfer_params
            if params is not None:
                break
        t = runner.encoder_cache.encoder_outputs["real-vit"]
        print("MRV2_ENCODER_RUNNER " + json.dumps({"params": params, "digest": digest(t), "shape": list(t.shape),
                          "dtype": str(t.dtype).removeprefix("torch."), "encoder_only": vc.is_mm_encoder_only,
                          "published": get_ec_transfer().worker.endpoint.published()}), flush=True)
        sys.stdin.read()  # serve until the test closes our stdin
        sched.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))

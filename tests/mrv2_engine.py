"""One vLLM engine under Model Runner V2, reduced to what an EC connector touches: vLLM's own code.

``MRv2Engine.step()`` is ``EngineCore.step`` with the V2 runner's ``execute_model`` in the middle:

* ``Scheduler.schedule()`` (vLLM's scheduler, with NixlECConnector in role SCHEDULER: admission,
  ``has_cache_item``, ``update_state_after_alloc``, ``build_connector_meta``);
* the worker: MRv2's request bookkeeping on its ``EncoderCache`` (finished requests, freed hashes,
  new requests), then, for a step without tokens, ``ActiveECConnector.no_forward``; otherwise
  ``ActiveECConnector.maybe_get_output`` (bind, save/load, save of new keys, get_finished, stats,
  worker meta, clear) around ``EncoderRunner.prepare_mm_inputs`` / ``execute_mm_encoder`` (the
  encode) and ``EncoderRunner.gather_mm_embeddings`` (the gather that raises ``Encoder cache
  miss``); an encode-only engine returns ``make_empty_encoder_model_runner_output`` as
  ``MMEncoderModelRunner`` does;
* ``Scheduler.update_from_output()`` (worker meta to the connector, failed requests, finished
  requests with their ``ec_transfer_params``).

The worker-side connector is the process-wide one vLLM's workers create
(``ensure_ec_transfer_initialized``), found by ``get_ec_connector`` as MRv2 finds it.

Two things are not vLLM's (stand-ins, not fault injections):
* the model: ``ProjectionEncoder`` replaces Qwen2-VL's vision tower by a fixed random projection
  of the pixel patches (the connector only sees the tensors the encoder leaves in the cache, and
  the tests must know every byte the gather should return); the LM forward and sampling are not
  run: a request that completes its prefill "samples" ``SAMPLED_TOKEN``.
* MRv2's GPU bookkeeping (``RequestState``, block tables, ``InputBatch``) is Triton kernels that do
  not run on a CPU host; its effect on the gather (which requests, how many tokens, from where)
  is derived here from ``SchedulerOutput`` directly.

Every engine runs on vLLM's CPU platform (``VLLM_TARGET_DEVICE=cpu`` with the GPU wheels). A vLLM
without MRv2's EC wrapper (0.26) runs its EC instances on the V1 runner: ``v1_engine.V1Engine`` is
this engine with the worker's EC calls made by V1's mixin, and ``ProducerEngineProcess`` uses it there.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import socket
import time
import traceback
from typing import Any, Optional

import numpy as np
import torch
from vllm_cpu_host import create_engine_config  # noqa: E402  (first: it selects vLLM's CPU platform)

ROWS, WIDTH = 9, 128  # tiny Qwen2-VL: a 6x6-patch image gives 9 embeddings of width 128
GRID = (1, 6, 6)
PATCH = 1176  # 3 channels x 2 frames x 14 x 14
SAMPLED_TOKEN = 1
PROMPT_LEN = 48


def build_tiny_model(out) -> str:
    """The tiny random Qwen2-VL of the e2e tests (tests/e2e/build_tiny_vl.py), built offline at ``out``."""
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "e2e", "build_tiny_vl.py")
    subprocess.run([sys.executable, script, str(out)], check=True, capture_output=True, timeout=300)
    return str(out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_config(model: str, role: str, port: int = 0, extra: Optional[dict] = None, engine: Optional[dict] = None,
                **ec):
    """``extra``: the connector's extra config; ``engine``: more EngineArgs; ``ec``: more ec_transfer_config."""
    from vllm.engine.arg_utils import EngineArgs

    cfg = {"ec_connector": "NixlECConnector", "ec_role": role, "ec_buffer_device": "cpu",
           "ec_buffer_size": 32 << 20, "ec_port": port or free_port(), "engine_id": f"mrv2-{role}-{os.getpid()}",
           "ec_connector_extra_config": {"nixl_progress_thread": False, **(extra or {})}}
    cfg.update(ec)
    return create_engine_config(EngineArgs(model=model, max_model_len=1024, enforce_eager=True, dtype="bfloat16",
                                           ec_transfer_config=cfg, **(engine or {})))


def pixels(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(GRID[0] * GRID[1] * GRID[2], PATCH, generator=g)


def image_feature(h: str, seed: int, offset: int, media: bool = True):
    """One image as vLLM's Qwen2-VL processor lays it out (flat pixel_values, batched grid)."""
    from vllm.multimodal.inputs import (
        MultiModalFeatureSpec,
        MultiModalFieldConfig,
        MultiModalKwargsItem,
        PlaceholderRange,
    )

    grid = torch.tensor([GRID])
    data = {"image_grid_thw": MultiModalFieldConfig.batched("image").build_elems("image_grid_thw", grid)[0]}
    if media:
        data["pixel_values"] = MultiModalFieldConfig.flat_from_sizes("image", grid.prod(-1)).build_elems(
            "pixel_values", pixels(seed))[0]
    return MultiModalFeatureSpec(data=MultiModalKwargsItem(data), modality="image", identifier=h,
                                 mm_position=PlaceholderRange(offset=offset, length=ROWS))


def make_request(rid: str, images: list[tuple[str, int, int]], params: Optional[dict] = None,
                 media: bool = True, max_tokens: int = 1):
    """A request whose prompt holds ``images`` = [(mm_hash, seed, offset)]; ``params`` become its
    ``ec_transfer_params`` the way the API server passes them (``extra_args``)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                        extra_args={"ec_transfer_params": params} if params is not None else None)
    feats = [image_feature(h, seed, off, media) for h, seed, off in images]
    return Request(rid, prompt_token_ids=[7] * PROMPT_LEN, sampling_params=sp, pooling_params=None,
                   mm_features=feats)


class ProjectionEncoder(torch.nn.Module):
    """Stand-in vision tower: 2x2 patch merge and a fixed random projection to WIDTH (bfloat16).

    Deterministic across processes, so a consumer can compute what a producer encoded.
    """

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1234)
        self.proj = torch.randn(4 * PATCH, WIDTH, generator=g, dtype=torch.float64) / (4 * PATCH) ** 0.5
        self.calls: list[int] = []  # items per embed_multimodal call

    def embed_multimodal(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, **_: Any):
        sizes = image_grid_thw.prod(-1).tolist()
        self.calls.append(len(sizes))
        # float64 accumulation: the bfloat16 result does not depend on the thread count
        return tuple((p.reshape(-1, 4 * PATCH).double() @ self.proj).to(torch.bfloat16)
                     for p in pixel_values.split(sizes))


def encoded(seed: int) -> torch.Tensor:
    """What ProjectionEncoder makes of image ``seed``."""
    return ProjectionEncoder().embed_multimodal(pixels(seed), torch.tensor([GRID]))[0]


class MRv2Engine:
    """vLLM's Scheduler + MRv2's EC wrapper, EncoderCache and EncoderRunner in one process."""

    RUNNER_V2 = True
    """The scheduler sends what MRv2 expects (vLLM <= 0.33 picks V1 where Triton is missing)."""

    def __init__(self, vc, *, num_blocks: int = 256):
        from vllm.distributed.ec_transfer import ensure_ec_transfer_initialized, get_ec_transfer
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.gpu.mm.encoder_cache import EncoderCache
        from vllm.v1.worker.gpu.mm.encoder_runner import EncoderRunner

        import ec_nixl.vllm
        import ec_nixl.vllm.hooks as hooks

        ec_nixl.vllm.register()  # what the vllm.general_plugins entry point does in every process
        self.vc = vc
        ec = vc.ec_transfer_config  # (vLLM 0.26 has no is_mm_encoder_only: producer-only is encode-only)
        self.encode_only = bool(getattr(vc, "is_mm_encoder_only", ec.is_ec_producer and not ec.is_ec_consumer))
        # Worker process: vLLM creates the WORKER-role connector and (>= 0.32, in load_model) starts
        # its services; an older vLLM has no such call (the connector started them when created).
        ensure_ec_transfer_initialized(vc)
        self.connector = get_ec_transfer()
        if hooks.WORKER_SERVICES:
            self.connector.start_worker_services()
        self.encoder_cache = EncoderCache()
        self.ec = self._ec_wrapper(vc)
        self.model = ProjectionEncoder()
        self.runner = EncoderRunner(model=self.model, max_num_tokens=vc.scheduler_config.max_num_batched_tokens,
                                    hidden_size=WIDTH, encoder_cache=self.encoder_cache, dtype=torch.bfloat16,
                                    device=torch.device("cpu"))
        # EngineCore process: the scheduler (and its SCHEDULER-role connector) over a small KV cache;
        # an encode-only instance has no KV cache layers.
        block = vc.cache_config.block_size
        groups = [] if self.encode_only else [KVCacheGroupSpec(["layer.0"], FullAttentionSpec(
            block_size=block, num_kv_heads=1, head_size=64, dtype=torch.bfloat16))]
        kv = KVCacheConfig(num_blocks=num_blocks if groups else 1, kv_cache_tensors=[], kv_cache_groups=groups)
        vc.cache_config.num_gpu_blocks = kv.num_blocks
        self.scheduler = Scheduler(vllm_config=vc, kv_cache_config=kv,
                                   structured_output_manager=StructuredOutputManager(vc), block_size=block,
                                   log_stats=True)
        if self.RUNNER_V2 and hasattr(self.scheduler, "use_v2_model_runner"):
            # vLLM <= 0.33 picks the runner from the config, which picks V1 without Triton; the
            # worker here is MRv2, so the scheduler must send what MRv2 expects (prefill ids).
            self.scheduler.use_v2_model_runner = True
        self._num_computed: dict[str, int] = {}
        self._prefill_len: dict[str, int] = {}
        self.gathered: dict[str, list[torch.Tensor]] = {}  # req_id -> embeddings the gather returned
        self.finished: dict[str, Any] = {}  # req_id -> its final EngineCoreOutput
        self.tokens: dict[str, list[int]] = {}  # req_id -> tokens sent to the client
        self.saved: list[str] = []  # mm_hashes MRv2 handed to save_caches
        self.steps = self.zero_token_steps = 0
        self.worker_meta: list[Any] = []  # every ECConnectorWorkerMetadata the worker produced
        self._wrap_save_caches()

    def _ec_wrapper(self, vc):
        """MRv2's EC wrapper around the worker's connector (``get_ec_connector``)."""
        from vllm.v1.worker.gpu.ec_connector import ActiveECConnector, get_ec_connector

        ec = get_ec_connector(vc, self.encoder_cache)
        assert isinstance(ec, ActiveECConnector), type(ec)
        return ec

    def _wrap_save_caches(self) -> None:
        """Record which keys MRv2 asks to save (observation only; the call goes through)."""
        inner = self.connector.save_caches

        def save_caches(encoder_cache, mm_hash, **kw):
            self.saved.append(mm_hash)
            return inner(encoder_cache=encoder_cache, mm_hash=mm_hash, **kw)

        self.connector.save_caches = save_caches

    # ------------------------------------------------------------------ engine

    def add(self, request) -> None:
        self.scheduler.add_request(request)

    def step(self):
        """schedule -> execute_model -> update_from_output; returns (SchedulerOutput, ModelRunnerOutput)."""
        so = self.scheduler.schedule()
        out = self.execute_model(so)
        self.finish_step(so, out)
        return so, out

    def finish_step(self, so, out) -> None:
        self.steps += 1
        meta = getattr(out.ec_connector_output, "ec_connector_worker_meta", None)  # (vLLM >= 0.32)
        if meta is not None:
            self.worker_meta.append(meta)
        for outputs in self.scheduler.update_from_output(so, out).values():
            for o in outputs.outputs:
                self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finished[o.request_id] = o

    def run_until(self, pred, timeout: float = 60.0, max_steps: Optional[int] = None, what: str = "condition"):
        """Step until ``pred()`` (vLLM's engine loop steps back to back while requests wait);
        returns the number of steps taken."""
        deadline = time.monotonic() + timeout
        n = 0
        while not pred():
            if time.monotonic() > deadline or (max_steps is not None and n >= max_steps):
                raise AssertionError(f"{what} not reached after {n} engine steps in {timeout:.0f}s at most "
                                     f"({self.zero_token_steps} steps without tokens in all)")
            self.step()
            n += 1
        return n

    # ------------------------------------------------------------------ worker

    def execute_model(self, so):
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            self.zero_token_steps += 1
            return ModelRunnerOutput.with_ec_conn_output(EMPTY_MODEL_RUNNER_OUTPUT,
                                                         self.ec.no_forward(so).ec_connector_output)
        with self.ec.maybe_get_output(so) as ec_out:
            self._encode(so.scheduled_encoder_inputs)
            if not self.encode_only:
                self._gather(so)
        return ModelRunnerOutput.with_ec_conn_output(self._output(so), ec_out)

    def _update_states(self, so) -> None:
        """MRv2's finish_requests / free_states / add_requests / update_requests, EC part."""
        for rid in set(so.finished_req_ids) | set(getattr(so, "preempted_req_ids", None) or ()):
            self.encoder_cache.remove_request(rid)
            self._num_computed.pop(rid, None)
        for h in so.free_encoder_mm_hashes:
            self.encoder_cache.free_encoder_cache(h)
        for nr in so.scheduled_new_reqs:
            self.encoder_cache.add_request(nr.req_id, nr.mm_features)
            ids = nr.prefill_token_ids if nr.prefill_token_ids is not None else nr.prompt_token_ids
            self._prefill_len[nr.req_id] = len(ids)
            self._num_computed[nr.req_id] = nr.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for rid, n in zip(cached.req_ids, cached.num_computed_tokens):
            self._num_computed[rid] = n

    def _encode(self, scheduled_encoder_inputs) -> None:
        """ModelState.execute_mm_encoder: encode what is scheduled and not cached, cache it."""
        hashes, kwargs = self.runner.prepare_mm_inputs(scheduled_encoder_inputs)
        if kwargs:
            outs = self.runner.execute_mm_encoder(kwargs)
            self.encoder_cache.encoder_outputs.update(zip(hashes, outs))

    def _gather(self, so) -> None:
        req_ids = list(so.num_scheduled_tokens)
        n = np.array([so.num_scheduled_tokens[r] for r in req_ids], dtype=np.int32)
        qsl = np.zeros(len(req_ids) + 1, dtype=np.int32)
        np.cumsum(n, out=qsl[1:])
        computed = np.array([self._num_computed[r] for r in req_ids], dtype=np.int32)
        prefill = np.array([self._prefill_len[r] for r in req_ids], dtype=np.int32)
        embeds, is_mm = self.runner.gather_mm_embeddings(req_ids, int(n.sum()), n, qsl, prefill, computed)
        # The slices are views of the cache entries: copy them now, as the LM's embedding merge
        # (model.embed_input_ids) consumes them now.
        it = iter(embeds)
        for i, rid in enumerate(req_ids):
            lo, hi = int(qsl[i]), int(qsl[i + 1])
            rows = int(is_mm[lo:hi].sum())
            got = []
            while rows > 0:
                e = next(it)
                got.append(e.clone())
                rows -= e.shape[0]
            if got:
                self.gathered.setdefault(rid, []).extend(got)

    def _output(self, so):
        from vllm.v1.outputs import ModelRunnerOutput, make_empty_encoder_model_runner_output

        req_ids = list(so.num_scheduled_tokens)
        for rid in req_ids:
            self._num_computed[rid] = self._num_computed.get(rid, 0) + so.num_scheduled_tokens[rid]
        if self.encode_only:
            return make_empty_encoder_model_runner_output(so)
        sampled = [[SAMPLED_TOKEN] if self._num_computed[r] >= self._prefill_len[r] else [] for r in req_ids]
        kw: dict[str, Any] = {"req_ids": req_ids, "sampled_token_ids": sampled}
        if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:  # <= 0.33
            kw["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
        return ModelRunnerOutput(**kw)

    # ------------------------------------------------------------------ views

    def rows(self, rid: str) -> torch.Tensor:
        """Every embedding row the gather returned for ``rid``, in prompt order."""
        return torch.cat(self.gathered[rid]) if rid in self.gathered else torch.empty(0, WIDTH)

    @property
    def worker(self):
        return self.connector.worker

    def shutdown(self) -> None:
        from vllm.distributed.ec_transfer import ensure_ec_transfer_shutdown

        try:
            self.scheduler.shutdown()
        finally:
            ensure_ec_transfer_shutdown()


# ------------------------------------------------------------------------------ producer process


def _producer_main(conn, model: str, port: int, extra: dict, runner: str) -> None:
    """An encode-only (``ec_producer``) engine in its own process, driven over a pipe."""
    torch.set_num_threads(1)
    try:
        import ec_nixl.vllm.hooks as hooks

        if runner == "v1" or not hooks.MRV2_EC:  # (vLLM 0.26: EC instances run on the V1 runner)
            from v1_engine import V1Engine as cls
        else:
            cls = MRv2Engine
        engine = cls(vllm_config(model, "ec_producer", port=port, extra=extra))
        engine.vc.ec_transfer_config.mm_encoder_output_widths = {"image": WIDTH}  # measured at startup in vLLM
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", engine.connector.worker.endpoint.address))
    while True:
        try:
            cmd, args = conn.recv()
        except EOFError:
            break
        try:
            if cmd == "encode":
                # args: [(rid, [(mm_hash, seed, offset)])] -> {rid: ec_transfer_params}
                for rid, images in args:
                    engine.add(make_request(rid, images))
                want = {rid for rid, _ in args}
                # EngineCore steps while the scheduler has requests, finished ones included (their
                # ids go to the workers with one more step, which also re-publishes the cache hits
                # they announced)
                engine.run_until(lambda: want <= set(engine.finished) and not engine.scheduler.has_requests(),
                                 what="encode")
                conn.send(("ok", {rid: engine.finished[rid].ec_transfer_params for rid in want}))
            elif cmd == "state":
                w = engine.worker
                conn.send(("ok", {"published": sorted(w.endpoint.published()), "saved": list(engine.saved),
                                  "encoder_calls": list(engine.model.calls), "steps": engine.steps,
                                  "cache": sorted(engine.encoder_cache.encoder_outputs)}))
            elif cmd == "close":
                engine.shutdown()
                conn.send(("ok", None))
                break
            else:
                conn.send(("error", f"unknown command {cmd}"))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class ProducerEngineProcess:
    """An E instance: vLLM's scheduler and MRv2's EC path (V1's where vLLM has no MRv2 EC wrapper)
    with NixlECConnector, in a child process."""

    def __init__(self, model: str, extra: Optional[dict] = None, timeout: float = 300.0, runner: str = "mrv2"):
        """``runner``: "mrv2" (where vLLM has MRv2's EC wrapper; else V1) or "v1"."""
        ctx = mp.get_context("spawn")
        self.port = free_port()
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_producer_main, args=(child, model, self.port, extra or {}, runner),
                                daemon=True)
        self.proc.start()
        child.close()
        status, value = self._recv(timeout, "start")
        if status != "ready":
            self.close()
            raise RuntimeError(f"producer engine did not start:\n{value}")
        self.address = value

    def _recv(self, timeout: float, what: str):
        if not self._conn.poll(timeout):
            raise TimeoutError(f"producer engine: {what} timed out")
        return self._conn.recv()

    def call(self, cmd: str, args: Any = None, timeout: float = 120.0) -> Any:
        self._conn.send((cmd, args))
        status, value = self._recv(timeout, cmd)
        if status != "ok":
            raise RuntimeError(value)
        return value

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("close", timeout=30)
            except Exception:
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)

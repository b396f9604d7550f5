"""Configuration parsing: strings coerced, unknown keys listed, bad values named."""

from __future__ import annotations

import sys

import pytest

from ec_nixl.config import EndpointConfig, parse_options, split_address
from ec_nixl.endpoint import Endpoint
from ec_nixl.errors import ConfigError


def test_strings_are_coerced():
    cfg = parse_options(EndpointConfig, {"load_timeout_s": "2.5", "threaded": "false", "pool_bytes": "1e8",
                                         "backends": "UCX,GDS", "mode": "write", "token": "t"},
                        fixed={"name": "x"})
    assert cfg.load_timeout_s == 2.5 and cfg.threaded is False and cfg.pool_bytes == 100_000_000
    assert cfg.backends == ("UCX", "GDS") and cfg.mode == "write"


def test_unknown_key_lists_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['load_timeout'\]; valid options are: .*load_timeout_s"):
        parse_options(EndpointConfig, {"load_timeout": 3}, fixed={"name": "x"})


@pytest.mark.parametrize("opts,msg", [
    ({"threaded": "maybe"}, "expected a boolean"),
    ({"pool_bytes": "lots"}, "pool_bytes"),
    ({"mode": "sideways"}, "mode must be one of"),
    ({"block_bytes": 1000}, "power of two"),
    ({"load_timeout_s": -1}, "must be > 0"),
    ({"listen": "nohost"}, "host:port"),
    ({"pool_bytes": 1024}, "too small"),
    ({"pool_bytes": True}, "boolean"),
    ({"reserve_wait_s": -0.5}, "reserve_wait_s must be >= 0"),
    ({"gil_switch_interval_s": 0}, r"gil_switch_interval_s must be in \(0, 1\]"),
    ({"gil_switch_interval_s": 5}, r"gil_switch_interval_s must be in \(0, 1\]"),
    ({"gil_switch_interval_s": "fast"}, "gil_switch_interval_s"),
])
def test_bad_values_are_named(opts, msg):
    with pytest.raises(ConfigError, match=msg):
        parse_options(EndpointConfig, opts, fixed={"name": "x"})


def test_split_address():
    assert split_address("10.0.0.1:15600") == ("10.0.0.1", 15600)
    assert split_address("[::1]:5") == ("::1", 5)
    assert split_address("h:0", allow_any_port=True) == ("h", 0)
    for bad in ["h", "h:x", ":5", "h:70000", "h:0", 5]:
        with pytest.raises(ConfigError):
            split_address(bad)


def test_ucx_params_turn_on_zero_copy_read_for_vram_unless_the_user_decided(monkeypatch):
    from ec_nixl.transport import ucx_params

    monkeypatch.delenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", raising=False)
    assert ucx_params({}, "DRAM") == {}, "no cuda_ipc on DRAM pools: nothing to switch on"
    assert ucx_params({}, "VRAM") == {"engine_config": "CUDA_IPC_ENABLE_GET_ZCOPY=y"}
    assert ucx_params({"engine_config": "RCACHE_ENABLE=n", "num_threads": 2}, "VRAM") == \
        {"engine_config": "RCACHE_ENABLE=n,CUDA_IPC_ENABLE_GET_ZCOPY=y", "num_threads": "2"}
    assert ucx_params({"engine_config": "CUDA_IPC_ENABLE_GET_ZCOPY=n"}, "VRAM") == \
        {"engine_config": "CUDA_IPC_ENABLE_GET_ZCOPY=n"}, "the user's own choice stays"
    monkeypatch.setenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "n")
    assert ucx_params({}, "VRAM") == {}, "the environment variable wins in UCX: leave it alone"


def test_progress_thread_per_role_and_backend():
    """NIXL's (blocking) progress thread: on for UCX producers, off for consumers and for other
    backends unless asked; its wait must be a non-negative time (0 = NIXL's spinning default)."""
    assert EndpointConfig(name="p", listen="127.0.0.1:0").progress_thread
    assert not EndpointConfig(name="c").progress_thread
    assert not EndpointConfig(name="p", listen="127.0.0.1:0", backends=("LIBFABRIC",)).progress_thread
    assert EndpointConfig(name="c", nixl_progress_thread=True).progress_thread
    assert not EndpointConfig(name="p", listen="127.0.0.1:0", nixl_progress_thread=False).progress_thread
    with pytest.raises(ConfigError, match="nixl_progress_wait_s"):
        EndpointConfig(name="p", nixl_progress_wait_s=-1)


@pytest.fixture
def switch_interval():
    """The interpreter's GIL switch interval set to CPython's default for the test, then restored."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(before)


def test_an_io_thread_lowers_the_gil_switch_interval_and_never_raises_it(switch_interval):
    """By default (``None``) the interpreter is left alone: the native hand-off answers without the
    GIL (issue 40). An endpoint with an I/O thread asked for ``gil_switch_interval_s`` lowers the
    process's switch interval to it (where answers still go through Python, a busy runner thread
    would keep that thread from its messages for up to 5 ms); a caller-driven one or a larger value
    leave it as it is; ``None`` is also what a JSON null or "none" option gives."""
    def interval_after(**kw) -> float:
        ep = Endpoint(EndpointConfig(name="gil", pool_bytes=0, **kw))
        try:
            return sys.getswitchinterval()
        finally:
            ep.close()

    assert interval_after() == pytest.approx(0.005), "by default vLLM's interpreter is left alone"
    assert interval_after(threaded=False, gil_switch_interval_s=0.0002) == pytest.approx(0.005), \
        "no I/O thread: nothing to wake"
    assert interval_after(gil_switch_interval_s=None) == pytest.approx(0.005)
    assert parse_options(EndpointConfig, {"gil_switch_interval_s": "none"}, fixed={"name": "x"}).gil_switch_interval_s is None
    assert interval_after(gil_switch_interval_s=0.01) == pytest.approx(0.005), "never raised"
    assert interval_after(gil_switch_interval_s=0.0002) == pytest.approx(0.0002), "lowered when asked"
    assert interval_after(gil_switch_interval_s=0.001) == pytest.approx(0.0002), "nor raised by a later endpoint"

"""The launcher's pure parts: how instances are placed on cores (no process is started)."""

from __future__ import annotations

from unittest import mock

import pytest

from ec_nixl.disagg.launcher import LaunchConfig, cpu_binds, plan


def binds(ncores: int, roles: list[str]) -> list[str]:
    with mock.patch("os.sched_getaffinity", return_value=set(range(ncores))):
        return cpu_binds(roles)


@pytest.mark.parametrize("ncores,roles,want", [
    (8, ["encoder", "encoder", "pd"], ["0,1", "2,3", "4,5"]),  # enough cores: disjoint ranges
    (4, ["encoder", "pd"], ["0,1", "2,3"]),
    (2, ["encoder", "encoder", "pd"], ["0", "0", "1"]),  # scarce: the consumer gets a core alone
    (3, ["encoder", "encoder", "pd", "pd"], ["0", "0", "1", "2"]),
    (2, ["encoder", "encoder", "pd", "pd"], ["0", "0", "1", "1"]),
    (2, ["encoder", "encoder", "encoder"], ["0", "1", "0"]),  # no consumer: round-robin
    (2, ["pd", "pd", "pd"], ["0", "1", "0"]),
    (1, ["encoder", "pd"], ["0", "0"]),  # one core: nothing else is possible
])
def test_cpu_binds_keep_consumers_off_encoder_cores(ncores: int, roles: list[str], want: list[str]) -> None:
    got = binds(ncores, roles)
    assert got == want
    if 1 < ncores < len(roles) and "pd" in roles and "encoder" in roles:
        enc = {got[i] for i, r in enumerate(roles) if r == "encoder"}
        pd = {got[i] for i, r in enumerate(roles) if r == "pd"}
        assert not enc & pd, f"an encoder shares a core with a consumer: {got}"


def test_plan_uses_the_binds(tmp_path) -> None:
    cfg = LaunchConfig(model="m", num_encoders=2, num_pd=1, log_dir=tmp_path, ec_buffer_device="cpu")
    with mock.patch("os.sched_getaffinity", return_value={0, 1}):
        insts = plan(cfg)
    assert [(i.role, i.env["VLLM_CPU_OMP_THREADS_BIND"]) for i in insts] == [
        ("encoder", "0"), ("encoder", "0"), ("pd", "1")]

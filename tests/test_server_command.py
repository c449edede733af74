"""The launch_server command line a RuntimeConfig becomes: the CPU defaults and what overrides them."""

import argparse

import pytest

from sgl_tts.runtime.server import CPU_CONTINUOUS_DECODE_STEPS, CPU_LAUNCHER, RuntimeConfig, server_command


def flag_values(cmd, flag):
    """Every value given to `flag`, in order (argparse keeps the last)."""
    return [cmd[i + 1] for i, word in enumerate(cmd) if word == flag]


def test_cpu_runtimes_decode_several_steps_per_scheduler_pass_by_default():
    cpu = server_command(RuntimeConfig(device="cpu"), "/m", 1234)
    assert flag_values(cpu, "--num-continuous-decode-steps") == [str(CPU_CONTINUOUS_DECODE_STEPS)]
    assert "--sleep-on-idle" in cpu and flag_values(cpu, "--attention-backend") == ["torch_native"]
    assert flag_values(server_command(RuntimeConfig(device="cuda"), "/m", 1234), "--num-continuous-decode-steps") == []
    mine = server_command(RuntimeConfig(device="cpu", continuous_decode_steps=1), "/m", 1234)
    assert flag_values(mine, "--num-continuous-decode-steps") == ["1"]
    on_gpu = server_command(RuntimeConfig(device="cuda", continuous_decode_steps=2), "/m", 1234)
    assert flag_values(on_gpu, "--num-continuous-decode-steps") == ["2"]
    with pytest.raises(ValueError, match="continuous_decode_steps"):
        RuntimeConfig(continuous_decode_steps=0)


def test_extra_args_come_last_so_they_override_the_defaults():
    cmd = server_command(RuntimeConfig(device="cpu", extra_args=["--num-continuous-decode-steps", "8"]), "/m", 1)
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-continuous-decode-steps", type=int)
    known, _ = parser.parse_known_args(cmd[3:])
    assert known.num_continuous_decode_steps == 8


def test_a_cpu_runtime_is_launched_with_forked_children_and_a_cuda_one_by_sglang():
    assert server_command(RuntimeConfig(device="cpu"), "/m", 1)[1:3] == ["-m", CPU_LAUNCHER] == ["-m", "sgl_tts.runtime.launch"]
    assert server_command(RuntimeConfig(device="cuda"), "/m", 1)[1:3] == ["-m", "sglang.launch_server"]


def test_the_launcher_turns_every_start_method_into_fork():
    from sgl_tts.runtime.launch import fork_children

    calls = []
    forked = fork_children(lambda method, force=False: calls.append((method, force)))
    forked("spawn", force=True)
    forked("forkserver")
    forked(None, force=True)  # None resets the context: kept
    assert calls == [("fork", True), ("fork", False), (None, True)]

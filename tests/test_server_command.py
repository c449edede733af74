"""The launch_server command line a RuntimeConfig becomes: the CPU defaults and what overrides them."""

import argparse

import pytest

from sgl_tts import env_names
from sgl_tts.runtime.memory_plan import model_spec_for
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


def test_a_cpu_runtime_keeps_its_kv_in_bf16_where_the_paged_kernel_reads_it():
    """The pool's dtype on the command line and in the memory plan's bytes a token agree in every case."""
    cases = [  # config, the --kv-cache-dtype values on the command line, KV bytes a token of SmolLM2-135M
        (RuntimeConfig(device="cpu"), ["bf16"], 23040),
        (RuntimeConfig(device="cpu", kv_cache_dtype="model"), [], 46080),
        (RuntimeConfig(device="cpu", kv_cache_dtype="fp8_e4m3"), ["fp8_e4m3"], 11520),
        (RuntimeConfig(device="cpu", extra_args=["--kv-cache-dtype", "auto"]), ["auto"], 46080),
        (RuntimeConfig(device="cpu", extra_args=["--kv-cache-dtype=fp8_e4m3"]), [], 11520),
        (RuntimeConfig(device="cpu", env={env_names.CPU_ATTENTION: "batched"}), [], 46080),
        (RuntimeConfig(device="cpu", attention_backend="intel_amx"), [], 46080),
        (RuntimeConfig(device="cpu", is_embedding=True), [], 46080),  # a reward model keeps its scores' reference
        (RuntimeConfig(device="cuda"), [], None),
    ]
    for config, on_command_line, kv_bytes in cases:
        assert flag_values(server_command(config, "/m", 1), "--kv-cache-dtype") == on_command_line, config
        if kv_bytes is not None:
            assert model_spec_for(config).kv_bytes_per_token == kv_bytes, config
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto, model or one of bf16.*got 'float32'"):
        RuntimeConfig(kv_cache_dtype="float32")


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

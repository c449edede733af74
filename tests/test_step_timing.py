"""The scheduler step trace: hooks that record a step, and the split of a median decode step."""

import json

import pytest

from policies.step_timing import StepTrace, read_trace, step_split
from sgl_tts.bench.runtime import MachineCeiling


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Batch:
    def __init__(self, size, mode="DECODE"):
        self.size = size
        self.forward_mode = type("Mode", (), {"name": mode})()

    def batch_size(self):
        return self.size


def test_hooks_record_the_forward_inside_the_step(tmp_path):
    clock = FakeClock()
    trace = StepTrace(str(tmp_path / "trace.jsonl"), clock)

    def forward(runner):
        clock.now += 0.030
        return "logits"

    def run_batch(scheduler, batch):
        clock.now += 0.002
        assert trace.model_forward(lambda runner: forward(runner), "runner") == "logits"
        clock.now += 0.005  # sampling
        return "result"

    clock.now = 10.0
    assert trace.run_batch(run_batch, "scheduler", Batch(16)) == "result"
    [record] = read_trace(str(tmp_path / "trace.jsonl"))
    assert record["mode"] == "DECODE" and record["batch"] == 16 and record["start"] == 10.0
    assert record["run"] == pytest.approx(0.037) and record["forward"] == pytest.approx(0.030)


def test_step_split_takes_the_median_decode_step_of_one_batch_size():
    records = []
    start = 0.0
    for forward, run, gap in ((0.030, 0.040, 0.050), (0.032, 0.041, 0.052), (0.100, 0.200, 0.300)):
        records.append({"mode": "DECODE", "batch": 8, "start": start, "run": run, "forward": forward})
        start += gap
    records.append({"mode": "DECODE", "batch": 8, "start": start, "run": 0.04, "forward": 0.03})
    records.append({"mode": "EXTEND", "batch": 8, "start": start + 0.05, "run": 0.5, "forward": 0.4})
    records.append({"mode": "DECODE", "batch": 4, "start": start + 0.6, "run": 0.01, "forward": 0.01})
    records.append({"mode": "DECODE", "batch": 8, "start": start + 9.0, "run": 0.04, "forward": 0.03})  # after idle
    split = step_split(records, 8)
    assert split.steps == 3  # the three decode-to-decode gaps of batch 8, not the extend, batch 4 or the idle gap
    assert split.step_s == pytest.approx(0.052)
    assert split.forward_s == pytest.approx(0.032)
    assert split.sampling_s == pytest.approx(0.041 - 0.032)
    assert split.around_s == pytest.approx(0.052 - 0.041)
    assert split.share(split.forward_s) == pytest.approx(0.032 / 0.052)
    assert step_split(records, 16) is None


def test_roofline_bound_is_bandwidth_at_small_batches_and_compute_at_large():
    ceiling = MachineCeiling(flops=100e9, read_bandwidth=20e9)
    parameters = 100_000_000  # 400 MB fp32 per step: 20 ms; 0.2 GFLOP per token: 2 ms per token
    assert ceiling.decode_tokens_per_s(1, parameters) == pytest.approx(1 / 0.020)
    assert ceiling.decode_tokens_per_s(10, parameters) == pytest.approx(10 / 0.020)  # the two are equal at 10
    assert ceiling.decode_tokens_per_s(64, parameters) == pytest.approx(64 / (64 * 0.002))


def test_the_engines_bound_reads_the_bytes_it_keeps_and_multiplies_at_the_faster_rate():
    """The engine's roofline: its weights' bytes as read (not 4 a parameter) over the bandwidth at small batches,
    2 FLOPs a parameter and token over the faster of fp32 and bf16 at large ones; an unmeasured bf16 rate (0) leaves
    fp32's."""
    ceiling = MachineCeiling(flops=100e9, read_bandwidth=20e9, bf16_flops=400e9)
    parameters, read_bytes = 100_000_000, 60_000_000  # 3 ms to read a step; 0.5 ms a token at 400 GFLOP/s
    assert ceiling.engine_tokens_per_s(1, parameters, read_bytes) == pytest.approx(1 / 0.003)
    assert ceiling.engine_tokens_per_s(6, parameters, read_bytes) == pytest.approx(6 / 0.003)  # equal at 6
    assert ceiling.engine_tokens_per_s(64, parameters, read_bytes) == pytest.approx(1 / 0.0005)
    fp32_only = MachineCeiling(flops=100e9, read_bandwidth=20e9)
    assert fp32_only.engine_tokens_per_s(64, parameters, read_bytes) == pytest.approx(1 / 0.002)
    assert ceiling.decode_tokens_per_s(64, parameters) == pytest.approx(64 / (64 * 0.002))  # fp32's bound unchanged


def test_the_bench_table_gives_each_sglang_arms_share_of_the_engines_bound():
    """Each round of an SGLang arm as a share of the bound at its parallel count (median [min-max]); HF and the
    torch loop, and a count without a bound, show none."""
    from sgl_tts.bench.runtime import HF_ARM, TORCH_ARM, Sample, bench_table

    samples = {("now", 8): [Sample(100.0, 0.5), Sample(300.0, 0.5), Sample(200.0, 0.5)],
               (HF_ARM, 8): [Sample(50.0, 1.0)] * 3, (TORCH_ARM, 8): [Sample(80.0, 1.0)] * 3,
               ("now", 16): [Sample(400.0, 0.5)] * 3}
    lines = bench_table(samples, {}, {8: 1000.0}).splitlines()
    assert "of engine bound" in lines[0]
    row = {line.split()[1]: line for line in lines[1:] if line.split()[0] == "8"}
    assert "0.20 [0.10-0.30]" in row["now"]
    assert "0.20 [" not in row[HF_ARM] and "0.20 [" not in row[TORCH_ARM]
    sixteen = next(line for line in lines[1:] if line.split()[0] == "16")
    assert "0.40" not in sixteen  # no bound given at 16


def test_the_bytes_a_step_reads_count_each_grid_weight_at_its_bits_and_the_rest_as_stored():
    """A Q4_1 weight at 4 bits plus an fp16 d and m per group of 32 (0.625 bytes a parameter), a Q8_0 one at 8 bits
    plus an fp16 d (1.0625), a weight on no grid and a norm as stored; and a tied head's embedding once, an untied
    embedding not at all (a step reads one row of it)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from policies.cpu_linear import q4_1_round, q8_0_round
    from sgl_tts.bench.runtime import grid_read_bytes, step_weights

    four, eight, plain = q4_1_round(torch.randn(64, 96)), q8_0_round(torch.randn(32, 64)), torch.randn(16, 32)
    norm = torch.ones(96)
    assert grid_read_bytes([four, eight, plain, norm]) == 64 * 96 * 5 // 8 + 32 * 64 * 17 // 16 + 16 * 32 * 4 + 96 * 4
    config = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2)
    for tied in (True, False):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(tie_word_embeddings=tied, **config))
        read = step_weights(model)
        embedding = model.get_input_embeddings().weight
        assert any(weight is embedding for weight in read) is tied
        assert any(weight is model.get_output_embeddings().weight for weight in read)
        assert len(read) == len(list(model.parameters())) - (0 if tied else 1)


def test_data_parallel_ranks_in_one_file_are_split_by_process():
    records = []
    for pid, offset in ((1, 0.0), (2, 0.013)):  # two ranks stepping 30 ms apart each, interleaved in time
        records += [{"pid": pid, "mode": "DECODE", "batch": 32, "start": offset + 0.030 * i, "run": 0.02,
                     "forward": 0.015} for i in range(5)]
    split = step_split(records, 32)
    assert split.steps == 8 and split.step_s == pytest.approx(0.030)


def test_an_arm_knows_its_data_parallel_ranks():
    from sgl_tts.bench.runtime import RuntimeArm

    assert RuntimeArm("dp", ("--dp-size", "2")).ranks == 2 and RuntimeArm("one", ()).ranks == 1
